"""A job as the supervisor keeps it: its spec, state, attempt, ranks and restart counts."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from trainguard.agent.lifecycle.jobs import JobSpec, JobState
from trainguard.agent.lifecycle.ranks import RankBlock, RankProcess


@dataclass
class JobRecord:
    spec: JobSpec
    state: JobState = JobState.STARTING
    attempt: int = 0
    ranks: list[RankProcess] = field(default_factory=list)
    submitted: float = field(default_factory=time.time)
    restarts: int = 0
    restarts_without_progress: int = 0
    progress_step: int = -1
    """Highest step any rank reported (telemetry), for the crash-loop guard."""
    step_at_last_restart: int = -1
    reason: str = ""
    exit_codes: dict[int, int | None] = field(default_factory=dict)
    failure_code: int | None = None
    """Exit status of the rank whose death caused the latest restart (128 + N for signal N)."""
    finished_at: float | None = None
    """When the job reached a final state (for the retention of finished jobs)."""
    restore_max_step: int | None = None
    """For a rollback: restore the newest checkpoint at or before this step (None: the newest)."""
    restored_from: dict[str, Any] | None = None
    """The checkpoint the current attempt was started from (tier, step, path)."""
    block: RankBlock | None = None
    """This node's ranks of a job that spans nodes (None: every rank runs here)."""
    on_failure: Callable[[str, str], None] | None = None
    """Set for a job that spans nodes: a failure is reported here (``(job, cause)``) and the local
    ranks are stopped; the cluster leader restarts every node's ranks together."""

    @property
    def job(self) -> str:
        return self.spec.job

    @property
    def exit_code(self) -> int | None:
        """The job's exit status as a launcher reports it: 0 when it succeeded, the failing rank's
        status when it failed (1 when it failed for another reason), 1 when it was stopped, None
        while it runs."""
        if not self.state.finished:
            return None
        if self.state == JobState.SUCCEEDED:
            return 0
        if self.state == JobState.FAILED:
            return self.failure_code or 1
        return 1

    @property
    def decides_here(self) -> bool:
        """Job-wide judgement (stragglers, controller) belongs to the node that holds rank 0: it
        reads the plan and sees every rank's telemetry (the other nodes forward theirs)."""
        return self.block is None or self.block.group_rank == 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "job": self.job,
            "state": self.state.value,
            "attempt": self.attempt,
            "restarts": self.restarts,
            "nproc": self.spec.nproc,
            "nodes": self.spec.nodes,
            "local_ranks": [self.block.rank_offset, self.block.rank_offset + self.block.nproc - 1] if self.block else None,
            "progress_step": self.progress_step,
            "reason": self.reason,
            "exit_code": self.exit_code,
            "submitted": self.submitted,
            "ranks": [
                {
                    "rank": r.rank,
                    "pid": r.pid,
                    "alive": r.alive,
                    "exit_code": r.exit_code,
                    "exit_signal": r.exit_signal,
                    "log": r.log_path,
                }
                for r in self.ranks
            ],
            "spec": self.spec.to_dict(),
        }


def launch_attempt(record: JobRecord) -> int:
    """The attempt number the next start of ``record``'s ranks runs as. A node's share of a job
    spanning nodes takes the cluster's attempt (every node's ranks scope their rendezvous and
    store keys by it, and a node new to the job has no local count); a job of this node alone
    counts its own starts."""
    if record.block is not None and record.block.attempt > 0:
        return record.block.attempt
    return record.attempt + 1
