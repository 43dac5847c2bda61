"""On a CUDA GPU: does the compute time that stragglers are judged on leave out a collective wait?

Run by ``bench/gpu_check.py``. One process, the real ``trainguard.Run`` step path with
``watch_gradients``: each step's compute phase runs forward and backward, then holds the compute
stream for a known time after the last gradient (``torch.cuda._sleep``), standing in for the
wait DDP and FSDP put on it at the end of backward for the gradient all-reduce (one GPU cannot
host two NCCL ranks). The phase's wall time holds that wait; the gradient clock (CUDA events)
must not. Prints ``CLOCK device=… wall_ms=… clocked_ms=… wait_ms=… clocked_vs_wall_ratio=… ok=…``.

Then the same with a real wait: two ranks in one torch DDP job on the one device (gloo carries the
CUDA gradients, since NCCL refuses two ranks on one GPU), rank 1 slowed by a host delay inside its
compute phase, so rank 0 waits for it in DDP's end-of-backward. Rank 0's clocked compute must leave
that wait out and rank 1's must hold its delay: the ranks' clocked times tell the slow one apart,
their wall times do not. Prints ``DDP device=… fast_wall_ms=… fast_clocked_ms=… slow_clocked_ms=…
delay_ms=… ok=…``.
``--device cpu`` runs the same step paths with host stand-ins (a wall clock, a sleep): the smoke test.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import trainguard  # noqa: E402
from trainguard.run.computetime import ClockStamps, GradientClock  # noqa: E402


def _net(device: str, width: int) -> tuple[torch.device, nn.Module, torch.Tensor]:
    """The device, a 6-layer MLP on it and its input batch."""
    dev = torch.device(device, 0) if device == "cuda" else torch.device("cpu")
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(6)]).to(dev)
    return dev, model, torch.randn(256 if device == "cuda" else 16, width, device=dev)


def _watched_run(model: nn.Module, device: str) -> trainguard.Run:
    """A run with no agent (telemetry a no-op; timings read from the step itself) whose gradient
    clock is the default one on CUDA (CUDA events), a host wall clock on the CPU."""
    run = trainguard.init()
    if device == "cuda":
        run.watch_gradients(model.parameters())
    else:
        run.watch_gradients(model.parameters(), clock=GradientClock(ClockStamps(time.perf_counter)))
    return run


def _timed_steps(run: trainguard.Run, model: nn.Module, steps: int, samples: int,
                 compute: Callable[[int], None], before: Callable[[], None] = lambda: None) -> tuple[float, float]:
    """(median compute-phase wall ms, median clocked compute ms) of ``steps`` steps whose compute
    phase runs ``compute(step)`` (``before()`` ahead of each step); the first steps warm up
    allocators and kernels and are left out."""
    walls, clocked = [], []
    for step in range(steps):
        before()
        with run.step(step, samples=samples) as s:
            with s.phase("compute"):
                compute(step)
            times = s.timings(step_s=time.perf_counter() - s._t0, step_cpu_s=0.0)
        walls.append(s.wall["compute"])
        clocked.append(times["fwd_bwd_s"])
        model.zero_grad(set_to_none=True)
    run.close()
    skip = min(2, steps - 1)
    return 1000 * statistics.median(walls[skip:]), 1000 * statistics.median(clocked[skip:])


def measure(device: str, steps: int, width: int, wait_ms: float) -> tuple[float, float, float]:
    """(median compute-phase wall ms, median clocked compute ms, median wait ms as it ran) over ``steps`` steps.

    On CUDA: the default gradient clock (CUDA events) and a GPU sleep on the compute stream. On the
    CPU (the smoke test's smallest configuration): the same step path with a host wall clock for
    the stamps and a host sleep for the wait."""
    dev, model, x = _net(device, width)
    run = _watched_run(model, device)
    waited: list[float] = []  # each step's wait as it ran, in ms: the clock rate moves under load
    if device == "cuda":
        # Calibrate the stand-in wait on this GPU's clock rate; the first run of the check (an idle
        # GPU ramping its clock up) waited half the intended time, so each wait is also timed.
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(2):
            start.record()
            torch.cuda._sleep(50_000_000)
            end.record()
            end.synchronize()
        cycles = int(wait_ms / (start.elapsed_time(end) / 50_000_000))

        def wait() -> None:
            start.record()
            torch.cuda._sleep(cycles)  # the end-of-backward all-reduce wait, on the compute stream
            end.record()
            torch.cuda.synchronize(dev)
            waited.append(start.elapsed_time(end))
    else:
        def wait() -> None:
            t0 = time.perf_counter()
            time.sleep(wait_ms / 1000)
            waited.append(1000 * (time.perf_counter() - t0))

    def compute(_: int) -> None:
        model(x).pow(2).mean().backward()
        wait()

    wall, clock = _timed_steps(run, model, steps, x.shape[0], compute)
    return wall, clock, statistics.median(waited[min(2, steps - 1):])


def _ddp_rank(rank: int, device: str, port: int, steps: int, width: int, delay_ms: float, out: Any) -> None:
    """One rank of the two-rank DDP job; puts (rank, median wall ms, median clocked ms) on ``out``."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    dev, net, x = _net(device, width)
    model = DistributedDataParallel(net, device_ids=[0] if device == "cuda" else None)
    run = _watched_run(model, device)

    def compute(_: int) -> None:
        if rank == 1:
            time.sleep(delay_ms / 1000)  # a slow rank: its compute takes longer
        model(x).pow(2).mean().backward()
        if device == "cuda":
            torch.cuda.synchronize(dev)

    # Both ranks start each step together, so rank 0's wait is rank 1's delay.
    wall, clock = _timed_steps(run, model, steps, x.shape[0], compute, before=dist.barrier)
    out.put((rank, wall, clock))
    dist.destroy_process_group()


def measure_ddp(device: str, steps: int, width: int, delay_ms: float) -> dict[int, tuple[float, float]]:
    """{rank: (median compute-phase wall ms, median clocked compute ms)} of the two-rank DDP job."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_ddp_rank, args=(r, device, port, steps, width, delay_ms, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    results = {}
    for _ in procs:
        rank, wall, clock = out.get(timeout=150)
        results[rank] = (wall, clock)
    for p in procs:
        p.join(timeout=30)
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                    help="cpu: the same path with host stand-ins (no GPU needed; the smoke test)")
    ap.add_argument("--quick", action="store_true", help="fewer steps, a smaller model")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("CLOCK skipped: no CUDA")
        return 0
    steps, width = (4, 64) if args.quick else (8, 2048 if args.device == "cuda" else 256)
    wall_ms, clock_ms, wait_ms = measure(args.device, steps, width, 40.0)
    ok = 0 < clock_ms < wall_ms - 0.7 * wait_ms
    print(f"CLOCK device={args.device} wall_ms={wall_ms:.2f} clocked_ms={clock_ms:.2f} wait_ms={wait_ms:.2f} "
          f"clocked_vs_wall_ratio={clock_ms / wall_ms:.3f} ok={ok}")
    delay_ms = 40.0
    ranks = measure_ddp(args.device, steps + 2, width, delay_ms)
    (fast_wall, fast_clock), (slow_wall, slow_clock) = ranks[0], ranks[1]
    # The fast rank waited about the delay in its compute phase's wall time, not in its clocked time;
    # the slow rank's clocked time holds the delay (it was inside its compute).
    ddp_ok = (fast_wall - fast_clock >= 0.7 * delay_ms and slow_clock - fast_clock >= 0.7 * delay_ms
              and fast_clock > 0)
    print(f"DDP device={args.device} fast_wall_ms={fast_wall:.2f} fast_clocked_ms={fast_clock:.2f} "
          f"slow_wall_ms={slow_wall:.2f} slow_clocked_ms={slow_clock:.2f} delay_ms={delay_ms:.2f} ok={ddp_ok}")
    return 0 if ok and ddp_ok else 1


if __name__ == "__main__":
    sys.exit(main())
