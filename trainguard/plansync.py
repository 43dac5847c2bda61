"""One plan version on every rank at the same step, without a collective per step.

Every ``every`` steps (a sync point), rank 0 reads the agent's plan file and puts the plan it sees
into the job's c10d store under the sync point's number; the other ranks read the key of the
previous sync point, and all of them apply that plan from the next step. In synchronous training
rank 0 passed the previous sync point before any rank could finish this one's step (their gradient
collectives meet), so the read finds its key at once: one small store round trip per sync point,
no collective, and nothing left in flight when the script tears its process group down (an
asynchronous broadcast pending at exit can block a rank's exit once its peers have destroyed the
group). A plan takes effect at most ``2 x every`` steps after the agent wrote it.

The store is the one the process group was initialised with (the job's rendezvous store); keys
carry the restart count, so a restarted job never reads a previous attempt's plans.
"""

from __future__ import annotations

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


class PlanSync:
    def __init__(self, watcher: PlanWatcher, *, is_leader: bool, attempt: int, every: int = 4) -> None:
        self.watcher = watcher
        self.is_leader = is_leader
        self.every = max(1, every)
        self.store = dist.PrefixStore(f"trainguard/plan/{attempt}/", _job_store())
        self._step = 0
        self._last = Plan()

    def _put(self, key: str, plan: Plan) -> None:
        self.store.set(key, plan.encode().decode())

    def _get(self, key: str) -> Plan:
        return Plan.decode(self.store.get(key))  # waits for the key (up to the store's timeout)

    def initial(self) -> Plan:
        """Once, at the first step: every rank starts from the plan rank 0 sees now."""
        if self.is_leader:
            self._last = self.watcher.poll()
            self._put("start", self._last)
            return self._last
        return self._get("start")

    def after_step(self) -> Plan | None:
        """At the end of every step, on every rank: the plan to apply from the next step (the same
        one on every rank), or None between sync points. Every ``every``-th step rank 0 publishes
        what it sees and the others take what it published one sync point earlier."""
        step = self._step
        self._step += 1
        if step % self.every:
            return None
        point = step // self.every
        if not self.is_leader:
            return self._get("start" if point == 0 else str(point - 1))
        plan = self.watcher.poll()
        self._put(str(point), plan)
        if point >= _KEEP:
            try:
                self.store.delete_key(str(point - _KEEP))
            except (RuntimeError, AttributeError):
                pass  # a store that cannot delete keeps a few bytes per sync point
        previous, self._last = self._last, plan
        return previous
