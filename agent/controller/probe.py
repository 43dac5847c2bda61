"""Budgeted branch probes: the active test for "LR too high" where no passive signal separates.

From a snapshot, the incumbent branch runs ``k`` steps at the current LR and the candidate branch
``k`` steps at LR / ``factor``; each then runs the same short cooldown (the LR falling linearly to
zero over ``cooldown`` steps), so that a branch's noise floor does not count against it, only the
progress it made. Both branches see the same minibatches (the caller replays its data stream), and
the comparison is paired: either each branch's end point on the same samples of a fixed evaluation
batch, or the minibatch losses step by step over the cooldown's second half. The candidate wins
only when its mean loss is lower by more than ``z`` standard errors of the paired differences. The caller
restores the snapshot after each branch and goes on at the winner's LR, so a probe's whole cost is
its two branches.

A probe spends at most ``budget`` of the planned run, both branches together. Below
``min_branch`` steps a branch measures nothing, so probes are off on runs shorter than
2 * min_branch / budget steps (1600 at the defaults).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass


@dataclass(frozen=True)
class ProbeConfig:
    budget: float = 0.01
    """Fraction of the planned steps one probe may spend, both branches together."""
    factor: float = 4.0
    """The candidate branch runs at LR / factor."""
    cooldown: float = 0.4
    """Fraction of a branch spent cooling down."""
    min_branch: int = 8
    z: float = 2.0
    """Standard errors the candidate must win by."""

    def __post_init__(self) -> None:
        checks = [
            (0 < self.budget <= 0.1, "budget", "must be in (0, 0.1]"),
            (self.factor > 1, "factor", "must be > 1"),
            (0 < self.cooldown < 1, "cooldown", "must be in (0, 1)"),
            (self.min_branch >= 4, "min_branch", "must be >= 4"),
            (self.z > 0, "z", "must be > 0"),
        ]
        for ok, name, msg in checks:
            if not ok:
                raise ValueError(f"probe.{name}: {msg}")

    def branch(self, steps: int) -> tuple[int, int] | None:
        """(k, cooldown) steps of one branch for a ``steps``-step run, or None: the budget does not
        cover a branch of ``min_branch`` steps (a short run)."""
        n = int(self.budget * steps) // 2
        if n < self.min_branch:
            return None
        cool = max(2, round(self.cooldown * n))
        return n - cool, cool

    def scales(self, steps: int) -> list[float]:
        """A branch's LR multipliers, step by step, relative to its own LR ([] when off)."""
        plan = self.branch(steps)
        if plan is None:
            return []
        k, cool = plan
        return [1.0] * k + [1 - (i + 1) / (cool + 1) for i in range(cool)]


@dataclass(frozen=True)
class ProbeResult:
    lower: bool
    """The candidate (LR / factor) won by more than z standard errors."""
    diff: float
    """Mean paired loss difference, candidate - incumbent, over the cooldown's second half."""
    se: float


def compare(config: ProbeConfig, incumbent: list[float], candidate: list[float]) -> ProbeResult:
    """Decide a probe from paired losses of the two branches: the same samples of a fixed evaluation
    batch at each branch's end, or the same replayed minibatches over the cooldown's second half."""
    if len(incumbent) != len(candidate) or len(incumbent) < 2:
        raise ValueError("probe: the branches' losses must be paired, at least two of each")
    diffs = [c - i for i, c in zip(incumbent, candidate, strict=True)]
    if not all(math.isfinite(d) for d in diffs):
        # A diverging branch loses outright; both diverging leaves the incumbent.
        lower = all(math.isfinite(v) for v in candidate)
        return ProbeResult(lower, -math.inf if lower else math.inf, 0.0)
    mean = statistics.fmean(diffs)
    se = statistics.stdev(diffs) / math.sqrt(len(diffs))
    return ProbeResult(mean < -config.z * se, mean, se)
