"""Exclusion: a job restarts without the data-parallel replica that holds one rank (a straggler past
its limit, a rank on a failed GPU, an operator's drain). DCP reshards the checkpoint on load, and
the plan's per-rank batch sizes are dropped since they no longer fit the smaller world."""

from __future__ import annotations

import copy

from trainguard.agent.eventlog import EventLog
from trainguard.agent.heal.counts import ActionCounts
from trainguard.agent.lifecycle.jobs import JobSpec
from trainguard.agent.lifecycle.plans import PlanStore
from trainguard.agent.lifecycle.supervisor import Supervisor


class Exclusion:
    def __init__(self, supervisor: Supervisor, plans: PlanStore, events: EventLog, counts: ActionCounts) -> None:
        self.supervisor = supervisor
        self.plans = plans
        self.events = events
        self.counts = counts

    def __call__(self, job: str, rank: int, reason: str, kind: str = "straggler") -> bool:
        """Restart the job without one data-parallel replica (the one holding ``rank``); ``kind``
        is what made it go (the ``cause`` label of the action counter). False: it cannot shrink."""
        record = self.supervisor.jobs.get(job)
        if record is None:
            return False
        spec: JobSpec = copy.deepcopy(record.spec)
        par = dict(spec.trainer.get("parallel", {}))
        dp, tp, pp = int(par.get("dp", spec.nproc)), int(par.get("tp", 1)), int(par.get("pp", 1))
        if dp <= 1:
            self.events.emit(
                "rank_exclusion_refused", f"job {job}: cannot exclude rank {rank}: dp is already 1", severity="warning", job=job, rank=rank, cause=reason
            )
            return False
        par["dp"] = dp - 1
        spec.trainer = {**spec.trainer, "parallel": par}
        spec.nproc = (dp - 1) * tp * pp
        self.events.emit(
            "rank_excluded",
            f"job {job}: restarting without rank {rank}'s replica: dp {dp} -> {dp - 1}, {spec.nproc} ranks",
            severity="warning",
            job=job,
            rank=rank,
            cause=reason,
            action="exclude",
        )
        self.counts.add(job, "exclude", kind)
        # The world shrinks: per-rank batch sizes of the old plan no longer fit.
        self.plans.update(job, {"batch_sizes": None, "reason": f"rank {rank} excluded"})
        self.supervisor.restart(job, cause=f"exclude rank {rank}: {reason}", spec=spec)
        return True
