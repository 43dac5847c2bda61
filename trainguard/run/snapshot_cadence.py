"""How many steps apart a rank takes its snapshots when that is left to it: the fewest that keep
their cost within 1% of the step, from the measured cost of the last ones."""

from __future__ import annotations

import statistics

SNAPSHOT_COST_WINDOW = 25
"""Snapshots whose cost the automatic interval takes the median of. With 9, a cost whose median
was 0.94-0.97 % of the step (the recovery bench's job, BENCHMARKS.md) had a median of 9 above 1 %
often enough to snapshot every 2 steps for 28-40 % of a run."""

SNAPSHOT_CLEARLY_OVER = 4.0
"""Times the budget (1 % of the step) a median cost must reach to move the interval before the
window is full: a state whose snapshot costs a large part of a step should not take 25 of them."""

SNAPSHOT_COLD_TAKES = 3
"""An attempt's first snapshots whose cost the interval does not go by: each of the two slots' first
fill maps and touches its pages (2.3-6.4 ms against 0.3 ms after, on the recovery bench's job),
and with the copy overlapped a cost is read one snapshot late."""

SNAPSHOT_EARLY_MIN = 5
"""Costs the median of which may widen the interval before the window is full (when clearly over
the budget). The median of the first one to three once said 15-34 % of the step, which set every
16 steps; the 0.3 ms costs after it could not narrow it back before the window was full (200-400
steps), and a kill in that time lost up to 16 steps."""

SNAPSHOT_WIDEN_OVER = 1.25
"""Times the budget a median cost must reach at the interval in force to widen it: a wider interval
costs a crash more steps, and a cost near the budget moves with the node's load. On the recovery
bench's 4 ranks on 2 cores snapshots every 2 steps cost 0.95-1.1 % of the step, and the interval
went to 4 for part of a run, where a kill lost 2 steps (BENCHMARKS.md)."""


class SnapshotCadence:
    """One rank's wish for the steps between snapshots (``tune``), a power of two."""

    def __init__(self, every: int) -> None:
        self.wish = every
        """What this rank's costs ask for (rank 0's is agreed at the plan sync points)."""
        self.ratios: list[float] = []
        self.cost_scale = 1.0
        """``trainguard.checkpoint.snapshot.cost.cost_scale`` of this node, set with the first snapshot."""

    def tune(self, cost_s: float, step_s: float) -> int | None:
        """The fewest steps between snapshots, a power of two, that keeps their cost to the job
        within 1% of the step time (``cost_s`` times ``trainguard.checkpoint.snapshot.cost.cost_scale``: where the
        node's ranks outnumber its cores, each rank's snapshot work slows them all), from the
        median of the last ``SNAPSHOT_COST_WINDOW`` cost/step ratios (one slow step or one slow
        copy does not move it, nor does the noise of a cost near the budget flip it back and
        forth). A wider interval than the one in force needs a cost ``SNAPSHOT_WIDEN_OVER`` times
        the budget at the one in force; a narrower one goes at once. Until the window is full, only
        the median of at least ``SNAPSHOT_EARLY_MIN`` costs clearly over the budget
        (``SNAPSHOT_CLEARLY_OVER`` times it) widens the interval: the first snapshots of an
        attempt run out of colder caches, and the median of a few of them took the recovery
        bench's job to every 2 steps for its first ~20 steps. In a multi-rank job with an agent
        this is only a wish: rank 0's is agreed at the plan sync points (``PlanSync``), since ranks
        whose intervals drift apart keep no common step in their two slots; alone, the rank
        applies it. Returns the new wish, or None where it stays."""
        if step_s <= 0:
            return None
        self.ratios.append(cost_s * self.cost_scale / step_s)
        del self.ratios[:-SNAPSHOT_COST_WINDOW]
        ratio = statistics.median(self.ratios)
        every = 1
        while every < 64 and ratio / every > 0.01:
            every *= 2
        early = len(self.ratios) < SNAPSHOT_COST_WINDOW
        if early and every > self.wish and (
                len(self.ratios) < SNAPSHOT_EARLY_MIN or ratio < SNAPSHOT_CLEARLY_OVER * 0.01):
            return None
        if every > self.wish and ratio / self.wish <= SNAPSHOT_WIDEN_OVER * 0.01:
            every = self.wish
        self.wish = every
        return every
