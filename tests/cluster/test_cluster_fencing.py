"""Against a real etcd on loopback: an agent cut off from etcd fences its ranks before its lease can
expire; a deposed leader's writes are refused by etcd; a node name held by another live agent is
refused, while a crashed agent's own name is taken back once its old lease ran out."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.waiting import wait_for
from trainguard.agent.cluster.config import ClusterConfig
from trainguard.agent.cluster.demo import shared_key
from trainguard.agent.cluster.etcd import EtcdClient
from trainguard.agent.cluster.etcdserver import LocalEtcd
from trainguard.agent.cluster.jobs import JobRecordDoc, JobTable
from trainguard.agent.cluster.membership import LeaderClaim, Membership, NodeInfo
from trainguard.agent.cluster.service import ClusterService
from trainguard.agent.cluster.signing import load_key
from trainguard.agent.eventlog import EventLog
from trainguard.agent.lifecycle.jobs import JobSpec, JobState
from trainguard.agent.lifecycle.launcher import Launcher, free_port
from trainguard.agent.lifecycle.plans import PlanStore
from trainguard.agent.lifecycle.ranks import LaunchContext, RankBlock
from trainguard.agent.lifecycle.supervisor import Supervisor


def KEY(directory: Path) -> str:  # noqa: N802 - reads as a constant at the call sites
    """The cluster key every service of one test shares."""
    return str(shared_key(directory))


TTL = 3
SLEEPER = [sys.executable, "-c", "import time\nwhile True: time.sleep(0.05)"]


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalEtcd]:
    with LocalEtcd(tmp_path_factory.mktemp("etcd"), size=1) as e:
        yield e


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, str, dict[str, Any]]] = []

    def __call__(self, kind: str, message: str, fields: dict[str, Any]) -> None:
        self.events.append((kind, message, fields))

    def of(self, kind: str) -> list[tuple[str, dict[str, Any]]]:
        return [(m, f) for k, m, f in self.events if k == kind]


def member(etcd: LocalEtcd, cluster: str, name: str, rec: Recorder, api: str = "127.0.0.1:1") -> Membership:
    return Membership(EtcdClient(etcd.endpoints, timeout_s=0.5, plaintext=True), cluster, NodeInfo(name, api, 1),
                      ttl=TTL, poll_s=0.1, emit=rec)


def crash(m: Membership) -> None:
    """What a SIGKILL leaves: no more refreshes, no resignation, the lease runs out on the server."""
    m._stop.set()
    m._bump()
    if m._thread is not None:
        m._thread.join(5)
    if m._keeper is not None:
        m._keeper.stop(revoke=False)


def test_a_deposed_leaders_write_is_refused(etcd: LocalEtcd) -> None:
    ra, rb = Recorder(), Recorder()
    a = member(etcd, "depose", "a", ra)
    a.start()
    b = member(etcd, "depose", "b", rb)
    b.start()
    try:
        wait_for(lambda: a.is_leader and b.leader == "a", 10, "a leads")
        client = EtcdClient(etcd.endpoints, plaintext=True)
        table = JobTable(client, "/trainguard/depose/")
        rec = JobRecordDoc("j", {"job": "j", "nproc": 1}, "a")
        assert table.write(rec, 0, leader=a.claim())
        _, rev = table.read()["j"]
        # a is deposed (its key deleted, as an expiry or an operator would) and b wins the election,
        # while a's own view still says it leads: its late decision must not land.
        a._stop.set()  # a stops reading etcd (its lease stays refreshed), so it cannot win again
        a._bump()
        assert a._thread is not None
        a._thread.join(5)
        client.delete(a.leader_key)
        wait_for(lambda: b.is_leader, 10, "b leads")
        assert a.claim().node == "a"
        assert not table.write(JobRecordDoc("j", {"job": "j", "nproc": 1}, "x", epoch=9), rev, leader=a.claim())
        assert not table.write(JobRecordDoc("k", {"job": "k", "nproc": 1}, "x"), 0, leader=a.claim())
        assert not table.write(JobRecordDoc("k", {"job": "k", "nproc": 1}, "x"), None, leader=a.claim())
        # b's name under a's lease (a holder that lost its lease and whose name was taken again).
        assert not table.write(JobRecordDoc("j", {}, "x"), rev, leader=LeaderClaim(b.leader_key, "b", a.claim().lease))
        assert table.read()["j"] == (rec, rev) and "k" not in table.read()
        assert table.refused == 4
        assert table.write(JobRecordDoc("j", {"job": "j", "nproc": 1}, "b", epoch=1), rev, leader=b.claim())
        assert table.read()["j"][0].node == "b"
    finally:
        a.stop()
        b.stop()


def test_a_node_name_held_by_a_live_agent_is_refused(etcd: LocalEtcd) -> None:
    r1, r2 = Recorder(), Recorder()
    first = member(etcd, "dup", "n1", r1, "127.0.0.1:7001")
    first.start()
    second = member(etcd, "dup", "n1", r2, "127.0.0.1:7002")
    try:
        t0 = time.monotonic()
        second.start()  # waits TTL + 1 s for the key to go, then refuses
        print(f"second agent refused after {time.monotonic() - t0:.1f} s (TTL {TTL} s)")
        assert second.refused and "n1" in second.refused and "7001" in second.refused
        (message, fields), = r2.of("cluster_join_refused")
        assert fields["severity"] == "critical" and "without cluster jobs" in message
        assert not second.is_leader and second.members() == {} and second.refresh_age() is None
        assert first.is_leader and list(first.members()) == ["n1"]
        key = EtcdClient(etcd.endpoints, plaintext=True).get(first.nodes_prefix + "n1")
        assert key is not None and first._keeper is not None and key.lease == first._keeper.lease
        assert b"7001" in key.value
    finally:
        second.stop()
        first.stop()


def test_a_restarted_agent_takes_its_name_back_after_its_old_lease_expires(etcd: LocalEtcd) -> None:
    r1, r2 = Recorder(), Recorder()
    old = member(etcd, "restart", "n1", r1, "127.0.0.1:7001")
    old.start()
    crash(old)  # SIGKILLed: its key stays until the server expires the lease
    new = member(etcd, "restart", "n1", r2, "127.0.0.1:7003")
    try:
        new.start()
        assert not new.refused and r2.of("cluster_join_refused") == []
        key = EtcdClient(etcd.endpoints, plaintext=True).get(new.nodes_prefix + "n1")
        assert key is not None and b"7003" in key.value and new._keeper is not None and key.lease == new._keeper.lease
    finally:
        new.stop()


def make_supervisor(tmp_path: Path) -> Supervisor:
    events = EventLog(str(tmp_path / "events"), "a", fsync=False)
    plans = PlanStore(str(tmp_path / "plans"))

    def ctx(spec: JobSpec) -> LaunchContext:
        return LaunchContext(telemetry_socket=str(tmp_path / "t.sock"), plan_path=plans.path(spec.job),
                             log_dir=str(tmp_path / "jobs" / spec.job))

    return Supervisor(events, plans, Launcher(mode="cold"), ctx, stop_grace_s=3)  # type: ignore[arg-type]


def published(svc: ClusterService, job: str) -> JobRecordDoc | None:
    assert svc.jobs is not None
    got = svc.jobs.read().get(job)
    return got[0] if got else None


def test_an_agent_cut_off_from_etcd_fences_its_ranks_before_the_ttl(etcd: LocalEtcd, tmp_path: Path) -> None:
    rec = Recorder()
    cfg = ClusterConfig(name="fence", etcd_endpoints=etcd.endpoints, etcd_plaintext=True, key_file=KEY(tmp_path), lease_ttl_s=TTL, poll_s=0.1, etcd_timeout_s=0.5)
    sup = make_supervisor(tmp_path)
    svc = ClusterService(cfg, node="a", memory_root=str(tmp_path / "shm"), emit=rec)
    svc.start("127.0.0.1:1", sup, PlanStore(str(tmp_path / "plans")))
    try:
        sup.submit(JobSpec("j", 1, command=SLEEPER))
        # This node's block of a job spanning nodes (attempt 2 of the leader's): fenced as well.
        block = RankBlock(1, 1, 2, "127.0.0.1", free_port(), 1, {}, 2)
        sup.submit(JobSpec("span", 2, command=SLEEPER), block=block, on_failure=lambda job, cause: None)
        wait_for(lambda: sup.jobs["j"].state == JobState.RUNNING and published(svc, "j") is not None
                 and sup.jobs["span"].state == JobState.RUNNING, 30, "the jobs run and j is published")
        first = sup.jobs["j"]
        rank = first.ranks[0]

        # A stall shorter than TTL - margin fences nothing.
        assert svc.membership is not None
        short = max(0.2, cfg.fence_after_s - 1.2)
        etcd.members[0].pause()
        time.sleep(short)
        etcd.members[0].resume()
        wait_for(lambda: (age := svc.membership.refresh_age()) is not None and age < 1.5, 10,  # type: ignore[union-attr]
                 "a refresh after the stall")
        assert rec.of("job_fenced") == [] and rank.popen.poll() is None and first.state == JobState.RUNNING

        # Cut off longer than the TTL: the ranks stop on the agent's own clock, before the lease
        # can expire on the server.
        etcd.members[0].pause()
        try:
            paused = time.monotonic()
            # Submitted while cut off: unknown to the cluster (not published), so no one else
            # can start it and it runs on.
            sup.submit(JobSpec("unpublished", 1, command=SLEEPER))
            wait_for(lambda: len(rec.of("job_fenced")) == 2, 10, "job_fenced for both cluster jobs")
            fenced_after = time.monotonic() - paused
            (message, fields), = [(m, f) for m, f in rec.of("job_fenced") if f["job"] == "j"]
            _, span = [(m, f) for m, f in rec.of("job_fenced") if f["job"] == "span"][0]
            assert span["spanning"] and span["age_s"] < TTL
            assert svc.gangs is not None and "fenced its ranks" in svc.gangs._requests["span"]["cause"]
            assert svc.gangs._requests["span"]["attempt"] == 2  # the leader gets it once etcd answers
            wait_for(lambda: rank.popen.poll() is not None, 10, "the rank killed")
            print(f"last good lease refresh -> fence: {fields['age_s']:.2f} s (limit {cfg.fence_after_s:.2f} s, "
                  f"TTL {TTL} s); etcd paused -> fence: {fenced_after:.2f} s")
            assert fields["age_s"] < TTL and "lease not refreshed for" in message and fields["pids"] == [rank.pid]
            assert rank.popen.returncode == -9 and first.state == JobState.STOPPED
            time.sleep(TTL + 1 - fenced_after if fenced_after < TTL + 1 else 0)
            assert sup.jobs["j"] is first and first.state == JobState.STOPPED  # nothing restarts it meanwhile
            assert sup.jobs["span"].state == JobState.STOPPED
            assert sup.jobs["unpublished"].state == JobState.RUNNING
        finally:
            etcd.members[0].resume()

        # etcd back: the record (still naming this node, whose lease expired meanwhile) decides; the
        # agent claims a new epoch before it starts the job again.
        wait_for(lambda: sup.jobs["j"] is not first and sup.jobs["j"].state == JobState.RUNNING, 30,
                 "the job restarted from its record")
        again = published(svc, "j")
        assert again is not None and again.node == "a" and again.epoch == 1 and again.cause.startswith("restarted after fence")
        assert len(rec.of("job_fenced")) == 2 and svc.status()["fenced"] == {}
    finally:
        svc.stop(leave=False)
        sup.stop_all("test over")
        for job in ("j", "span", "unpublished"):
            sup.launcher.close_job(job)
        sup.close()


def test_fence_margin_is_checked_at_load() -> None:
    assert ClusterConfig(lease_ttl_s=10).fence_after_s == 7.5
    assert 1.0 < ClusterConfig(lease_ttl_s=3, etcd_timeout_s=0.5).fence_after_s < 3
    with pytest.raises(ValueError, match="cluster.fence_margin_s"):
        ClusterConfig(lease_ttl_s=10, fence_margin_s=7)
    with pytest.raises(ValueError, match="cluster.fence_margin_s"):
        ClusterConfig(lease_ttl_s=10, fence_margin_s=-1)
    assert ClusterConfig(lease_ttl_s=10, fence_margin_s=4).fence_after_s == 6



def test_ranks_taken_over_from_a_crashed_run_stop_if_the_job_moved_meanwhile(etcd: LocalEtcd, tmp_path: Path) -> None:
    """The agent restarted after a crash waits out its previous run's lease; the leader may move
    the job in that time. The ranks this agent took over then stop: the record decides."""
    client = EtcdClient(etcd.endpoints, plaintext=True)
    prefix = "/trainguard/takeover/"
    old_lease = client.grant(TTL)
    client.put(prefix + "nodes/a", NodeInfo("a", "127.0.0.1:9").to_json(), old_lease)  # the crashed run's key
    table = JobTable(client, prefix, key=load_key(KEY(tmp_path)))
    assert table.write(JobRecordDoc("moved", {"job": "moved", "nproc": 1}, "b", epoch=1, history=["a->b"]), 0)
    assert table.write(JobRecordDoc("kept", {"job": "kept", "nproc": 1}, "a"), 0)
    rec = Recorder()
    cfg = ClusterConfig(name="takeover", etcd_endpoints=etcd.endpoints, etcd_plaintext=True, key_file=KEY(tmp_path), lease_ttl_s=TTL, poll_s=0.1,
                        etcd_timeout_s=0.5)
    sup = make_supervisor(tmp_path)
    for job in ("moved", "kept"):  # what the supervisor adopted from its previous run
        sup.submit(JobSpec(job, 1, command=SLEEPER))
    wait_for(lambda: all(sup.jobs[j].state == JobState.RUNNING for j in ("moved", "kept")), 30, "ranks run")
    svc = ClusterService(cfg, node="a", memory_root=str(tmp_path / "shm"), emit=rec)
    try:
        svc.start("127.0.0.1:1", sup, PlanStore(str(tmp_path / "plans")))
        assert svc.membership is not None and svc.membership.waited_for_name and not svc.membership.refused
        wait_for(lambda: sup.jobs["moved"].state == JobState.STOPPED, 10, "the moved job's copy stopped")
        (message, fields), = rec.of("job_fenced")
        assert fields["job"] == "moved" and fields["owner"] == "b" and "previous lease expired" in message
        time.sleep(1.0)
        assert sup.jobs["kept"].state == JobState.RUNNING and rec.of("job_conflict") == []
    finally:
        svc.stop(leave=False)
        sup.stop_all("test over")
        for job in ("moved", "kept"):
            sup.launcher.close_job(job)
        sup.close()


def test_a_deposed_leaders_heal_moves_nothing(etcd: LocalEtcd, tmp_path: Path) -> None:
    """service._heal writes the move with the leader claim: the node that believes it leads, but
    whose key etcd gave to another, moves no job; the real leader does."""
    services = []
    for name in ("a", "b"):
        cfg = ClusterConfig(name="heal", etcd_endpoints=etcd.endpoints, etcd_plaintext=True, key_file=KEY(tmp_path),
                            lease_ttl_s=TTL, poll_s=0.1, etcd_timeout_s=0.5, fence_grace_s=0)  # moves due at once
        svc = ClusterService(cfg, node=name, memory_root=str(tmp_path / name), emit=Recorder())
        svc.start(f"127.0.0.1:{len(services) + 2}", None)
        services.append(svc)
        wait_for(lambda: services[0].is_leader, 10, "a leads")
    a, b = services
    try:
        assert a.jobs is not None and a.membership is not None and b.membership is not None
        assert a.jobs.write(JobRecordDoc("orphan", {"job": "orphan", "nproc": 1}, "gone", peer="b"), 0)
        a.membership._stop.set()  # a stops reading etcd and so keeps believing it leads
        a.membership._bump()
        assert a.membership._thread is not None
        a.membership._thread.join(5)
        a.jobs.client.delete(a.membership.leader_key)
        wait_for(lambda: b.is_leader, 10, "b leads")
        assert a.is_leader  # its own view, still
        a._heal(a.jobs.read())
        got, _ = a.jobs.read()["orphan"]
        assert got.node == "gone" and got.epoch == 0 and a.moves == 0 and a.jobs.refused == 1
        b._heal(b.jobs.read())  # type: ignore[union-attr]
        got, _ = a.jobs.read()["orphan"]
        assert got.node == "b" and got.epoch == 1 and b.moves == 1
    finally:
        for svc in services:
            svc.stop(leave=False)


def test_a_fenced_leader_resigns_so_another_is_elected_before_its_lease_expires(
        etcd: LocalEtcd, tmp_path: Path) -> None:
    """The leader is cut off past the fence but less than a TTL: etcd keeps its lease and its key,
    so without resigning it would lead on (and b never would). It stops acting as leader at the
    fence and deletes the key once etcd answers; b is elected while a's lease is still alive."""
    ttl = 6
    rec, rb = Recorder(), Recorder()
    cfg = ClusterConfig(name="resign", etcd_endpoints=etcd.endpoints, etcd_plaintext=True, key_file=KEY(tmp_path),
                        lease_ttl_s=ttl, poll_s=0.1, etcd_timeout_s=0.5)
    sup = make_supervisor(tmp_path)
    svc = ClusterService(cfg, node="a", memory_root=str(tmp_path / "shm"), emit=rec)
    svc.start("127.0.0.1:1", sup, PlanStore(str(tmp_path / "plans")))
    b = Membership(EtcdClient(etcd.endpoints, timeout_s=0.5, plaintext=True), "resign", NodeInfo("b", "127.0.0.1:2", 1),
                   ttl=ttl, poll_s=0.1, emit=rb)
    try:
        m = svc.membership
        assert m is not None
        wait_for(lambda: svc.is_leader and m.leader == "a", 10, "a leads")
        b.start()
        wait_for(lambda: b.leader == "a" and "b" in m.members(), 10, "b sees a lead")
        lease = m.claim().lease
        wait_for(lambda: (age := m.refresh_age()) is not None and age < 0.3, 10, "a fresh refresh")
        etcd.members[0].pause()
        try:
            wait_for(lambda: rec.of("leader_resigning"), 10, "the fence fires on the leader")
            assert not svc.is_leader and m.leader == "a"  # its view still names it; it acts no more
            assert (m.refresh_age() or 0.0) < ttl - 1
        finally:
            etcd.members[0].resume()
        wait_for(lambda: b.is_leader and m.leader == "b", 10, "b elected after a resigned")
        (_, fields), = rec.of("leader_resigned")
        assert fields["deleted"] is True and m.resignations == 1
        # Resignation, not expiry: a kept its lease and its membership the whole time.
        assert m.claim().lease == lease and "a" in b.members() and not rb.of("node_lost")
        assert not svc.is_leader
    finally:
        b.stop()
        svc.stop(leave=False)
        sup.close()
