"""Budgeted branch probes (agent/controller/probe.py): their budget, their paired decision, and
what they see on the noisy quadratic model (docs/controller.md has the full table)."""

from __future__ import annotations

import math

import pytest

from trainguard.agent.controller.calibrate import probe_nqm
from trainguard.agent.controller.nqm import ADAM, NQM
from trainguard.agent.controller.probe import ProbeConfig, compare


def test_a_probe_fits_its_budget_and_is_off_on_short_runs() -> None:
    cfg = ProbeConfig()
    assert cfg.branch(1000) is None and cfg.scales(1000) == []  # 1 % of 1000 steps: 5 a branch
    k, cool = cfg.branch(2000)  # type: ignore[misc]
    assert 2 * (k + cool) <= 0.01 * 2000 and k > 0 and cool >= 2
    scales = cfg.scales(5000)
    assert 2 * len(scales) <= 50 and scales[0] == 1.0 and 0 < scales[-1] < scales[-2] < 1


def test_the_candidate_must_win_by_more_than_z_standard_errors() -> None:
    cfg = ProbeConfig()
    inc = [1.0, 1.2, 0.9, 1.1, 1.0, 1.05]
    assert compare(cfg, inc, [v - 0.5 for v in inc]).lower
    assert not compare(cfg, inc, [v - (0.01 if i % 2 else -0.01) for i, v in enumerate(inc)]).lower
    assert not compare(cfg, inc, [v + 0.5 for v in inc]).lower


def test_a_diverging_branch_loses() -> None:
    cfg = ProbeConfig()
    assert not compare(cfg, [1.0, 1.0], [math.inf, 1.0]).lower
    assert compare(cfg, [math.inf, math.nan], [1.0, 1.0]).lower


def test_unpaired_losses_are_a_one_line_error() -> None:
    with pytest.raises(ValueError, match="probe: the branches' losses must be paired"):
        compare(ProbeConfig(), [1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="probe.budget: must be in"):
        ProbeConfig(budget=0.5)


def test_a_data_snapshot_replays_the_minibatches() -> None:
    model = NQM(ADAM, ADAM.good_lr, 1000, 0)
    for _ in range(20):
        model.step()
    snap = model.snapshot(data=True)
    first = [model.step().loss for _ in range(5)]
    model.restore(snap)
    assert [model.step().loss for _ in range(5)] == first


def test_probes_lower_from_30x_high_and_never_from_10x_low() -> None:
    """On a 5000-step adam NQM run, a probe at 10 % picks LR/4 from 30x too high in most of 10
    seeds and never from 10x too low."""
    high = [probe_nqm(ADAM, 30.0, s, 5000, 0.1) for s in range(10)]
    low = [probe_nqm(ADAM, 0.1, s, 5000, 0.1) for s in range(10)]
    assert sum(r.lower for r in high if r is not None) >= 7, high
    assert not any(r.lower for r in low if r is not None), low
