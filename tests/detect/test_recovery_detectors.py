"""Hang and loss-divergence detectors on synthetic progress (pure logic, exact answers)."""

from __future__ import annotations

import math

from trainguard.agent.detect.divergence import LossDetector
from trainguard.agent.detect.hang import HangDetector


def test_hang_needs_factor_times_median_and_floor() -> None:
    det = HangDetector(factor=10, floor_s=5, startup_s=60)
    det.reset("j", 0.0)
    assert det.check("j", 1, 0.2, 1.0) is None  # first step done: steady-state limits from now on
    assert det.check("j", 1, 0.2, 5.9) is None  # 4.9 s stalled < floor 5 s
    found = det.check("j", 1, 0.2, 6.1)
    assert found is not None and found.kind == "hang" and found.step == 1
    assert det.check("j", 1, 0.2, 20.0) is None  # reported once per stalled step
    det2 = HangDetector(factor=10, floor_s=1, startup_s=60)
    det2.reset("j", 0.0)
    det2.check("j", 3, 2.0, 0.5)
    assert det2.check("j", 3, 2.0, 20.0) is None  # 19.5 s < 10 x median 2 s
    assert det2.check("j", 3, 2.0, 21.0) is not None


def test_startup_gets_its_own_limit() -> None:
    det = HangDetector(factor=10, floor_s=2, startup_s=30)
    det.reset("j", 100.0)
    assert det.check("j", -1, None, 110.0) is None  # slow imports and rendezvous are not a hang
    found = det.check("j", -1, None, 131.0)
    assert found is not None and "after step -1" in found.message


def test_progress_resets_the_clock() -> None:
    det = HangDetector(factor=10, floor_s=2, startup_s=30)
    det.reset("j", 0.0)
    for t in range(1, 50):
        assert det.check("j", t, 0.1, float(t)) is None


def test_loss_nan_and_spike() -> None:
    det = LossDetector(spike_factor=4, window=16, min_history=4)
    healthy = [(s, 2.0 - 0.01 * s) for s in range(10)]
    assert det.observe("j", healthy) is None
    assert det.observe("j", healthy) is None  # the same steps again are not judged twice
    spike = det.observe("j", [(10, 9.5)])
    assert spike is not None and spike.step == 10 and spike.evidence["factor"] > 4
    det.forget("j")
    assert det.observe("j", [(0, 2.0), (1, math.nan)]) is not None
    ok = LossDetector(spike_factor=4, min_history=4)
    assert ok.observe("j", [(s, 2.0 + (0.5 if s % 2 else 0.0)) for s in range(40)]) is None


def test_loss_history_restarts_after_a_restore() -> None:
    det = LossDetector(spike_factor=4, min_history=4)
    assert det.observe("j", [(s, 1.0) for s in range(20)]) is None
    # The job went back to step 10 (a restore); its steps are new again and judged.
    assert det.observe("j", [(10, 1.0), (11, math.inf)]) is not None
