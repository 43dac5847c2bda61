"""One plan version on every rank at the same step, without a blocking collective per step.

Rank 0 reads the agent's plan file (a ``stat`` per step); the version it saw travels to the other
ranks in an asynchronous broadcast on a small gloo group of trainguard's own, posted at the end of
step ``s`` and collected at the end of step ``s + 1``, so the step never waits for it (a blocking
gloo collective costs milliseconds here, an async one costs nothing the step can see). Only when
the version changed does a second, blocking broadcast carry the whole plan, and every rank applies
it from step ``s + 2``. The group is trainguard's own so that these broadcasts never interleave
with the script's collectives, and gloo so that it needs no GPU stream.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from trainguard.agent.wire import Plan
from trainguard.link import PlanWatcher

_TIMEOUT = timedelta(seconds=120)


class PlanSync:
    def __init__(self, watcher: PlanWatcher, *, is_leader: bool) -> None:
        self.watcher = watcher
        self.is_leader = is_leader
        # Collective: every rank builds its Run's synchroniser at the same point (its first step).
        self.group: Any = dist.new_group(backend="gloo", timeout=_TIMEOUT)
        self._version = torch.zeros(1, dtype=torch.int64)
        self._work: Any = None
        self._offered: Plan | None = None
        self._current = 0

    def _broadcast_plan(self, plan: Plan | None) -> Plan:
        box: list[Any] = [plan.encode() if plan is not None else None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return Plan.decode(box[0])

    def initial(self) -> Plan:
        """Blocking, once: every rank starts from the plan rank 0 sees now."""
        plan = self._broadcast_plan(self.watcher.poll() if self.is_leader else None)
        self._current = plan.version
        return plan

    def after_step(self) -> Plan | None:
        """Call at the end of every step on every rank; returns a newer plan to apply from the next
        step (the same one on every rank), or None."""
        newer: Plan | None = None
        if self._work is not None:
            self._work.wait()
            self._work = None
            if int(self._version.item()) > self._current:
                newer = self._broadcast_plan(self._offered if self.is_leader else None)
                self._current = newer.version
        if self.is_leader:
            self._offered = self.watcher.poll()
            self._version[0] = self._offered.version
        self._work = dist.broadcast(self._version, src=0, group=self.group, async_op=True)
        return newer
