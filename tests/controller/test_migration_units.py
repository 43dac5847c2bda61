"""Shard migration math and policy (agent/heal/migration.py) on synthetic speeds."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainguard.agent.heal.migration import (
    MigrationPolicy,
    ReplicaModel,
    balanced_sizes,
    even_sizes,
    round_preserving_sum,
)


def test_even_sizes_match_trainer_split() -> None:
    assert even_sizes(32, 4) == [8, 8, 8, 8]
    assert even_sizes(10, 4) == [3, 3, 2, 2]
    assert even_sizes(16, 2, quantum=2) == [8, 8]


def test_one_rank_half_speed_gets_half_share() -> None:
    # Three ranks at speed 1, one at 0.5: shares 2:2:2:1 of 28.
    models = [ReplicaModel(0, 1.0), ReplicaModel(1, 2.0), ReplicaModel(2, 1.0), ReplicaModel(3, 1.0)]
    assert balanced_sizes(models, 28) == [8, 4, 8, 8]
    sizes = balanced_sizes(models, 32)
    assert sum(sizes) == 32 and sizes[1] in (4, 5) and all(s in (9, 10) for i, s in enumerate(sizes) if i != 1)


def test_fixed_cost_is_accounted() -> None:
    # Equal per-sample speed, but replica 0 has a big per-step constant: it gets fewer samples,
    # so that fixed + n * p is the same for both.
    sizes = balanced_sizes([ReplicaModel(0, 0.01, fixed_s=0.04), ReplicaModel(1, 0.01)], 20)
    assert sizes == [8, 12]
    t = [0.04 + sizes[0] * 0.01, sizes[1] * 0.01]
    assert abs(t[0] - t[1]) < 0.011


def test_minimum_one_sample_and_quantum() -> None:
    sizes = balanced_sizes([ReplicaModel(0, 1.0), ReplicaModel(1, 1000.0)], 16)
    assert sizes == [15, 1]
    sizes = balanced_sizes([ReplicaModel(0, 1.0), ReplicaModel(1, 1000.0)], 16, quantum=2)
    assert sizes == [14, 2]
    sizes = balanced_sizes([ReplicaModel(0, 1.0), ReplicaModel(1, 3.0)], 16, quantum=2)
    assert sizes == [12, 4] and all(s % 2 == 0 for s in sizes)


def test_rounding_errors_name_the_problem() -> None:
    with pytest.raises(ValueError, match="multiple of quantum"):
        round_preserving_sum([3.0, 4.0], 7, quantum=2)
    with pytest.raises(ValueError, match="cannot give"):
        round_preserving_sum([1.0, 1.0, 1.0], 2)
    with pytest.raises(ValueError, match="positive"):
        balanced_sizes([ReplicaModel(0, 0.0), ReplicaModel(1, 1.0)], 8)


@settings(max_examples=300, deadline=None)
@given(
    speeds=st.lists(st.floats(min_value=1e-4, max_value=1.0), min_size=1, max_size=16),
    fixed=st.floats(min_value=0.0, max_value=0.1),
    quantum=st.sampled_from([1, 2, 4]),
    extra=st.integers(min_value=0, max_value=200),
)
def test_sizes_always_valid(speeds: list[float], fixed: float, quantum: int, extra: int) -> None:
    n = len(speeds)
    total = (n + extra) * quantum
    sizes = balanced_sizes([ReplicaModel(i, p, fixed) for i, p in enumerate(speeds)], total, quantum)
    assert sum(sizes) == total
    assert all(s >= quantum and s % quantum == 0 for s in sizes)
    # Faster replicas never get fewer samples than slower ones (ties aside).
    order = sorted(range(n), key=lambda i: speeds[i])
    for a, b in zip(order, order[1:], strict=False):
        if speeds[a] < speeds[b] * 0.9:
            assert sizes[a] >= sizes[b] - quantum


def test_policy_first_move_then_damped_rebalance_then_undo() -> None:
    pol = MigrationPolicy(min_gain=0.01, gain=0.5, settle_steps=4)
    slow = [ReplicaModel(0, 1.0), ReplicaModel(1, 2.0), ReplicaModel(2, 1.0), ReplicaModel(3, 1.0)]
    d = pol.decide(slow, 56, stragglers=True)
    assert d is not None and d.action == "migrate" and d.sizes == [16, 8, 16, 16]
    pol.note_published(d.sizes, version=5)
    # Not settled until every rank runs version 5 for settle_steps steps.
    assert not pol.settled(min_plan_version=4, min_step=100)
    assert not pol.settled(min_plan_version=5, min_step=101)
    assert not pol.settled(min_plan_version=5, min_step=103)
    assert pol.settled(min_plan_version=5, min_step=105)
    # Same speeds: nothing to do, no oscillation.
    assert pol.decide(slow, 56, stragglers=True) is None
    # The straggler got slower (4x): target [17, 5, 17, 17]; move half-way there (8 -> 7).
    slower = [ReplicaModel(0, 1.0), ReplicaModel(1, 4.0), ReplicaModel(2, 1.0), ReplicaModel(3, 1.0)]
    d = pol.decide(slower, 56, stragglers=True)
    assert d is not None and d.action == "rebalance" and d.sizes is not None
    assert d.target == [17, 5, 17, 17] and d.sizes[1] == 7 and sum(d.sizes) == 56
    pol.note_published(d.sizes, version=6)
    d = pol.decide(slower, 56, stragglers=False)
    assert d is not None and d.action == "undo" and d.sizes is None and d.target == [14, 14, 14, 14]
    pol.note_published(None, version=7)
    assert pol.decide(slower, 56, stragglers=False) is None


def test_policy_noise_below_dead_band_is_ignored() -> None:
    pol = MigrationPolicy(min_gain=0.1)
    # 3% speed differences: the balanced split differs from even by less than the dead band.
    noisy = [ReplicaModel(0, 1.0), ReplicaModel(1, 1.03), ReplicaModel(2, 0.98), ReplicaModel(3, 1.01)]
    assert pol.decide(noisy, 32, stragglers=True) is None
