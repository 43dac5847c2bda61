"""Compute time without the collective wait (trainguard.run.computetime), the CUDA logic on the CPU.

On CUDA the gradient clock's stamps are events on the compute stream, a wall clock. Here the same
code path runs with a host wall clock in a real two-rank gloo DDP job whose rank 1 is slow: timed by
wall (what the step saw on CUDA before), the fast rank's compute holds the all-reduce wait and both
ranks look alike; timed to the last gradient, the fast rank's compute is its own.
"""

from __future__ import annotations

import json
import os
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import trainguard
import trainguard.run.computetime as computetime
import trainguard.run.step as step_module
import trainguard.run.telemetry as telemetry_module
from bench.trainjobs import TelemetryCapture
from tests.conftest import join_ranks
from trainguard.agent.lifecycle.launcher import free_port
from trainguard.run.computetime import ClockStamps, GradientClock

SLOW_S = 0.12
"""Rank 1's extra time per step inside its compute, before the forward pass (a slow device)."""


class _Stamps:
    def __init__(self) -> None:
        self.t = 0.0
        self.t0 = 0.0
        self.t1: float | None = None

    def begin(self) -> None:
        self.t0, self.t1 = self.t, None

    def mark(self) -> None:
        self.t1 = self.t

    def elapsed_s(self) -> float | None:
        return None if self.t1 is None else self.t1 - self.t0


def test_the_clock_spans_begin_to_the_last_gradient_and_clears_each_step() -> None:
    stamps = _Stamps()
    clock = GradientClock(stamps)
    model = nn.Linear(3, 2)
    assert clock.watch(model.parameters()) == 2
    model(torch.ones(1, 3)).sum().backward()  # before any begin(): not a step's gradient
    assert clock.take() is None
    clock.begin()
    stamps.t = 0.5
    model(torch.ones(1, 3)).sum().backward()
    stamps.t = 0.9  # later work (the optimizer, a collective wait) does not move the span
    assert clock.take() == pytest.approx(0.5)
    assert clock.take() is None  # cleared
    clock.begin()
    assert clock.take() is None  # a step without backward is unmeasured
    clock.close()
    clock.begin()
    model(torch.ones(1, 3)).sum().backward()
    assert clock.take() is None  # hooks removed


class _Ticks:
    """Hooks that advance the fake clock by one at each gradient landing, before the clock's own."""

    def __init__(self, stamps: _Stamps, params: list[nn.Parameter]) -> None:
        self.handles = [p.register_post_accumulate_grad_hook(lambda _p: self.tick()) for p in params]
        self.stamps = stamps

    def tick(self) -> None:
        self.stamps.t += 1


def test_once_the_same_parameter_comes_last_only_it_stays_hooked_and_the_span_is_unchanged(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(computetime, "VERIFY_EVERY", 4)
    first, second = nn.Linear(3, 3), nn.Linear(3, 3)
    params = [*first.parameters(), *second.parameters()]
    stamps = _Stamps()
    _Ticks(stamps, params)
    clock = GradientClock(stamps)
    assert clock.watch(params) == 4

    def step(*layers: nn.Module) -> float | None:
        clock.begin()
        stamps.begin()
        x = torch.ones(1, 3)
        for layer in layers:
            x = layer(x)
        x.sum().backward()
        return clock.take()

    spans = [step(first, second) for _ in range(computetime.LEARN_STEPS)]
    assert spans == [4.0] * computetime.LEARN_STEPS  # every gradient ticked; the span ends at the last
    assert clock.hooked == 1
    assert step(first, second) == 4.0  # one hook, the same span
    # The graph changes: the second layer runs first, its gradients now land last. The one hook
    # still fires (too early) until the next check with every hook finds the new last parameter.
    after = [step(second, first) for _ in range(computetime.VERIFY_EVERY + computetime.LEARN_STEPS + 2)]
    assert after[-1] == 4.0 and clock.hooked == 1
    assert any(span != 4.0 for span in after)  # what the checks are there for
    # A step that gives the hooked parameter no gradient: unmeasured, and every hook comes back.
    assert step(first) is None
    assert clock.hooked == 4
    assert step(first) == 2.0  # the first layer alone: its two gradients
    clock.close()
    assert clock.hooked == 0


def test_a_mark_from_another_thread_leaves_the_step_unmeasured() -> None:
    stamps = ClockStamps(time.perf_counter)
    stamps.begin()
    t = threading.Thread(target=stamps.mark)
    t.start()
    t.join()
    assert stamps.elapsed_s() is None
    stamps.begin()
    stamps.mark()
    assert (stamps.elapsed_s() or -1) >= 0


def test_step_timings_take_the_clock_and_count_the_rest_as_waiting(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.setattr(step_module, "cuda_in_use", lambda: True)  # wall time, as on CUDA
    stamps = _Stamps()
    run = trainguard.init(environ={"HOME": str(tmp_path)})
    run.watch_gradients([], clock=GradientClock(stamps))
    model = nn.Linear(2, 1)
    run._grad_clock.watch(model.parameters())
    with run.step(0, samples=4) as s:
        with s.phase("compute"):
            stamps.t = 0.02
            model(torch.zeros(4, 2)).sum().backward()
            time.sleep(0.05)  # the end-of-backward all-reduce wait
        times = s.timings(step_s=0.06, step_cpu_s=0.0)
    assert times["fwd_bwd_s"] == pytest.approx(0.02)
    assert times["comm_s"] >= 0.05 - 0.02  # the rest of the phase's wall time is waiting
    run.close()


# --- a real gloo DDP job, forked ------------------------------------------------------------


def _ranks(rank: int, nproc: int, port: int, out_dir: str, clocked: bool) -> None:
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TRAINGUARD_JOB": "c"})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=nproc)
    telemetry_module.cuda_in_use = lambda: True  # the step's compute by wall time, as on CUDA
    sock = str(Path(out_dir, f"t{rank}.sock"))
    cap = TelemetryCapture(sock)
    os.environ["TRAINGUARD_SOCKET"] = sock
    run = trainguard.init()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 1)))
    if clocked:
        run.watch_gradients(model.parameters(), clock=GradientClock(ClockStamps(time.perf_counter)))
    x = torch.randn(64, 128)
    for step in range(8):
        with run.step(step, samples=64) as s:
            with s.phase("compute"):
                if rank == 1:
                    time.sleep(SLOW_S)
                model(x).pow(2).mean().backward()
    deadline = time.monotonic() + 5
    while len(cap.messages) < 8 and time.monotonic() < deadline:
        time.sleep(0.02)
    cap.close()
    compute = [m.fwd_bwd_s for m in cap.messages][2:]  # past the first steps' warm-up
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(compute))
    run.close()
    del model
    dist.destroy_process_group()


def _median_compute(tmp_path: Path, clocked: bool) -> tuple[float, float]:
    out = tmp_path / ("clocked" if clocked else "wall")
    out.mkdir()
    join_ranks(mp.start_processes(_ranks, args=(2, free_port(), str(out), clocked), nprocs=2, start_method="fork",
                                  join=False), "compute time")
    fast, slow = (statistics.median(json.loads((out / f"rank{r}.json").read_text())) for r in (0, 1))
    return fast, slow


def test_the_fast_ranks_compute_leaves_out_the_wait_for_the_slow_one(tmp_path: Path) -> None:
    fast_wall, slow_wall = _median_compute(tmp_path, clocked=False)
    fast, slow = _median_compute(tmp_path, clocked=True)
    # By wall time the fast rank waited out the slow one's delay in DDP's end-of-backward all-reduce.
    assert fast_wall >= 0.7 * SLOW_S and fast_wall / slow_wall > 0.5, (fast_wall, slow_wall)
    # To its last gradient it computed only its own work; the slow rank's delay is its own compute.
    # Rank against rank, both under the same load: a loaded machine lengthens both ranks' own
    # work, while a clock that counted the wait would put the whole delay into the fast rank's.
    assert slow >= SLOW_S and fast <= slow - 0.5 * SLOW_S, (fast, slow)


def test_parameters_on_the_cpu_get_no_hook_and_the_step_is_timed_by_thread_cpu(tmp_path: Path) -> None:
    """On the CPU the compute phase's thread CPU time already leaves a collective wait out: no
    gradient hook is set (one costs every step), and a wait inside the phase is still not compute."""
    run = trainguard.init(environ={"HOME": str(tmp_path)})
    model = nn.Linear(2, 1)
    run.watch_gradients(model.parameters())
    assert run._grad_clock is None and not model.weight._post_accumulate_grad_hooks
    with run.step(0, samples=4) as s:
        with s.phase("compute"):
            model(torch.zeros(4, 2)).sum().backward()
            time.sleep(0.05)  # as a gloo all-reduce wait sleeps
        times = s.timings(step_s=0.06, step_cpu_s=0.0)
    assert times["fwd_bwd_s"] < 0.02 and times["comm_s"] >= 0.04
    run.close()
