"""Adoption signals only a process it can prove is the rank: a record whose pid now belongs to an
unrelated process (no start time recorded, not in the job's cgroup) leaves that process alone."""

from __future__ import annotations

import subprocess
from pathlib import Path

from trainguard.agent.eventlog import EventLog
from trainguard.agent.lifecycle.jobs import JobSpec
from trainguard.agent.lifecycle.launcher import Launcher
from trainguard.agent.lifecycle.plans import PlanStore
from trainguard.agent.lifecycle.ranks import LaunchContext
from trainguard.agent.lifecycle.records import RankRecord, SavedJob
from trainguard.agent.lifecycle.supervisor import Supervisor


class _Launcher(Launcher):
    """Proves only the pids it is told are the job's (as the job's cgroup would)."""

    def __init__(self, owned: set[int]) -> None:
        super().__init__(mode="cold")
        self.owned = owned
        self.started: list[str] = []

    def owns_pid(self, job: str, pid: int) -> bool:
        return pid in self.owned

    def start(self, spec: JobSpec, ctx: LaunchContext, attempt: int, env_overrides: dict[str, str] | None = None,
              block: object = None) -> list:  # type: ignore[override]
        self.started.append(spec.job)
        return []


def _supervisor(tmp_path: Path, launcher: Launcher) -> tuple[Supervisor, EventLog]:
    events = EventLog(str(tmp_path / "events"), "n1", fsync=False)
    plans = PlanStore(str(tmp_path / "plans"))
    return Supervisor(events, plans, launcher, lambda spec: LaunchContext("", "", str(tmp_path / "jobs" / spec.job)),
                      stop_grace_s=1), events


def _saved(pid: int, ticks: int | None, tmp_path: Path, nproc: int = 1) -> SavedJob:
    spec = JobSpec("adopt", nproc, command=["sleep", "600"]).to_dict()
    ranks = [RankRecord(0, 0, pid, ticks, str(tmp_path / "rank0.log"))]
    return SavedJob(spec, "running", 1, 0, -1, 0.0, ranks, False)


def test_a_reused_pid_without_a_start_time_is_left_alone(tmp_path: Path) -> None:
    bystander = subprocess.Popen(["sleep", "600"], start_new_session=True)
    launcher = _Launcher(owned=set())
    sup, events = _supervisor(tmp_path, launcher)
    try:
        sup.adopt([_saved(bystander.pid, None, tmp_path)])
        assert bystander.poll() is None, "adoption killed a process it could not prove was the rank"
        said = [e for e in events.since(0) if e["kind"] == "pid_not_adopted"]
        assert len(said) == 1 and said[0]["fields"]["pid"] == bystander.pid, said
        restart = [e for e in events.since(0) if e["kind"] == "job_restart"]
        assert restart and bystander.pid not in restart[0]["fields"]["killed"]
    finally:
        sup.close()
        bystander.kill()
        bystander.wait()


def test_a_pid_proven_by_the_jobs_cgroup_is_adopted(tmp_path: Path) -> None:
    rank = subprocess.Popen(["sleep", "600"], start_new_session=True)
    launcher = _Launcher(owned={rank.pid})
    sup, events = _supervisor(tmp_path, launcher)
    try:
        sup.adopt([_saved(rank.pid, None, tmp_path)])
        kinds = [e["kind"] for e in events.since(0)]
        assert "job_adopted" in kinds and "pid_not_adopted" not in kinds, kinds
        assert [r.pid for r in sup.jobs["adopt"].ranks] == [rank.pid] and rank.poll() is None
    finally:
        sup.close()
        rank.kill()
        rank.wait()


def test_a_record_without_a_start_time_is_not_alive_by_itself() -> None:
    bystander = subprocess.Popen(["sleep", "600"])
    try:
        assert not RankRecord(0, 0, bystander.pid, None, "/x").alive()
        assert RankRecord(0, 0, bystander.pid, None, "/x").proven(lambda pid: False) is None
        proven = RankRecord(0, 0, bystander.pid, None, "/x").proven(lambda pid: True)
        assert proven is not None and proven.alive()
    finally:
        bystander.kill()
        bystander.wait()
