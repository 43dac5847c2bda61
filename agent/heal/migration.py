"""Shard migration: per-dp-rank batch sizes that let a slow replica finish with the others.

Model: a dp replica needs ``fixed + n * per_sample`` seconds of compute for ``n`` samples (optimizer
time does not scale with the batch; forward+backward does). The split that makes every replica
finish together keeps the global batch B:

    T = (B + sum(fixed_i / p_i)) / sum(1 / p_i),   n_i = (T - fixed_i) / p_i

With equal fixed costs this is exactly "shares proportional to measured speed (samples/s)". Sizes
are whole samples (or whole pipeline microbatches: ``quantum``), at least one quantum per replica,
and always sum to B (largest-remainder rounding).

A replica with tensor- or pipeline-parallel members is as slow as its slowest member, so its model
is that member's; migration moves work between whole dp replicas (the only level where the trainer
can split the batch unevenly).

``MigrationPolicy`` decides when to publish: the first move goes straight to the target, later
re-evaluations only after every rank ran the current plan for ``settle_steps``, move a damped
fraction of the way, and only when the model says the step gets at least ``min_gain`` faster (a
dead band on the outcome, not on sample counts: moving 2 of 64 samples off a rank that holds 5 can
matter), so measurement noise cannot make shares oscillate.
When no straggler is left the shares go back to even.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ReplicaModel:
    dp_rank: int
    per_sample_s: float
    fixed_s: float = 0.0


def even_sizes(total: int, n: int, quantum: int = 1) -> list[int]:
    """The trainer's default split (remainder units to the first replicas)."""
    units, rem = divmod(total // quantum, n)
    return [(units + (1 if i < rem else 0)) * quantum for i in range(n)]


def round_preserving_sum(real: Sequence[float], total: int, quantum: int = 1, min_units: int = 1) -> list[int]:
    """Whole multiples of ``quantum`` close to ``real``, each >= min_units quanta, summing to ``total``.

    >>> round_preserving_sum([2.4, 2.4, 2.4, 0.8], 8)
    [3, 2, 2, 1]
    """
    n = len(real)
    if n == 0:
        raise ValueError("no replicas")
    if total % quantum:
        raise ValueError(f"total {total} is not a multiple of quantum {quantum}")
    units = total // quantum
    if units < n * min_units:
        raise ValueError(f"total {total} cannot give {n} replicas {min_units} x {quantum} samples each")
    want = [max(float(r) / quantum, float(min_units)) for r in real]
    scale = (units - n * min_units) / max(sum(w - min_units for w in want), 1e-12)
    want = [min_units + (w - min_units) * scale for w in want]
    base = [max(min_units, math.floor(w)) for w in want]
    left = units - sum(base)
    order = sorted(range(n), key=lambda i: (-(want[i] - base[i]), i))
    k = 0
    while left > 0:
        base[order[k % n]] += 1
        left -= 1
        k += 1
    while left < 0:  # only when min_units pushed some up: take from the largest
        i = max(range(n), key=lambda j: (base[j] - want[j], base[j]))
        if base[i] > min_units:
            base[i] -= 1
            left += 1
        else:
            break
    return [b * quantum for b in base]


def balanced_sizes(models: Sequence[ReplicaModel], total: int, quantum: int = 1, min_units: int = 1) -> list[int]:
    """Per-replica batch sizes (ordered by dp rank) that equalise modelled compute time."""
    ms = sorted(models, key=lambda m: m.dp_rank)
    if any(not (m.per_sample_s > 0) or math.isinf(m.per_sample_s) for m in ms):
        raise ValueError("per-sample times must be positive and finite")
    active = list(range(len(ms)))
    floor_n = float(min_units * quantum)
    real = [floor_n] * len(ms)
    # Replicas whose share would fall under the floor get the floor; solve again for the rest.
    while active:
        budget = total - floor_n * (len(ms) - len(active))
        inv = sum(1.0 / ms[i].per_sample_s for i in active)
        t = (budget + sum(ms[i].fixed_s / ms[i].per_sample_s for i in active)) / inv
        shares = {i: (t - ms[i].fixed_s) / ms[i].per_sample_s for i in active}
        low = [i for i, s in shares.items() if s < floor_n]
        if not low:
            for i, s in shares.items():
                real[i] = s
            break
        active = [i for i in active if i not in low]
    return round_preserving_sum(real, total, quantum, min_units)


def step_time(models: Sequence[ReplicaModel], sizes: Sequence[int]) -> float:
    """Modelled compute time of one step: the slowest replica's ``fixed + n * per_sample``."""
    ms = sorted(models, key=lambda m: m.dp_rank)
    return max(m.fixed_s + n * m.per_sample_s for m, n in zip(ms, sizes, strict=True))


@dataclass(frozen=True)
class Decision:
    sizes: list[int] | None
    """New per-dp-rank batch sizes; None means back to the even split."""
    action: str
    """"migrate" (first move), "rebalance" (re-evaluation) or "undo"."""
    target: list[int]


@dataclass
class MigrationPolicy:
    """Per-job migration state. ``decide`` is called after each detector evaluation."""

    min_gain: float = 0.05
    gain: float = 0.5
    settle_steps: int = 8
    sizes: list[int] | None = None
    """The split this policy last published (None: even / never migrated)."""
    published_version: int = -1
    effective_step: int | None = None
    """First step at which every rank ran ``published_version`` (None until seen)."""

    def note_published(self, sizes: list[int] | None, version: int) -> None:
        self.sizes = list(sizes) if sizes is not None else None
        self.published_version = version
        self.effective_step = None

    def settled(self, min_plan_version: int, min_step: int) -> bool:
        """True once every rank ran the published plan for ``settle_steps`` steps."""
        if self.published_version < 0:
            return True
        if min_plan_version < self.published_version:
            return False
        if self.effective_step is None:
            self.effective_step = min_step
        return min_step - self.effective_step >= self.settle_steps

    def decide(self, models: Sequence[ReplicaModel], total: int, *, stragglers: bool, quantum: int = 1) -> Decision | None:
        n = len(models)
        even = even_sizes(total, n, quantum)
        if not stragglers:
            if self.sizes is not None:
                return Decision(None, "undo", even)
            return None
        target = balanced_sizes(models, total, quantum)
        current = self.sizes if self.sizes is not None and len(self.sizes) == n else even
        # The dead band is on what the target would gain; the step taken toward it is damped, so a
        # real imbalance is closed in a few moves and noise (a small gain) moves nothing.
        if target == current or step_time(models, target) > (1.0 - self.min_gain) * step_time(models, current):
            return None
        if self.sizes is None:
            return Decision(target, "migrate", target)
        damped = [c + self.gain * (t - c) for c, t in zip(current, target, strict=True)]
        proposal = round_preserving_sum(damped, total, quantum)
        if proposal == current:
            proposal = target  # the damped step rounds to nothing: take the last quantum too
        return Decision(proposal, "rebalance", target)
