"""On a CUDA GPU: does the compute time that stragglers are judged on leave out a collective wait?

Run by ``bench/gpu_check.py``. One process, the real ``trainguard.Run`` step path with
``watch_gradients``: each step's compute phase runs forward and backward, then holds the compute
stream for a known time after the last gradient (``torch.cuda._sleep``), standing in for the
wait DDP and FSDP put on it at the end of backward for the gradient all-reduce (one GPU cannot
host two NCCL ranks). The phase's wall time holds that wait; the gradient clock (CUDA events)
must not. Prints ``CLOCK device=… wall_ms=… clocked_ms=… wait_ms=… clocked_vs_wall_ratio=… ok=…``.
``--device cpu`` runs the same step path with host stand-ins (a wall clock, a sleep): its smoke test.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import trainguard  # noqa: E402
from trainguard.computetime import ClockStamps, GradientClock  # noqa: E402


def measure(device: str, steps: int, width: int, wait_ms: float) -> tuple[float, float, float]:
    """(median compute-phase wall ms, median clocked compute ms, wait ms) over ``steps`` steps.

    On CUDA: the default gradient clock (CUDA events) and a GPU sleep on the compute stream. On the
    CPU (the smoke test's smallest configuration): the same step path with a host wall clock for
    the stamps and a host sleep for the wait."""
    dev = torch.device(device, 0) if device == "cuda" else torch.device("cpu")
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(6)]).to(dev)
    x = torch.randn(256 if device == "cuda" else 16, width, device=dev)
    run = trainguard.init()  # no agent: telemetry is a no-op, timings are read from the step itself
    if device == "cuda":
        run.watch_gradients(model.parameters())
        # Calibrate the stand-in wait on this GPU's clock rate.
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(50_000_000)
        end.record()
        end.synchronize()
        cycles = int(wait_ms / (start.elapsed_time(end) / 50_000_000))

        def wait() -> None:
            torch.cuda._sleep(cycles)  # the end-of-backward all-reduce wait, on the compute stream
            torch.cuda.synchronize(dev)
    else:
        run.watch_gradients(model.parameters(), clock=GradientClock(ClockStamps(time.perf_counter)))

        def wait() -> None:
            time.sleep(wait_ms / 1000)
    walls, clocked = [], []
    for step in range(steps):
        with run.step(step, samples=x.shape[0]) as s:
            with s.phase("compute"):
                model(x).pow(2).mean().backward()
                wait()
            times = s.timings(step_s=time.perf_counter() - s._t0, step_cpu_s=0.0)
        walls.append(s.wall["compute"])
        clocked.append(times["fwd_bwd_s"])
        for p in model.parameters():
            p.grad = None
    run.close()
    skip = min(2, steps - 1)  # the first steps warm up allocators and kernels
    return 1000 * statistics.median(walls[skip:]), 1000 * statistics.median(clocked[skip:]), wait_ms


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
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
