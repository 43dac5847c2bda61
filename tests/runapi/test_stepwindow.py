"""Short steps gathered into one telemetry message (``trainguard.run.stepwindow``), over a real socket:
nothing is lost (samples and tokens add up to every step's, also when the script exits without
``close()``), windows end at multiples of their length, a bad loss and a new plan version are
never averaged into other steps, long steps go alone."""

from __future__ import annotations

import math
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import trainguard
from bench.trainjobs import TelemetryCapture
from trainguard.agent.controller.window import by_part
from trainguard.agent.detect.jobview import step_samples
from trainguard.agent.wire import Plan, Telemetry, write_plan_file
from trainguard.run.stepwindow import (
    MAX_PARTS,
    MAX_STEPS,
    PART_S,
    WINDOW_S,
    StepWindow,
    window_length,
    window_steps,
)

REPO = Path(__file__).resolve().parents[2]


def test_window_length_is_a_power_of_two_that_fits_the_flush_interval() -> None:
    assert window_steps(0.1, 0.05) == 1 and window_steps(0.03, 0.05) == 1  # fewer than two fit
    assert window_steps(0.02, 0.05) == 2 and window_steps(0.003, 0.05) == 16
    assert window_steps(1e-6, 0.05) == MAX_STEPS and window_steps(0.0, 0.05) == 1 and window_steps(math.nan, 0.05) == 1


def test_a_window_length_holds_for_exactly_the_step_times_it_names() -> None:
    """The run works a length out again only for a step time outside the span its last answer gave:
    within the span every step time must give that same length, just outside it another one."""
    rng = random.Random(3)
    times = [rng.uniform(1e-5, 0.5) for _ in range(2000)] + [WINDOW_S / 2, WINDOW_S / MAX_STEPS, 1e-9, 5.0]
    for flush_s in (WINDOW_S, PART_S):
        for step_s in times:
            steps, lo, hi = window_length(step_s, flush_s)
            assert steps == window_steps(step_s, flush_s) and lo < step_s <= hi
            for probe in (lo * 1.000001, hi, hi * 0.999999, (lo + min(hi, 10.0)) / 2):
                if lo < probe <= hi:
                    assert window_steps(probe, flush_s) == steps, (step_s, probe, lo, hi)
            for outside in (lo * 0.999, hi * 1.001):
                if 0 < outside < 10.0 and not lo < outside <= hi:
                    assert window_steps(outside, flush_s) != steps, (step_s, outside, lo, hi)
    steps, lo, hi = window_length(0.0, WINDOW_S)
    assert steps == 1 and not lo < 0.0 <= hi  # no span: the next step works it out again


def test_a_window_sums_totals_and_averages_the_rest() -> None:
    w = StepWindow()
    times = (0.001, 0.002, 0.0, 0.001)
    w.add(0, 0.004, times, 8, 80, {"loss": 2.0, "grad_norm": 1.0, "mfu": 0.5}, 3)
    w.add(1, 0.006, times, 4, 40, {"loss": 4.0, "mfu": 0.3, "val_loss": 9.0}, 3)
    f = w.message_fields()
    assert f["steps"] == 2 and f["samples"] == 12 and f["tokens"] == 120
    assert math.isclose(f["step_s"], 0.005) and math.isclose(f["loss"], 3.0) and f["grad_norm"] == 1.0
    assert math.isclose(f["mfu"], 0.4) and f["val_loss"] == 9.0 and math.isnan(f["local_grad_sq"])
    w.add(2, 0.005, times, 4, 40, {"loss": math.inf}, 3)
    assert w.message_fields()["loss"] == math.inf  # a diverged step is not averaged away
    w.clear()
    assert w.steps == 0 and not w.has_loss


def test_a_window_carries_its_compute_and_loss_in_parts() -> None:
    w = StepWindow()
    for step in range(8, 14):  # parts of 2 steps (ending at multiples of 2), then a cut-off one
        w.add(step, 0.01, (0.0, 0.001 * step, 0.0, 0.0005), 4, 40,
              {"loss": float(step)} if step < 12 else {}, 0, 2)
    f = w.message_fields()
    assert f["parts"] == [[2, 0.0085, 0.0005, 8, 8.5], [2, 0.0105, 0.0005, 8, 10.5], [2, 0.0125, 0.0005, 8, None]]
    w.add(14, 0.01, (0.0, 0.014, 0.0, 0.0), 3, 30, {"loss": math.inf}, 0, 2)
    assert w.message_fields()["parts"][-1] == [1, 0.014, 0.0, 3, math.inf]  # the part in progress goes too
    assert math.isclose(w.message_fields()["fwd_bwd_s"], sum(0.001 * s for s in range(8, 15)) / 7)
    w.clear()
    w.add(0, 0.01, (0.0, 0.001, 0.0, 0.0), 4, 40, {}, 0, 1)
    assert "parts" not in w.message_fields()  # one part is the message itself
    for step in range(1, MAX_PARTS):
        w.add(step, 0.01, (0.0, 0.001, 0.0, 0.0), 4, 40, {}, 0, 1)
    assert w.parts_full


def _parted_messages() -> tuple[Telemetry, Telemetry]:
    base = dict(job="j", rank=0, local_rank=0, pid=1, step_s=0.01, data_s=0.0, comm_s=0.0,
                grad_norm=1.0, local_grad_sq=0.0, lr=0.1, batch_size=4, mem_bytes=1, plan_version=0)
    plain = Telemetry(step=4, steps=4, wall_time=1.0, fwd_bwd_s=0.02, opt_s=0.001, samples=16, tokens=0, loss=3.0, **base)
    parted = Telemetry(step=10, steps=6, wall_time=2.0, fwd_bwd_s=0.03, opt_s=0.001, samples=30, tokens=0, loss=2.0,
                       parts=[[4, 0.02, 0.001, 16, 2.5], [2, 0.05, 0.001, 14, None]], **base)
    return plain, parted


def test_the_detector_takes_each_part_as_a_sample() -> None:
    got = [(s.step, s.fwd_bwd_s, s.opt_s, s.samples) for s in step_samples(list(_parted_messages()))]
    assert got == [(4, 0.02, 0.001, 4), (8, 0.02, 0.001, 4), (10, 0.05, 0.001, 7)]


def test_the_controller_takes_each_part_as_a_point() -> None:
    plain, parted = _parted_messages()
    assert by_part(plain) == [plain]
    first, last = by_part(parted)
    assert (first.step, first.steps, first.samples, first.loss, first.fwd_bwd_s) == (8, 4, 16, 2.5, 0.02)
    assert math.isclose(first.wall_time, 2.0 - 2 * 0.01) and first.parts is None
    assert (last.step, last.steps, last.samples, last.loss, last.wall_time) == (10, 2, 14, 2.0, 2.0)  # no loss: the message's


def _fast_steps(run: trainguard.Run, steps: range, samples: int, nan_at: int = -1) -> None:
    for step in steps:
        with run.step(step, samples=samples, tokens=10 * samples) as s:
            with s.phase("compute"):
                pass
            s.report(loss=math.nan if step == nan_at else float(step))


def _wait_for(cap: TelemetryCapture, samples: int) -> list[Telemetry]:
    deadline = time.monotonic() + 5
    while sum(m.samples for m in cap.messages) < samples and time.monotonic() < deadline:
        time.sleep(0.02)
    return list(cap.messages)


def test_a_slow_step_does_not_cut_a_window_off_its_multiples(tmp_path: Path) -> None:
    """A slower step shortens the window; the one in progress still ends at a multiple of a power
    of two (where the other ranks' windows end too), not at once where it stood."""
    sock = str(tmp_path / "t.sock")
    cap = TelemetryCapture(sock)
    slow_took = 0.0
    try:
        run = trainguard.init(environ={"TRAINGUARD_SOCKET": sock, "TRAINGUARD_JOB": "j"})
        _fast_steps(run, range(0, 100), 4)
        with run.step(100, samples=4, tokens=40) as s:
            t0 = time.perf_counter()
            time.sleep(0.003)  # 64 of these fit WINDOW_S, not 128: the window shrinks
            slow_took = time.perf_counter() - t0
            s.report(loss=100.0)
        _fast_steps(run, range(101, 200), 4)
        run.close()
        msgs = _wait_for(cap, 4 * 200)
    finally:
        cap.close()
    assert sum(m.steps for m in msgs) == 200 and msgs[-1].step == 200
    holding = next(m for m in msgs if m.step - m.steps <= 100 < m.step)
    assert holding.steps > 1, holding  # the slow step went with the window it fell in
    for m in msgs[:-1]:
        aligned = m.step % (1 << (m.steps - 1).bit_length()) == 0
        # (A sleep stretched past half the flush interval by a loaded machine is a step sent alone.)
        assert aligned or (m is holding and slow_took >= WINDOW_S / 2), (m.step, m.steps, slow_took)


def test_fast_steps_are_gathered_and_nothing_is_lost(tmp_path: Path) -> None:
    sock, plan_path = str(tmp_path / "t.sock"), str(tmp_path / "plan.json")
    cap = TelemetryCapture(sock)
    try:
        run = trainguard.init(environ={"TRAINGUARD_SOCKET": sock, "TRAINGUARD_JOB": "j", "TRAINGUARD_PLAN": plan_path})
        _fast_steps(run, range(0, 300), 4, nan_at=200)
        write_plan_file(plan_path, Plan(version=1, lr_scale=0.5))
        deadline = time.monotonic() + 5
        step = 300
        while run.plan.version < 1 and time.monotonic() < deadline:
            _fast_steps(run, range(step, step + 1), 4)
            step += 1
        applied_after = step
        _fast_steps(run, range(step, step + 100), 4)
        step += 100
        _fast_steps(run, range(step, step + 3), 4)  # not a window's end: sent by close()
        step += 3
        run.close()
        msgs = _wait_for(cap, 4 * step)
    finally:
        cap.close()
    assert sum(m.samples for m in msgs) == 4 * step and sum(m.tokens for m in msgs) == 40 * step
    assert sum(m.steps for m in msgs) == step and msgs[-1].step == step
    gathered = [m for m in msgs if m.steps > 1]
    assert gathered and max(m.steps for m in msgs) <= MAX_STEPS
    [bad] = [m for m in msgs if m.has_loss and not math.isfinite(m.loss)]
    assert bad.step == 201  # sent at once, with the steps before it in its window
    for m in gathered:
        if m not in (bad, msgs[-1]) and m.step != applied_after:
            # A window ends where the step count is a multiple of its length, a power of two at
            # least as long as the steps it holds (one cut short by an urgent send holds fewer).
            assert m.step % (1 << (m.steps - 1).bit_length()) == 0, (m.step, m.steps)
        first = m.step - m.steps
        assert math.isclose(m.loss, sum(range(first, m.step)) / m.steps) or m is bad
    # One plan version per message: the first under the new plan starts at a step it was applied at.
    first_new = next(m for m in msgs if m.plan_version == 1)
    assert all(m.plan_version == 0 for m in msgs[: msgs.index(first_new)])
    assert msgs[msgs.index(first_new) - 1].step == applied_after  # the old plan's steps sent apart
    assert first_new.step - first_new.steps == applied_after


def test_steps_of_a_few_milliseconds_go_in_parts_of_at_most_the_part_span(tmp_path: Path) -> None:
    """Over a real socket: a message of up to WINDOW_S of 3 ms steps carries parts of up to PART_S
    whose steps, samples and compute add up to the message's."""
    sock = str(tmp_path / "t.sock")
    cap = TelemetryCapture(sock)
    try:
        run = trainguard.init(environ={"TRAINGUARD_SOCKET": sock, "TRAINGUARD_JOB": "j"})
        for step in range(200):
            with run.step(step, samples=2, tokens=20) as s:
                with s.phase("compute"):
                    deadline = time.perf_counter() + 0.003
                    while time.perf_counter() < deadline:  # burns CPU: compute is thread CPU time
                        pass
                s.report(loss=1.0)
        run.close()
        msgs = _wait_for(cap, 2 * 200)
    finally:
        cap.close()
    assert sum(m.steps for m in msgs) == 200
    parted = [m for m in msgs if m.parts]
    assert parted, [(m.step, m.steps) for m in msgs]
    for m in parted:
        assert sum(p[0] for p in m.parts) == m.steps and sum(p[3] for p in m.parts) == m.samples
        assert math.isclose(sum(p[0] * p[1] for p in m.parts) / m.steps, m.fwd_bwd_s, abs_tol=1e-6)
        # Steps of at least 3 ms: parts of at most the power of two of them that fits PART_S.
        assert all(p[0] <= window_steps(0.003, PART_S) and p[1] > 0 for p in m.parts), m.parts


def test_a_script_that_never_closes_its_run_still_sends_its_last_steps(tmp_path: Path) -> None:
    sock = str(tmp_path / "t.sock")
    cap = TelemetryCapture(sock)
    script = ("import trainguard\nrun = trainguard.init()\n"
              "for step in range(203):\n"
              "    with run.step(step, samples=2):\n        pass\n")
    try:
        proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, timeout=60, capture_output=True, text=True,
                              env={**os.environ, "TRAINGUARD_SOCKET": sock, "TRAINGUARD_JOB": "j",
                                   "PYTHONPATH": str(REPO)})
        assert proc.returncode == 0, proc.stderr
        msgs = _wait_for(cap, 2 * 203)
    finally:
        cap.close()
    assert sum(m.samples for m in msgs) == 2 * 203 and msgs[-1].step == 203
    assert any(m.steps > 1 for m in msgs)


def test_a_long_step_goes_alone(tmp_path: Path) -> None:
    sock = str(tmp_path / "t.sock")
    cap = TelemetryCapture(sock)
    n = MAX_STEPS  # the fast steps' windows end where the long one begins
    try:
        run = trainguard.init(environ={"TRAINGUARD_SOCKET": sock, "TRAINGUARD_JOB": "j"})
        _fast_steps(run, range(0, n), 1)
        with run.step(n, samples=1):
            time.sleep(WINDOW_S * 1.5)
        _fast_steps(run, range(n + 1, n + 6), 1)
        run.close()
        msgs = _wait_for(cap, n + 6)
    finally:
        cap.close()
    [long] = [m for m in msgs if m.step == n + 1]
    assert long.steps == 1 and long.step_s >= WINDOW_S
    assert sum(m.samples for m in msgs) == n + 6
