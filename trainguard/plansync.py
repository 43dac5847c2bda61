"""One plan version on every rank at the same step, without a collective per step.

Rank 0 reads the agent's plan file (a ``stat`` per step) and, at the end of step ``s``, puts the
plan it sees into the job's c10d store under key ``s``; every other rank reads key ``s - 1`` at
the end of step ``s`` and all of them apply that plan from step ``s + 1``. In synchronous training
rank 0 finished step ``s - 1`` before any rank could finish step ``s`` (their gradient collectives
meet), so the read finds its key at once: one small store round trip per step, no collective, and
nothing left in flight when the script tears its process group down (an asynchronous broadcast
pending at exit can block a rank's exit once its peers have destroyed the group).

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
    def __init__(self, watcher: PlanWatcher, *, is_leader: bool, attempt: int) -> None:
        self.watcher = watcher
        self.is_leader = is_leader
        self.store = dist.PrefixStore(f"trainguard/plan/{attempt}/", _job_store())
        self._step = 0
        self._last = Plan()

    def _put(self, key: str, plan: Plan) -> None:
        self.store.set(key, plan.encode().decode())

    def _get(self, key: str) -> Plan:
        self.store.wait([key], _TIMEOUT)
        return Plan.decode(self.store.get(key))

    def initial(self) -> Plan:
        """Once, at the first step: every rank starts from the plan rank 0 sees now."""
        if self.is_leader:
            self._last = self.watcher.poll()
            self._put("start", self._last)
            return self._last
        return self._get("start")

    def after_step(self) -> Plan:
        """At the end of every step, on every rank: the plan to apply from the next step (the
        same one on every rank: what rank 0 saw at the end of the previous step)."""
        step = self._step
        self._step += 1
        if not self.is_leader:
            return self._get("start" if step == 0 else str(step - 1))
        plan = self.watcher.poll()
        self._put(str(step), plan)
        if step >= _KEEP:
            try:
                self.store.delete_key(str(step - _KEEP))
            except (RuntimeError, AttributeError):
                pass  # a store that cannot delete keeps a few bytes per step
        previous, self._last = self._last, plan
        return previous
