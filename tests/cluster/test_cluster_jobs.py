"""Job records in a real etcd, driven through ClusterService with stand-in supervisors: publish,
leader moves the job of a lost node to its peer, the peer adopts it, the old owner is fenced when
it comes back, and a cleanly stopped agent's jobs are paused instead of moved."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.waiting import wait_for
from trainguard.agent.cluster.config import ClusterConfig
from trainguard.agent.cluster.demo import shared_key
from trainguard.agent.cluster.etcdserver import LocalEtcd
from trainguard.agent.cluster.jobs import JobRecordDoc
from trainguard.agent.cluster.service import ClusterService
from trainguard.agent.lifecycle.jobs import JobSpec, JobState
from trainguard.agent.lifecycle.plans import PlanStore


@dataclass
class Rec:
    spec: JobSpec
    state: JobState = JobState.RUNNING
    block: None = None


@dataclass
class FakeSupervisor:
    jobs: dict[str, Rec] = field(default_factory=dict)
    stopped: list[tuple[str, str]] = field(default_factory=list)

    def submit(self, spec: JobSpec) -> Rec:
        old = self.jobs.get(spec.job)
        if old is not None and not old.state.finished:
            raise ValueError("running")
        self.jobs[spec.job] = rec = Rec(spec)
        return rec

    def stop(self, job: str, reason: str = "") -> Rec:
        self.jobs[job].state = JobState.STOPPED
        self.stopped.append((job, reason))
        return self.jobs[job]


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalEtcd]:
    with LocalEtcd(tmp_path_factory.mktemp("etcd"), size=1) as e:
        yield e



def make(etcd: LocalEtcd, tmp: Path, cluster: str, name: str, events: list[tuple[str, str, dict[str, Any]]],
         slots: int = 2) -> tuple[ClusterService, FakeSupervisor]:
    cfg = ClusterConfig(name=cluster, etcd_endpoints=etcd.endpoints, lease_ttl_s=2, poll_s=0.1, etcd_timeout_s=0.5,
                        slots=slots, etcd_plaintext=True, key_file=str(shared_key(tmp)))
    svc = ClusterService(cfg, node=name, memory_root=str(tmp / name),
                         emit=lambda k, m, f: events.append((name, k, f)))
    sup = FakeSupervisor()
    plans = PlanStore(str(tmp / name / f"plans-{time.monotonic_ns()}"))
    svc.start(f"127.0.0.1:{1000 + len(name)}", sup, plans)  # type: ignore[arg-type]
    return svc, sup


def crash(svc: ClusterService) -> None:
    svc._stop.set()
    assert svc.membership is not None
    svc.membership._bump()
    if svc._thread is not None:
        svc._thread.join(5)
    assert svc.membership is not None
    svc.membership._stop.set()
    svc.membership._bump()
    if svc.membership._watch is not None:
        svc.membership._watch.stop()
    if svc.membership._thread is not None:
        svc.membership._thread.join(5)
    if svc.membership._keeper is not None:
        svc.membership._keeper.stop(revoke=False)


def spec(job: str, nproc: int = 2) -> JobSpec:
    return JobSpec.from_dict({"job": job, "nproc": nproc, "trainer": {"parallel": {"dp": nproc, "tp": 1, "pp": 1}}})


def record(svc: ClusterService, job: str) -> JobRecordDoc | None:
    assert svc.jobs is not None
    got = svc.jobs.read().get(job)
    return got[0] if got else None


def test_lost_node_job_moves_to_its_peer_and_old_owner_is_fenced(etcd: LocalEtcd, tmp_path: Path) -> None:
    events: list[tuple[str, str, dict[str, Any]]] = []
    a, sup_a = make(etcd, tmp_path, "move", "a", events)
    b, sup_b = make(etcd, tmp_path, "move", "b", events, slots=1)
    c, sup_c = make(etcd, tmp_path, "move", "c", events)
    try:
        wait_for(lambda: all(len(s.members()) == 3 for s in (a, b, c)), 5, "three members")
        sup_a.submit(spec("j1"))
        assert a.plans is not None
        a.plans.update("j1", {"lr_scale": 0.5, "batch_sizes": [4, 4]})  # e.g. the controller's doing
        rec = wait_for(lambda: (r := record(a, "j1")) and r.plan.get("lr_scale") == 0.5 and r, 5, "j1 published")
        assert rec.node == "a" and rec.peer == "b" and rec.state == "running" and rec.epoch == 0
        assert rec.plan["batch_sizes"] == [4, 4]
        crash(a)  # node a dies with its ranks
        moved = wait_for(lambda: (r := record(b, "j1")) and r.node != "a" and r, 8, "j1 moved")
        assert moved.node == "b" and moved.epoch == 1  # a's peer holds its checkpoint: b
        assert moved.spec["nproc"] == 1 and moved.spec["trainer"]["parallel"]["dp"] == 1  # fits b's one slot
        wait_for(lambda: "j1" in sup_b.jobs, 5, "b adopts j1")
        assert sup_b.jobs["j1"].spec.nproc == 1 and "j1" not in sup_c.jobs
        assert b.plans is not None
        carried = b.plans.get("j1")
        assert carried.lr_scale == 0.5 and carried.batch_sizes is None  # two sizes cannot fit dp=1
        kinds = [(n, k) for n, k, _ in events]
        assert ("b", "job_adopted") in kinds and any(k == "job_moved" for _, k in kinds)
        assert [k for n, k, _ in events if k == "job_moved"].count("job_moved") == 1  # one leader, one move

        # node a was only cut off: it comes back with its old copy still running -> fenced
        a2, sup_a2 = make(etcd, tmp_path, "move", "a", events)
        try:
            sup_a2.jobs["j1"] = Rec(spec("j1"))
            a2._epochs["j1"] = 0  # it had published epoch 0 before the partition
            wait_for(lambda: sup_a2.stopped, 5, "the stale copy on a stopped")
            assert sup_a2.stopped[0][0] == "j1" and "moved to b" in sup_a2.stopped[0][1]
            assert record(b, "j1").node == "b"  # type: ignore[union-attr]
        finally:
            a2.stop()
    finally:
        for s in (b, c):
            s.stop()


def test_clean_stop_pauses_jobs_instead_of_moving_them(etcd: LocalEtcd, tmp_path: Path) -> None:
    events: list[tuple[str, str, dict[str, Any]]] = []
    a, sup_a = make(etcd, tmp_path, "pause", "a", events)
    b, sup_b = make(etcd, tmp_path, "pause", "b", events)
    try:
        wait_for(lambda: len(b.members()) == 2, 5, "two members")
        sup_a.submit(spec("j2"))
        wait_for(lambda: record(a, "j2"), 5, "j2 published")
        a.stop(leave=True)
        wait_for(lambda: "a" not in b.members(), 5, "a gone")
        time.sleep(1.0)  # several leader passes
        rec = record(b, "j2")
        assert rec is not None and rec.node == "a" and rec.state == "paused"
        assert "j2" not in sup_b.jobs
        assert [k for n, k, _ in events if n == "b" and k == "node_left"] == ["node_left"]
    finally:
        b.stop()
