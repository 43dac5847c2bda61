"""Membership and leader election against a real etcd on loopback (one member, and three)."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.waiting import wait_for
from trainguard.agent.cluster import etcdserver
from trainguard.agent.cluster.config import ClusterConfig
from trainguard.agent.cluster.etcd import EtcdClient, EtcdUnavailable, prefix_end
from trainguard.agent.cluster.etcdserver import LocalEtcd
from trainguard.agent.cluster.membership import ClusterView, Membership, NodeInfo

TTL = 3


@pytest.fixture(scope="module")
def etcd1(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalEtcd]:
    with LocalEtcd(tmp_path_factory.mktemp("etcd1"), size=1) as e:
        yield e


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def __call__(self, kind: str, message: str, fields: dict[str, Any]) -> None:
        self.events.append((kind, fields))

    def kinds(self, kind: str) -> list[dict[str, Any]]:
        return [f for k, f in self.events if k == kind]


def crash(m: Membership) -> None:
    """What a SIGKILL leaves: no more refreshes, no resignation, the lease runs out on the server."""
    m._stop.set()
    m._bump()
    if m._watch is not None:
        m._watch.stop()
    if m._thread is not None:
        m._thread.join(5)
    if m._keeper is not None:
        m._keeper.stop(revoke=False)


def make(endpoints: list[str], cluster: str, name: str, rec: Recorder, ttl: int = TTL, watch: bool = False) -> Membership:
    # Watching: polling slowed to 5 s, so only the watch stream can make the timings below.
    return Membership(EtcdClient(endpoints, timeout_s=0.5, plaintext=True), cluster, NodeInfo(name, f"127.0.0.1:{hash(name) % 1000 + 1000}", 2),
                      ttl=ttl, poll_s=5.0 if watch else 0.1, emit=rec, watch=watch, resync_s=30.0)


modes = pytest.mark.parametrize("watch", [False, True], ids=["poll", "watch"])


def test_prefix_end() -> None:
    import base64

    assert base64.b64decode(prefix_end("/a/")) == b"/a0"
    assert base64.b64decode(prefix_end("a\xff")) == b"a\xc3\xc0"  # UTF-8 c3 bf: the last byte bumps


def test_solo_agent_is_its_own_leader_without_etcd() -> None:
    rec = Recorder()
    m = Membership(None, "solo", NodeInfo("n1"), emit=rec)
    m.start()
    assert m.is_leader and m.leader == "n1" and list(m.members()) == ["n1"]
    assert rec.kinds("leader_elected")[0]["leader"] == "n1"
    m.stop()


@modes
def test_three_agents_elect_one_leader_and_see_each_other(etcd1: LocalEtcd, watch: bool) -> None:
    recs = {n: Recorder() for n in ("a", "b", "c")}
    ms = {n: make(etcd1.endpoints, f"elect-{watch}", n, recs[n], watch=watch) for n in recs}
    changes: list[ClusterView] = []
    ms["a"].on_change(changes.append)
    try:
        for m in ms.values():
            m.start()
        wait_for(lambda: all(len(m.members()) == 3 for m in ms.values()), 5, "all see three members")
        leaders = {m.leader for m in ms.values()}
        assert len(leaders) == 1 and None not in leaders
        leader = leaders.pop()
        assert [n for n, m in ms.items() if m.is_leader] == [leader]
        assert ms["a"].members()["b"].api == ms["b"].me.api and ms["a"].members()["b"].slots == 2
        assert {f["node"] for f in recs["a"].kinds("node_joined")} == {"b", "c"}
        assert changes and changes[-1].leader == leader

        # a clean leave is a leave, not a loss, and hands leadership over at once
        ms[leader].stop(leave=True)
        rest = [m for n, m in ms.items() if n != leader]
        # within a TTL: the leaver's lease is revoked, not left to run out
        wait_for(lambda: all(m.leader not in (None, leader) for m in rest), TTL, "new leader after resign")
        assert len({m.leader for m in rest}) == 1
        other = rest[0]
        wait_for(lambda: leader not in other.members(), 3, "leaver gone")
        recorder = recs[other.me.node]
        assert [f["node"] for f in recorder.kinds("node_left")] == [leader]
        assert recorder.kinds("node_lost") == []
    finally:
        for m in ms.values():
            m.stop(leave=True)


@modes
def test_leader_crash_new_leader_within_ttl_three_member_etcd(tmp_path: Path, watch: bool) -> None:
    with LocalEtcd(tmp_path / "etcd3", size=3) as etcd:
        recs = {n: Recorder() for n in ("a", "b", "c")}
        ms = {n: make(etcd.endpoints, "crash", n, recs[n], watch=watch) for n in recs}
        try:
            for m in ms.values():
                m.start()
            wait_for(lambda: all(m.leader and len(m.members()) == 3 for m in ms.values()), 5, "elected")
            leader = ms["a"].leader
            assert leader is not None
            # Take the etcd raft leader down too: the agents' client fails over to the others.
            etcd_leader = etcd.leader()
            assert etcd_leader is not None
            etcd_leader.kill()
            # Taken before the crash, so a stalled test thread only lengthens what it measures.
            t0 = time.monotonic()
            crash(ms[leader])
            rest = {n: m for n, m in ms.items() if n != leader}
            wait_for(lambda: all(m.leader not in (None, leader) for m in rest.values()), TTL + 6,
                     "a new leader")
            # No new leader while the old lease lives: it runs out (most of a TTL after its last refresh).
            took = time.monotonic() - t0
            assert took >= TTL - 1.5, took
            new = {m.leader for m in rest.values()}
            assert len(new) == 1
            assert sum(m.is_leader for m in rest.values()) == 1
            for n, m in rest.items():
                assert [f["node"] for f in recs[n].kinds("node_lost")] == [leader]
                assert leader not in m.members()
        finally:
            for m in ms.values():
                crash(m)


@modes
def test_etcd_stall_shorter_than_ttl_declares_no_loss(etcd1: LocalEtcd, watch: bool) -> None:
    ttl = 4
    recs = {n: Recorder() for n in ("a", "b")}
    ms = {n: make(etcd1.endpoints, f"stall-{watch}", n, recs[n], ttl=ttl, watch=watch) for n in recs}
    try:
        for m in ms.values():
            m.start()
        wait_for(lambda: all(len(m.members()) == 2 and m.leader for m in ms.values()), 5, "both in")
        leader = ms["a"].leader
        member = etcd1.members[0]
        member.pause()
        try:
            t0 = time.monotonic()
            # noticed through a failed read or lease refresh within the stall
            wait_for(lambda: not ms["a"].etcd_reachable, 2.0, "the stall noticed")
            time.sleep(max(0.0, 2.0 - (time.monotonic() - t0)))
            # While etcd is frozen nobody can read: the view stays, nobody is dropped.
            assert all(len(m.members()) == 2 for m in ms.values())
        finally:
            member.resume()
        wait_for(lambda: all(m.etcd_reachable for m in ms.values()), 5, "etcd back")
        time.sleep(ttl + 0.5)  # a lease that was not refreshed in time would have expired by now
        for n, m in ms.items():
            assert len(m.members()) == 2, (n, m.members())
            assert recs[n].kinds("node_lost") == [], recs[n].events
            assert m.leader == leader
        assert recs["a"].kinds("etcd_unreachable") and recs["a"].kinds("etcd_reachable")
        assert ms["a"]._keeper is not None and ms["a"]._keeper.failures > 0  # refreshes did fail
    finally:
        for m in ms.values():
            m.stop()


def test_expired_own_lease_reregisters(etcd1: LocalEtcd) -> None:
    rec = Recorder()
    m = make(etcd1.endpoints, "reregister", "solo", rec)
    try:
        m.start()
        wait_for(lambda: m.is_leader, 3, "leader")
        assert m._keeper is not None
        old = m._keeper.lease
        EtcdClient(etcd1.endpoints, plaintext=True).revoke(old)  # the server drops it, as after a long partition
        wait_for(lambda: m._keeper is not None and m._keeper.lease != old and m.is_leader, 5, "re-registered")
        assert rec.kinds("cluster_lease_renewed")
    finally:
        m.stop()


def test_unreachable_etcd_raises_typed_error() -> None:
    from trainguard.agent.cluster.etcdserver import free_port

    client = EtcdClient([f"127.0.0.1:{free_port()}"], timeout_s=0.2, plaintext=True)
    with pytest.raises(EtcdUnavailable):
        client.grant(3)


def test_config_errors_name_the_key() -> None:
    with pytest.raises(ValueError, match=r"^cluster\.lease_ttl_s"):
        ClusterConfig(etcd_endpoints=["127.0.0.1:2379"], lease_ttl_s=1)
    with pytest.raises(ValueError, match=r"^cluster\.etcd_endpoints\[0\]"):
        ClusterConfig(etcd_endpoints=["nope"])
    with pytest.raises(ValueError, match=r"^cluster\.name"):
        ClusterConfig(name="a/b")
    assert ClusterConfig().solo


def test_local_etcd_starts_again_on_fresh_ports_when_a_port_was_taken(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A port probed free can be taken before etcd binds it (CI saw "address already in use"):
    the cluster starts again on fresh ports instead of failing the test that wanted it."""
    held = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    held.bind(("127.0.0.1", 0))
    held.listen()
    taken = held.getsockname()[1]
    handed: list[int] = []
    free_port = etcdserver.free_port

    def first_taken() -> int:
        port = taken if not handed else free_port()
        handed.append(port)
        return port

    monkeypatch.setattr(etcdserver, "free_port", first_taken)
    try:
        with LocalEtcd(tmp_path, size=1) as e:
            assert e.members[0].client_port != taken
            kv = e.client().get("/trainguard-ready")
            assert kv is not None and kv.value == b"1"
        assert "address already in use" in (tmp_path / "m0.log").read_text()
        assert len(handed) == 4  # two ports per try
    finally:
        held.close()
