"""Rollback: a job whose loss diverged restarts from a checkpoint before the divergence, with its LR cut.

The checkpoint the diverged attempt started from is never picked again for that job (a damaged copy
would diverge the same way every round until the crash-loop guard ends the job): the recovery
service leaves the steps in ``rolled_back_from`` out when it picks what a start restores.
"""

from __future__ import annotations

from trainguard.agent.eventlog import EventLog
from trainguard.agent.heal.counts import ActionCounts
from trainguard.agent.lifecycle.plans import PlanStore
from trainguard.agent.lifecycle.supervisor import Supervisor


class Rollback:
    def __init__(self, supervisor: Supervisor, plans: PlanStore, events: EventLog, counts: ActionCounts, *,
                 lr_factor: float) -> None:
        self.supervisor = supervisor
        self.plans = plans
        self.events = events
        self.counts = counts
        self.lr_factor = lr_factor
        """The LR scale is multiplied by this at every rollback (``recovery.rollback_lr_factor``)."""
        self.rolled_back_from: dict[str, set[int]] = {}
        """Steps each job diverged after restoring: no later start of the job picks them again."""

    def __call__(self, job: str, reason: str, before_step: int | None = None) -> None:
        """Restart from the newest checkpoint before ``before_step`` with the LR cut."""
        record = self.supervisor.jobs.get(job)
        if record is None:
            return
        record.restore_max_step = before_step - 1 if before_step is not None else None
        came_from = (record.restored_from or {}).get("step")
        if isinstance(came_from, int):
            self.rolled_back_from.setdefault(job, set()).add(came_from)
        plan = self.plans.get(job)
        new_scale = max(plan.lr_scale * self.lr_factor, 1e-6)
        self.plans.update(job, {"lr_scale": new_scale, "reason": f"rollback: {reason}"})
        self.events.emit(
            "rollback",
            f"job {job}: rolling back to a checkpoint before step {before_step} and scaling LR to {new_scale:.3g}"
            + (f" (not step {came_from}, which this attempt started from)" if isinstance(came_from, int) else ""),
            severity="warning",
            job=job,
            cause=reason,
            action="rollback",
            lr_scale=new_scale,
            excluded_steps=sorted(self.rolled_back_from.get(job, ())),
        )
        self.counts.add(job, "rollback", "loss_divergence")
        self.supervisor.restart(job, cause=f"rollback: {reason}")

    def forget(self, job: str) -> None:
        """The job ended: a job submitted again under its name may restore any step."""
        self.rolled_back_from.pop(job, None)
