"""On a CUDA GPU: does the compute time that stragglers are judged on leave out a collective wait?

Run by ``bench/gpu_check.py``. One process, the real ``trainguard.Run`` step path with
``watch_gradients``: each step's compute phase runs forward and backward, then holds the compute
stream for a known time after the last gradient (``torch.cuda._sleep``), standing in for the
wait DDP and FSDP put on it at the end of backward for the gradient all-reduce (one GPU cannot
host two NCCL ranks). The phase's wall time holds that wait; the gradient clock (CUDA events)
must not. Prints ``CLOCK wall_ms=… clocked_ms=… wait_ms=… ok=…``.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import trainguard  # noqa: E402


def main() -> int:
    if not torch.cuda.is_available():
        print("CLOCK skipped: no CUDA")
        return 0
    dev = torch.device("cuda", 0)
    model = nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(6)]).to(dev)
    x = torch.randn(256, 2048, device=dev)
    run = trainguard.init()  # no agent: telemetry is a no-op, timings are read from the step itself
    run.watch_gradients(model.parameters())
    # Calibrate the stand-in wait: ~40 ms of GPU sleep on this clock rate.
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(50_000_000)
    end.record()
    end.synchronize()
    per_cycle_ms = start.elapsed_time(end) / 50_000_000
    cycles = int(40.0 / per_cycle_ms)
    walls, clocked = [], []
    for step in range(8):
        with run.step(step, samples=256) as s:
            with s.phase("compute"):
                model(x).pow(2).mean().backward()
                torch.cuda._sleep(cycles)  # the end-of-backward all-reduce wait
                torch.cuda.synchronize(dev)
            times = s.timings(step_s=time.perf_counter() - s._t0, step_cpu_s=0.0)
        walls.append(s.wall["compute"])
        clocked.append(times["fwd_bwd_s"])
        for p in model.parameters():
            p.grad = None
    wall_ms, clock_ms = 1000 * statistics.median(walls[2:]), 1000 * statistics.median(clocked[2:])
    wait_ms = cycles * per_cycle_ms
    ok = 0 < clock_ms < wall_ms - 0.7 * wait_ms
    print(f"CLOCK wall_ms={wall_ms:.2f} clocked_ms={clock_ms:.2f} wait_ms={wait_ms:.2f} ok={ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
