"""Versioned plans per job: what the agent wants the ranks to do, published as an atomic file."""

from __future__ import annotations

import dataclasses
import os
import threading
from collections import deque
from typing import Any

from trainguard.agent.wire import Plan, WireError, write_plan_file

_SETTABLE = {"lr_scale", "lr", "batch_sizes", "stop", "reason", "extra"}


class PlanStore:
    def __init__(self, directory: str) -> None:
        os.makedirs(directory, mode=0o755, exist_ok=True)
        self.directory = directory
        self._plans: dict[str, Plan] = {}
        # The last versions of each job's plan: a reader that polls (the controller, once a tick)
        # must not miss a rollback that a migration superseded before it looked.
        self._recent: dict[str, deque[Plan]] = {}
        self._lock = threading.Lock()

    def path(self, job: str) -> str:
        return os.path.join(self.directory, f"{job}.json")

    def get(self, job: str) -> Plan:
        with self._lock:
            return dataclasses.replace(self._plans.get(job) or Plan())

    def changes_since(self, job: str, version: int) -> list[Plan]:
        """The versions after ``version`` that are still remembered (the last 64), oldest first."""
        with self._lock:
            return [dataclasses.replace(p) for p in self._recent.get(job, ()) if p.version > version]

    def _remember(self, job: str, plan: Plan) -> None:
        self._recent.setdefault(job, deque(maxlen=64)).append(dataclasses.replace(plan))

    def update(self, job: str, changes: dict[str, Any], *, checkpoint_now: bool = False) -> Plan:
        """Apply a partial change and publish it as the next version. Raises WireError on bad fields."""
        for key in changes:
            if key not in _SETTABLE:
                raise WireError("schema", f"plan field {key!r} cannot be set (settable: {sorted(_SETTABLE)})")
        with self._lock:
            current = self._plans.get(job) or Plan()
            plan = dataclasses.replace(current, **changes)
            plan.version = current.version + 1
            if checkpoint_now:
                plan.checkpoint_id = current.checkpoint_id + 1
            plan.validate()
            write_plan_file(self.path(job), plan)
            self._plans[job] = plan
            self._remember(job, plan)
            return dataclasses.replace(plan)

    def reset(self, job: str) -> Plan:
        """A fresh plan for a (re)started job, version continuing so ranks never see it go back."""
        with self._lock:
            old = self._plans.get(job)
            plan = Plan(version=(old.version + 1) if old else 1, checkpoint_id=old.checkpoint_id if old else 0)
            if old is not None:
                plan.lr_scale, plan.lr, plan.batch_sizes = old.lr_scale, old.lr, old.batch_sizes
            write_plan_file(self.path(job), plan)
            self._plans[job] = plan
            self._remember(job, plan)
            return dataclasses.replace(plan)

    def adopt(self, job: str) -> Plan:
        """Take over the plan a previous agent left in the job's plan file (its ranks follow it):
        versions go on from there and a migration in force stays in force. A fresh plan when the
        file is missing or unreadable."""
        try:
            with open(self.path(job), "rb") as fh:
                plan = Plan.decode(fh.read())
        except (OSError, WireError):
            return self.reset(job)
        with self._lock:
            self._plans[job] = plan
            self._remember(job, plan)
            return dataclasses.replace(plan)

    def forget(self, job: str) -> None:
        with self._lock:
            self._plans.pop(job, None)
            self._recent.pop(job, None)
        try:
            os.unlink(self.path(job))
        except OSError:
            pass
