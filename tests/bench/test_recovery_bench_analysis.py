"""bench/recovery.py's accounting on synthetic rank-0 rows: a recovery that continues the step
sequence (restored at the killed step, as trainguard's snapshots and torchft's live state do) is a
failure measured from the killed attempt's last row, and its gap is not checkpoint overhead."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path
from types import SimpleNamespace

from trainguard.agent.recovery.service import recovery_timeline

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("recovery_bench", REPO / "bench" / "recovery.py")
assert _spec is not None and _spec.loader is not None
recovery = importlib.util.module_from_spec(_spec)
sys.modules["recovery_bench"] = recovery
_spec.loader.exec_module(recovery)


def rows(steps: range, start: float, step_s: float = 0.1, gap_s: float = 0.01) -> list[dict[str, float]]:
    return [{"step": s, "time": start + i * (step_s + gap_s), "step_s": step_s} for i, s in enumerate(steps)]


def test_a_recovery_that_continues_the_steps_is_a_failure_not_overhead() -> None:
    before = rows(range(1, 41), 1000.0)
    kill_ts = before[-1]["time"] - 0.005  # rank 1 died a few ms before rank 0 printed step 40
    after = rows(range(41, 81), kill_ts + 2.0)
    all_rows = before + after
    found = recovery.failure_after(all_rows, kill_ts, restored=40)
    assert found is not None
    index, failure = found
    assert index == 40 and failure.kill_step == 40 and failure.steps_lost == 0
    assert math.isclose(failure.resume_s, after[0]["time"] - before[-1]["time"])
    res = recovery.analyse("x", all_rows, 0, {index: failure})
    assert res.failures == [failure]
    assert math.isclose(res.overhead, 0.01 / 0.11, rel_tol=1e-6)  # the plain gaps only, not the 2 s
    # Without being told, the same rows read as one 2 s stall of overhead and no failure.
    blind = recovery.analyse("x", all_rows, 0)
    assert blind.failures == [] and blind.overhead > 0.1


def test_a_restore_to_an_earlier_step_is_found_from_the_steps() -> None:
    all_rows = rows(range(1, 41), 1000.0) + rows(range(33, 60), 1010.0)
    res = recovery.analyse("x", all_rows, 0)
    assert [(f.kill_step, f.restored_step, f.steps_lost) for f in res.failures] == [(40, 32, 8)]


def test_a_restart_right_after_a_checkpoint_is_found_from_the_attempt() -> None:
    """A kill just after a checkpoint step: the new attempt carries on from the killed step, so only
    the rows' attempt tells the restart (the quick run's iso interval once fell on a kill step)."""
    before = [dict(r, attempt=0) for r in rows(range(1, 41), 1000.0)]
    after = [dict(r, attempt=1) for r in rows(range(41, 60), 1005.0)]
    res = recovery.analyse("x", before + after, 40)
    assert [(f.kill_step, f.restored_step, f.steps_lost) for f in res.failures] == [(40, 40, 0)]
    assert math.isclose(res.failures[0].resume_s, after[0]["time"] - before[-1]["time"])
    assert res.overhead < 0.1  # the restart's 5 s are not a checkpoint's stall


def test_a_warm_restart_faster_than_the_slack_is_one_failure() -> None:
    """The agent's warm restart printed its first step 0.09 s after the kill, inside the slack for
    the killed attempt's late rows: the attempt ends that attempt, so the recovery is not counted
    twice (fresh-clone CI counted 3 failures for 2 kills)."""
    before = [dict(r, attempt=1) for r in rows(range(80, 90), 1000.0, step_s=0.01, gap_s=0.0)]
    kill_ts = before[-1]["time"] - 0.002  # rank 0 printed step 89 2 ms after rank 1 died
    after = [dict(r, attempt=2) for r in rows(range(89, 120), kill_ts + 0.09, step_s=0.01, gap_s=0.0)]
    all_rows = before + after
    found = recovery.failure_after(all_rows, kill_ts, restored=88)
    assert found is not None
    index, failure = found
    assert index == len(before) and failure.kill_step == 89 and failure.steps_lost == 1
    res = recovery.analyse("x", all_rows, 0, {index: failure})
    assert res.failures == [failure]


def test_time_in_kept_steps_counts_each_step_once_and_a_slow_one_in_full() -> None:
    """Beside the effective time (final step x median step / wall), the steps whose work was kept:
    each step's last run with its own time, so a restore's recomputed steps count once and a slow
    step counts whole, where the median-based figure counts its excess as lost."""
    all_rows = rows(range(1, 41), 1000.0) + rows(range(33, 60), 1010.0)
    all_rows[5]["step_s"] = 0.5  # step 6, kept (the restore went back to step 32)
    assert all_rows[42]["step"] == 35
    all_rows[42]["step_s"] = 0.2  # step 35's second run: the kept one
    res = recovery.analyse("x", all_rows, 0)
    assert math.isclose(res.in_kept_steps, (57 * 0.1 + 0.5 + 0.2) / res.wall_s)
    assert math.isclose(res.effective, 59 * 0.1 / res.wall_s)


def test_the_bench_prints_the_agents_phases_by_name() -> None:
    mark = SimpleNamespace(proc_start=10.30, init_at=10.31, rdzv_begin=10.33, group_ready=10.35, restore_begin=10.40,
                           restore_end=10.43)
    timeline = recovery_timeline(10.02, 10.25, [mark], 10.50, died_at=10.0)
    assert recovery.phase_text(timeline) == ("detect 0.020, teardown 0.230, fork 0.050, startup 0.030, rendezvous 0.020, "
                                             "setup 0.050, restore 0.030, first_step 0.070")
