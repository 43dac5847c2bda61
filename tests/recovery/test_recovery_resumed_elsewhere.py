"""``job_resumed`` is told only for an attempt this node started after the failure: a copy this node
stopped or fenced (the job moved on elsewhere) never reads as training again here."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from tests.helpers.events import EventRecorder
from trainguard.agent.config import AgentConfig
from trainguard.agent.heal.counts import ActionCounts
from trainguard.agent.heal.rollback import Rollback
from trainguard.agent.lifecycle.jobrecord import JobRecord
from trainguard.agent.lifecycle.jobs import JobSpec, JobState
from trainguard.agent.lifecycle.ranks import RankBlock
from trainguard.agent.recovery.service import RecoveryService


class Table:
    """Rank views and step windows as the rank table keeps them."""

    def __init__(self) -> None:
        self.views: dict[str, dict[int, Any]] = {}
        self.steps: dict[tuple[str, int], list[Any]] = {}

    def train(self, job: str, rank: int, pid: int, steps: range, t0: float) -> None:
        msgs = [SimpleNamespace(pid=pid, step=s, steps=1, wall_time=t0 + 0.1 * i, has_loss=False, loss=None,
                                ckpt_failed=None) for i, s in enumerate(steps)]
        self.steps[(job, rank)] = msgs
        self.views.setdefault(job, {})[rank] = SimpleNamespace(rank=rank, pid=pid, step=steps[-1], median_step_s=0.1)

    def snapshot(self) -> Any:
        return SimpleNamespace(jobs=self.views)

    def window(self, job: str, rank: int, n: int | None = None) -> list[Any]:
        return list(self.steps.get((job, rank), []))


def service(tmp_path: Path) -> tuple[RecoveryService, Any]:
    agent = SimpleNamespace(cfg=AgentConfig(), events=EventRecorder(), table=Table(), supervisor=SimpleNamespace(jobs={}))
    checkpoints = SimpleNamespace(memory=SimpleNamespace(jobs=lambda: [], cleanup_job_tmp=lambda key: 0),
                                  settings=SimpleNamespace(memory_root=str(tmp_path), memory_interval=100),
                                  poll=lambda: None, prepare_job=lambda job: None)
    counts = ActionCounts()
    rollback = Rollback(agent.supervisor, None, agent.events, counts, lr_factor=0.5)  # type: ignore[arg-type]
    return RecoveryService(lambda: agent.cfg, agent.events, agent.supervisor, agent.table,  # type: ignore[arg-type]
                           checkpoints, rollback, counts), agent


def spanning_record(pid: int, attempt: int) -> JobRecord:
    block = RankBlock(1, 1, 2, "127.0.0.1", 1, 1, {}, attempt, {"tier": "assembled", "step": 3, "path": "/x"})
    record = JobRecord(JobSpec("big", 2), state=JobState.RUNNING, block=block)
    record.ranks = [SimpleNamespace(pid=pid, alive=True)]  # type: ignore[list-item]
    return record


def test_a_copy_stopped_after_the_job_moved_does_not_resume(tmp_path: Path) -> None:
    svc, agent = service(tmp_path)
    record = spanning_record(100, 2)
    agent.supervisor.jobs["big"] = record
    t0 = time.time()
    svc.launch_env(record)
    agent.table.train("big", 1, 100, range(4, 40), t0 + 1)  # the cut-off copy trains on
    # Its peers are gone: the ranks fail (the node's own word), then the healed cluster's newer
    # attempt places no ranks here and the supervisor stops the copy.
    svc.note_failure("big", "rank_exit", t0 + 30)
    record.state = JobState.STOPPED
    svc.tick(agent, t0 + 31)  # type: ignore[arg-type]
    assert agent.events.of("job_resumed") == []
    assert "big" not in svc._failure_at  # the clock is dropped with the copy, not left for later


def test_an_attempt_started_here_after_the_failure_resumes(tmp_path: Path) -> None:
    svc, agent = service(tmp_path)
    record = spanning_record(100, 2)
    agent.supervisor.jobs["big"] = record
    t0 = time.time() - 60
    svc._launch_at["big"] = t0
    agent.table.train("big", 1, 100, range(4, 40), t0 + 1)
    svc.note_failure("big", "node_lost", t0 + 10)
    svc.tick(agent, t0 + 11)  # type: ignore[arg-type]
    assert agent.events.of("job_resumed") == []  # the old attempt's ranks, no relaunch yet
    # The leader's next attempt starts here: its first steps after the failure are a resume.
    record.block, record.attempt = spanning_record(200, 3).block, 3
    record.ranks = [SimpleNamespace(pid=200, rank=1, alive=True)]  # type: ignore[list-item]
    svc.launch_env(record)
    agent.table.train("big", 1, 200, range(4, 8), time.time() + 0.5)
    svc.tick(agent, time.time())  # type: ignore[arg-type]
    resumed = agent.events.of("job_resumed")
    assert len(resumed) == 1 and resumed[0]["recovery_s"] > 0
    # Where the ranks went on (the restored step 3, then step 4), not the newest step seen (7).
    assert resumed[0]["first_step_after_restore"] == 4 and resumed[0]["restored_step"] == 3, resumed
