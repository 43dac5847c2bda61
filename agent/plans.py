"""Versioned plans per job: what the agent wants the ranks to do, published as an atomic file."""

from __future__ import annotations

import dataclasses
import os
import threading
from typing import Any

from agent.wire import Plan, WireError, write_plan_file

_SETTABLE = {"lr_scale", "lr", "batch_sizes", "stop", "reason", "extra"}


class PlanStore:
    def __init__(self, directory: str) -> None:
        os.makedirs(directory, mode=0o755, exist_ok=True)
        self.directory = directory
        self._plans: dict[str, Plan] = {}
        self._lock = threading.Lock()

    def path(self, job: str) -> str:
        return os.path.join(self.directory, f"{job}.json")

    def get(self, job: str) -> Plan:
        with self._lock:
            return dataclasses.replace(self._plans.get(job) or Plan())

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
            return dataclasses.replace(plan)

    def forget(self, job: str) -> None:
        with self._lock:
            self._plans.pop(job, None)
        try:
            os.unlink(self.path(job))
        except OSError:
            pass
