"""One plan version on every rank at the same step, without a collective per step.

At each sync point (every ``every`` steps, more when steps are short: ``PlanSync``), rank 0 reads
the agent's plan file and puts the plan it sees into the job's c10d store under the sync point's
number; the other ranks read the key of the previous sync point, and all of them apply that plan
from the next step. In synchronous training
rank 0 passed the previous sync point before any rank could finish this one's step (their gradient
collectives meet), so the read finds its key at once: one small store round trip per sync point,
no collective, and nothing left in flight when the script tears its process group down (an
asynchronous broadcast pending at exit can block a rank's exit once its peers have destroyed the
group). A plan takes effect at most two sync points after the agent wrote it: ``2 x every`` steps, or
about ``2 x target_s`` seconds when steps are short.

The same points carry rank 0's choice of the automatic snapshot interval (``snapshot_every``), so
that every rank snapshots the same steps: ranks that tuned their intervals apart would share no
step in their two slots, and a crash would restore nothing newer than the last DCP checkpoint.

The store is the one the process group was initialised with (the job's rendezvous store); keys
carry the restart count, so a restarted job never reads a previous attempt's plans.
"""

from __future__ import annotations

import math
import os
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from trainguard.agent.wire import Plan
from trainguard.link import PlanWatcher

_TIMEOUT = timedelta(seconds=300)
_KEEP = 3  # rank 0 deletes keys this many steps old: every rank has read them by then


def _job_store() -> Any:
    # The default group's store is not public API, but it is the one store every init method
    # (env://, tcp://, file://, torchrun's agent store) gives the job; fall back to env:// otherwise.
    store = getattr(dist.distributed_c10d, "_get_default_store", lambda: None)()
    if store is not None:
        return store
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=_TIMEOUT)


SYNC_TARGET_S = 0.3
"""Seconds of training between two sync points that rank 0 aims for when steps are short. A plan
then takes effect within ~0.6 s, less than the agent's 1 s detection interval that decides it; at
0.1 s the sync points' round trips (~1 ms each on a loaded 2-core node, the other ranks waiting
for rank 0 to be scheduled) were ~0.8 % of a 4-rank job's 33 ms steps."""
MAX_GAP = 256


class PlanSync:
    """``every``: the fewest steps between two sync points. Rank 0 widens the gap when steps are
    short, so that sync points come about every ``target_s`` seconds: a store round trip costs
    ~0.2-0.6 ms, a tenth of a 4 ms step. The gaps are agreed like the plans: each published value
    carries the gap after the next sync point, decided by rank 0 one point ahead, so every rank
    knows where the next point is without asking."""

    def __init__(self, watcher: PlanWatcher, *, is_leader: bool, attempt: int, every: int = 4,
                 target_s: float = SYNC_TARGET_S) -> None:
        self.watcher = watcher
        self.is_leader = is_leader
        self.every = max(1, every)
        self.target_s = target_s
        self.store = dist.PrefixStore(f"trainguard/plan/{attempt}/", _job_store())
        self._step = 0
        self._at = 0  # the next sync point's step
        self._gap = self.every  # steps from the next sync point to the one after it
        self._last = Plan()
        self._last_snapshot_every = 0
        self.snapshot_every = 0
        """The snapshot interval every rank uses from the last sync point (0: none agreed yet)."""
        self.points = 0
        """Sync points passed (each one store round trip); also the next one's number."""

    def _put(self, key: str, plan: Plan, gap: int, snapshot_every: int) -> None:
        self.store.set(key, f"{gap} {snapshot_every} {plan.encode().decode()}")

    def _get(self, key: str) -> tuple[Plan, int, int]:
        gap, snapshot_every, body = self.store.get(key).decode().split(" ", 2)  # waits for the key (store timeout)
        return Plan.decode(body.encode()), max(1, int(gap)), max(0, int(snapshot_every))

    def _next_gap(self, step_s: float) -> int:
        if step_s <= 0:
            return self.every
        return max(self.every, min(MAX_GAP, math.ceil(self.target_s / step_s)))

    def initial(self, snapshot_every: int = 0) -> Plan:
        """Once, at the first step: every rank starts from the plan rank 0 sees now."""
        if self.is_leader:
            self._last = self.watcher.poll()
            self._last_snapshot_every = snapshot_every
            self._put("start", self._last, self._gap, snapshot_every)
            return self._last
        plan, self._gap, _ = self._get("start")
        return plan

    def after_step(self, step_s: float = 0.0, snapshot_every: int = 0) -> Plan | None:
        """At the end of every step, on every rank: the plan to apply from the next step (the same
        one on every rank), or None between sync points. At a sync point rank 0 publishes what it
        sees (and the gap after the next point, from ``step_s``, its last step's seconds, and the
        snapshot interval it wants, ``snapshot_every``; other ranks' value is ignored) and the
        others take what it published one sync point earlier; ``self.snapshot_every`` then holds
        that point's agreed interval on every rank."""
        step = self._step
        self._step += 1
        if step < self._at:
            return None
        point = self.points
        self.points += 1
        if not self.is_leader:
            plan, gap_after, self.snapshot_every = self._get("start" if point == 0 else str(point - 1))
            if point > 0:
                self._gap = gap_after  # at point 0 the gap came with the start key
            self._at = step + self._gap
            return plan
        self._at = step + self._gap
        self._gap = self._next_gap(step_s)
        plan = self.watcher.poll()
        self._put(str(point), plan, self._gap, snapshot_every)
        self.snapshot_every, self._last_snapshot_every = self._last_snapshot_every, snapshot_every
        if point >= _KEEP:
            try:
                self.store.delete_key(str(point - _KEEP))
            except (RuntimeError, AttributeError):
                pass  # a store that cannot delete keeps a few bytes per sync point
        previous, self._last = self._last, plan
        return previous
