"""The leader's decisions for spanning jobs never wait on one node, never roll the lineage back
silently, and re-place a lost node's block only after its grace: with fake member clients that hang
on an Event (released only at the end), a fake job table, and a fake clock."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest

from trainguard.agent.checkpoint.manifest import Manifest
from trainguard.agent.cluster.blobstore import BlobStore
from trainguard.agent.cluster.config import ClusterConfig
from trainguard.agent.cluster.gang import DecisionInputs, Gang, GangCoordinator, decide, trigger
from trainguard.agent.cluster.grace import MissingClock
from trainguard.agent.cluster.jobs import JobRecordDoc
from trainguard.agent.cluster.lineage import CommitRecord, newer_elsewhere
from trainguard.agent.cluster.membership import NodeInfo
from trainguard.agent.cluster.peertier import PeerRef
from trainguard.agent.cluster.survey import Survey, run_bounded
from trainguard.agent.wire import part_key

TIMEOUT = 0.3  # the decision deadline in these tests


def _spec(dp: int = 2, nodes: int = 2) -> dict[str, Any]:
    return {"job": "j", "nproc": dp, "nodes": nodes, "max_restarts": 3,
            "trainer": {"parallel": {"dp": dp, "tp": 1, "pp": 1}}}


def _members(*names: str, slots: int = 1) -> dict[str, NodeInfo]:
    return {n: NodeInfo(n, f"10.0.0.{i + 1}:7000", slots, 0.0) for i, n in enumerate(names)}


def _running(attempt: int = 1, nodes: tuple[str, ...] = ("a", "b"), **gang: Any) -> JobRecordDoc:
    g = Gang(attempt=attempt, blocks=[[n, i, 1] for i, n in enumerate(nodes)], dp=len(nodes),
             master_addr="10.0.0.1", master_port=5000, nodes_seen=list(nodes), **gang)
    return JobRecordDoc("j", _spec(dp=len(nodes)), nodes[0], state="running", gang=g.to_dict())


def _finder(step: int, sources: dict[str, list[str]] | None = None) -> Any:
    def find(rec: JobRecordDoc, g: Gang, apis: dict[str, str], max_step: int | None) -> tuple[int, dict[str, list[str]]]:
        return step, sources or {}
    return find


def _manifest(origin: str, step: int, parts: list[str]) -> bytes:
    return Manifest(part_key("j", origin), step, 1.0, "crc32", (), {"parts": parts}).to_json()


class Peers:
    """Fake member agents: ``held[holder][origin]`` = steps; a node in ``hang`` blocks every call
    on ``release`` (set only at the end of the test)."""

    def __init__(self) -> None:
        self.held: dict[str, dict[str, list[int]]] = {}
        self.parts: dict[int, list[str]] = {}
        self.hang: set[str] = set()
        self.dead: set[str] = set()
        self.release = threading.Event()
        self.calls: list[tuple[str, str]] = []

    def __call__(self, peer: PeerRef) -> Any:
        owner = self

        class Client:
            def _enter(self, what: str) -> None:
                owner.calls.append((peer.node, what))
                if peer.node in owner.hang:
                    owner.release.wait()
                    raise ConnectionError("released")
                if peer.node in owner.dead:
                    raise ConnectionRefusedError("connection refused")

            def status(self) -> dict[str, Any]:
                self._enter("status")
                return {"node": peer.node}

            def get_blob(self, ns: str, path: str) -> bytes:
                self._enter(path)
                origin, key, rest = path.split("/", 2)
                steps = owner.held.get(peer.node, {}).get(origin)
                if steps is None:
                    raise FileNotFoundError(path)
                if rest == "_index":
                    return json.dumps([{"step": s} for s in steps]).encode()
                step = int(rest.split("/")[0].split("_")[-1])
                return _manifest(origin, step, owner.parts[step])

        return Client()


class Table:
    def __init__(self, rec: JobRecordDoc) -> None:
        self.rec, self.rev = rec, 1
        self.writes: list[JobRecordDoc] = []

    def read(self) -> dict[str, tuple[JobRecordDoc, int]]:
        return {self.rec.job: (self.rec, self.rev)}

    def write(self, rec: JobRecordDoc, rev: int | None, *, leader: Any = None) -> bool:
        self.rec, self.rev = rec, self.rev + 1
        self.writes.append(rec)
        return True


class Commits:
    def __init__(self, records: dict[str, CommitRecord] | None = None) -> None:
        self.records = records or {}

    def read(self, job: str) -> dict[str, CommitRecord]:
        return dict(self.records)


@pytest.fixture
def peers() -> Iterator[Peers]:
    p = Peers()
    yield p
    p.release.set()  # the hanging calls end only now


def _leader(tmp_path: Any, peers: Peers, table: Table, members: dict[str, NodeInfo], clock: list[float],
            commits: Commits | None = None, **kw: Any) -> tuple[GangCoordinator, list[tuple[str, str, dict[str, Any]]]]:
    events: list[tuple[str, str, dict[str, Any]]] = []
    store = BlobStore(tmp_path / "held", own_node="a", own_root=tmp_path / "shm")
    gang = GangCoordinator("a", table, store, peers, scratch=str(tmp_path / "asm"),  # type: ignore[arg-type]
                           emit=lambda k, m, f: events.append((k, m, f)), is_leader=lambda: True,
                           members=lambda: members, wake=lambda: None, clock=lambda: clock[0],
                           commits=commits, decision_timeout_s=TIMEOUT, **kw)  # type: ignore[arg-type]
    return gang, events


def _own_part(tmp_path: Any, step: int, parts: list[str]) -> None:
    """Node a's own committed part of ``step`` in its memory tier."""
    from trainguard.agent.checkpoint.memory import MemoryTier

    tier = MemoryTier(tmp_path / "shm")
    staged = tier.stage(part_key("j", "a"), step)
    (staged / "__0_0.distcp").write_bytes(b"x" * 64)
    tier.commit(part_key("j", "a"), step, {"job": "j", "part": "a", "parts": parts}, staged=staged)


# -- 1. bounded, concurrent member calls -------------------------------------------------------------


def test_run_bounded_returns_at_the_deadline_and_names_who_did_not_answer() -> None:
    gate = threading.Event()
    try:
        results, failures = run_bounded({"ok": lambda: 1, "boom": lambda: 1 // 0, "hang": gate.wait}, TIMEOUT)
    finally:
        gate.set()
    assert results == {"ok": 1}
    assert failures["hang"].startswith("no answer within") and "ZeroDivisionError" in failures["boom"]


def test_pending_job_is_placed_without_the_member_that_hangs(tmp_path: Any, peers: Peers) -> None:
    peers.hang = {"b"}
    rec = JobRecordDoc("j", _spec(), "", state="pending", cause="submitted", gang=Gang().to_dict())
    table = Table(rec)
    gang, events = _leader(tmp_path, peers, table, _members("a", "b", "c"), [100.0])
    gang.sync(table.read())
    g = Gang.from_dict(table.rec.gang)
    assert table.rec.state == "running" and g.nodes == ["a", "c"]  # b would come before c by name
    kinds = [k for k, _, _ in events]
    assert kinds == ["gang_members_unreachable", "gang_placed"]
    assert events[0][2]["nodes"] == ["b"] and "b not placed (API did not answer)" in events[1][1]
    assert gang.unreachable_total == 1
    print(f"\nFIGURE decision with one hanging member: survey {gang.last_survey_s:.3f} s "
          f"(deadline {TIMEOUT} s)")


def test_restart_after_a_kill_skips_the_dead_node_and_restores_from_those_that_answer(tmp_path: Any,
                                                                                      peers: Peers) -> None:
    # b's agent was SIGKILLed a moment ago: its lease lives on, its API hangs. c holds b's copy.
    peers.hang = {"b"}
    peers.held = {"c": {"b": [4, 8], "c": [4, 8]}, "b": {"b": [4, 8, 12]}}
    peers.parts = {4: ["a", "b"], 8: ["a", "b"], 12: ["a", "b"]}
    _own_part(tmp_path, 8, ["a", "b"])
    rec = _running(requests={"a": {"attempt": 1, "cause": "rank 0 died", "bad_step": None, "at": 1.0}})
    table = Table(rec)
    gang, events = _leader(tmp_path, peers, table, _members("a", "b", "c"), [5.0])
    gang.sync(table.read())
    g = Gang.from_dict(table.rec.gang)
    assert g.attempt == 2 and g.nodes == ["a", "c"] and g.restore_step == 8
    assert g.sources == {"a": ["a"], "b": ["c"]}
    assert [k for k, _, _ in events].count("gang_members_unreachable") == 1
    # the next decision with b still silent says nothing new as an event (the log says it)
    table.rec = replace(table.rec, gang={**table.rec.gang, "requests": {
        "c": {"attempt": 2, "cause": "rank 1 died", "bad_step": None}}})
    gang.sync(table.read())
    assert Gang.from_dict(table.rec.gang).attempt == 3
    assert [k for k, _, _ in events].count("gang_members_unreachable") == 1


# -- 2. re-place only after the grace ----------------------------------------------------------------


def test_missing_clock_counts_from_first_sight_and_forgets_a_node_that_returns() -> None:
    clock = MissingClock(2.0)
    clock.observe(["a", "b"], ["a"], 10.0)
    clock.observe(["a", "b"], ["a"], 11.0)
    assert not clock.ready("b", 11.9) and clock.ready("b", 12.0) and clock.next_due(11.0) == 1.0
    clock.observe(["a", "b"], ["a", "b"], 12.5)
    assert clock.since() == {} and not clock.ready("b", 20.0) and clock.next_due(20.0) is None


def test_lost_node_is_re_placed_only_after_the_grace(tmp_path: Any, peers: Peers) -> None:
    rec = _running(nodes=("a", "b"))
    inputs = DecisionInputs(missing_since={"b": 10.0}, fence_grace_s=2.0)
    assert trigger(rec, _members("a"), 11.0, inputs) == ("grace", "node b lost; re-placing after 2 s of grace")
    assert decide(rec, _members("a"), _finder(4), 11.9, inputs=inputs) is None
    new, _ = decide(rec, _members("a"), _finder(4), 12.0, inputs=inputs) or (None, "")
    assert new is not None and Gang.from_dict(new.gang).nodes == ["a"] and "node b lost" in new.cause
    # the coordinator keeps first-seen-missing itself, with its clock
    table = Table(rec)
    clock = [10.0]
    gang, _ = _leader(tmp_path, peers, table, _members("a"), clock, fence_grace_s=2.0)
    gang.sync(table.read())
    assert table.writes == [] and gang.missing.since() == {"b": 10.0}
    clock[0] = 12.5
    gang.sync(table.read())
    assert Gang.from_dict(table.rec.gang).attempt == 2


# -- 3. no silent rollback -----------------------------------------------------------------------------


def _commits(**steps: tuple[int, int, list[str]]) -> dict[str, CommitRecord]:
    return {n: CommitRecord(n, s, a, tuple(p), 0.0) for n, (s, a, p) in steps.items()}


def test_newer_elsewhere_needs_every_part_committed_and_names_the_silent_holders() -> None:
    both = _commits(a=(1516, 2, ["a", "b", "c"]), b=(1516, 2, ["a", "b", "c"]), c=(64, 2, ["a", "b", "c"]))
    assert newer_elsewhere(64, both, {"c"}) is None  # c never got past 64: 1516 never was whole
    full = _commits(a=(1516, 2, ["a", "b"]), b=(1600, 2, ["a", "b"]), c=(64, 1, ["c"]))
    newer = newer_elsewhere(64, full, {"c"})
    assert newer is not None and newer.step == 1516 and newer.unreachable == ("a", "b")
    assert newer.committed == {"a": 1516, "b": 1600}
    assert newer_elsewhere(64, full, {"c"}, max_step=1000) is None
    assert newer_elsewhere(64, full, {"c"}, floor=3) is None  # given up before: not asked again
    gone = newer_elsewhere(64, full, {"a", "b", "c"})
    assert gone is not None and not gone.waitable  # they answer, yet hold it no more


def test_leader_waits_for_the_node_with_newer_steps_then_gives_them_up_with_an_event(tmp_path: Any,
                                                                                     peers: Peers) -> None:
    # a and c ran the job; c was cut off after it committed step 20 with a; a keeps only step 10.
    peers.parts = {10: ["a", "c"], 20: ["a", "c"]}
    _own_part(tmp_path, 10, ["a", "c"])
    rec = _running(nodes=("a", "c"))
    table = Table(rec)
    clock = [100.0]
    commits = Commits(_commits(a=(20, 1, ["a", "c"]), c=(20, 1, ["a", "c"])))
    gang, events = _leader(tmp_path, peers, table, _members("a", "b"), clock, commits=commits,
                           lineage_wait_s=30.0)
    peers.held = {"b": {"c": [10]}}  # b holds c's older copy only
    gang.sync(table.read())
    rec1 = table.rec
    assert rec1.state == "pending" and "step 20" in rec1.cause and "c (unreachable)" in rec1.cause
    assert [k for k, _, _ in events] == ["lineage_waiting"]
    assert events[0][2]["nodes"] == ["c"] and events[0][2]["restorable"] == 10
    clock[0] = 120.0
    gang.sync(table.read())
    assert table.rec is rec1 and len(events) == 1  # still waiting, said once
    clock[0] = 130.0
    gang.sync(table.read())
    g = Gang.from_dict(table.rec.gang)
    assert table.rec.state == "running" and g.attempt == 2 and g.restore_step == 10
    assert g.given_up["newest"] == 20 and g.given_up["committed"] == {"a": 20, "c": 20}
    assert g.given_up["waited_s"] == 30.0 and g.lineage_floor == 2 and not g.lineage_wait
    assert g.failed_at == 100.0  # the recovery clock runs from the failure, not from the end of the wait
    kinds = [k for k, _, _ in events]
    assert kinds == ["lineage_waiting", "gang_placed", "lineage_steps_given_up"]
    assert "steps 11-20" in events[-1][1] and "c (step 20)" in events[-1][1]
    assert gang.lineage_waits == 1 and gang.lineage_given_up == 1
    assert any("gave up steps 11-20" in h for h in table.rec.history)
    # a later failure of the new lineage does not wait again for the old records
    table.rec = replace(table.rec, gang={**table.rec.gang, "requests": {
        "a": {"attempt": 2, "cause": "rank died", "bad_step": None}}})
    gang.sync(table.read())
    assert table.rec.state == "running" and Gang.from_dict(table.rec.gang).attempt == 3


def test_a_node_that_comes_back_in_time_gives_its_newer_step(tmp_path: Any, peers: Peers) -> None:
    peers.parts = {10: ["a", "c"], 20: ["a", "c"]}
    _own_part(tmp_path, 10, ["a", "c"])
    _own_part(tmp_path, 20, ["a", "c"])
    rec = _running(nodes=("a", "c"))
    table = Table(rec)
    clock = [100.0]
    members = _members("a", "b")
    commits = Commits(_commits(a=(20, 1, ["a", "c"]), c=(20, 1, ["a", "c"])))
    gang, events = _leader(tmp_path, peers, table, members, clock, commits=commits, lineage_wait_s=30.0)
    gang.sync(table.read())
    assert table.rec.state == "pending"
    members["c"] = NodeInfo("c", "10.0.0.3:7000", 1, 0.0)  # c is back before the wait ends
    peers.held = {"c": {"c": [10, 20]}}
    clock[0] = 110.0
    gang.sync(table.read())
    g = Gang.from_dict(table.rec.gang)
    assert table.rec.state == "running" and g.restore_step == 20 and not g.given_up
    assert "lineage_steps_given_up" not in [k for k, _, _ in events]


def test_a_returning_node_never_brings_back_the_branch_given_up() -> None:
    # c comes back holding step 30 of the old branch (parts a and c, committed at t=50); the leader
    # gave that branch up at t=100 restoring step 10, and the new lineage committed its own step 20.
    survey = Survey(have={"a": {10: ["a"], 20: ["a"], 30: ["c"]}, "c": {10: ["b"], 20: ["c"], 30: ["c"]}},
                    manifests={("a", 10, "a"): (["a", "c"], 5.0), ("c", 10, "b"): (["a", "c"], 5.0),
                               ("a", 20, "a"): (["a", "c"], 140.0), ("c", 20, "c"): (["a", "c"], 40.0),
                               ("a", 30, "c"): (["a", "c"], 50.0), ("c", 30, "c"): (["a", "c"], 50.0)})
    assert survey.find_restore()[0] == 30  # nothing given up: the newest whole step
    step, sources = survey.find_restore(abandoned=[[10, 100.0]])
    assert step == 10 and sources == {"a": ["a"], "c": ["b"]}  # c's step 20 is the old branch's too
    survey.manifests[("c", 20, "c")] = (["a", "c"], 150.0)  # the new lineage's own step 20 on c
    assert survey.find_restore(abandoned=[[10, 100.0]])[0] == 20


def test_steps_nobody_holds_any_more_are_given_up_at_once_and_said() -> None:
    rec = _running(nodes=("a", "b"), requests={"a": {"attempt": 1, "cause": "x", "bad_step": None}})
    inputs = DecisionInputs(commits=_commits(a=(20, 1, ["a", "b"]), b=(20, 1, ["a", "b"])), lineage_wait_s=30.0)
    new, _ = decide(rec, _members("a", "b"), _finder(10), 5.0, inputs=inputs) or (None, "")
    assert new is not None and new.state == "running"
    assert Gang.from_dict(new.gang).given_up["unreachable"] == [] and Gang.from_dict(new.gang).restore_step == 10


def test_a_drained_node_still_gives_its_parts_and_is_not_waited_for() -> None:
    seen: list[dict[str, str]] = []

    def find(rec: JobRecordDoc, g: Gang, apis: dict[str, str], max_step: int | None) -> tuple[int, dict[str, list[str]]]:
        seen.append(apis)
        return 20, {"a": ["a"], "b": ["b"]}

    rec = replace(_running(nodes=("a", "b")), drained=["b"])
    inputs = DecisionInputs(commits=_commits(a=(20, 1, ["a", "b"]), b=(20, 1, ["a", "b"])), lineage_wait_s=30.0)
    new, _ = decide(rec, _members("a", "b", "c"), find, 5.0, inputs=inputs) or (None, "")
    assert new is not None and new.state == "running" and "b" in seen[0]  # its RAM is read, not its slots
    g = Gang.from_dict(new.gang)
    assert g.nodes == ["a", "c"] and g.restore_step == 20 and not g.given_up


def test_commit_records_reject_bad_input() -> None:
    good = CommitRecord("a", 20, 2, ("a", "b"), 5.0)
    assert CommitRecord.from_json("a", good.to_json()) == good
    for raw in (b"{", b"[]", b'{"step": -1, "attempt": 1}', b'{"step": "5", "attempt": 1}',
                b'{"step": 5, "attempt": true}', b'{"step": 5, "attempt": 1, "parts": [3]}'):
        assert CommitRecord.from_json("a", raw) is None


def test_a_node_records_only_what_it_committed_in_this_attempt(tmp_path: Any, peers: Peers) -> None:
    written: list[tuple[str, CommitRecord]] = []

    class Sink(Commits):
        def write(self, job: str, rec: CommitRecord) -> None:
            written.append((job, rec))

    gang, _ = _leader(tmp_path, peers, Table(_running()), _members("a"), [50.0], commits=Sink())
    _own_part(tmp_path, 30, ["a", "b", "c"])  # from an attempt before this one started here
    gang._launched_at["j"] = 2e9
    gang._record_commit("j", 4)
    assert written == []
    gang._launched_at["j"] = 0.0
    gang._record_commit("j", 4)
    gang._record_commit("j", 4)  # unchanged: not written again
    assert [(j, r.node, r.step, r.attempt, r.parts) for j, r in written] == [("j", "a", 30, 4, ("a", "b", "c"))]


# -- 4. a node whose ranks could not start sits the next attempt out -------------------------------------


def test_node_whose_ranks_could_not_start_is_left_out_when_others_hold_the_job() -> None:
    req = {"b": {"attempt": 1, "cause": "b could not start its ranks: boom", "bad_step": None, "start_failed": True}}
    rec = _running(nodes=("a", "b"), requests=req)
    new, what = decide(rec, _members("a", "b", "c"), _finder(-1), 5.0) or (None, "")
    assert new is not None and Gang.from_dict(new.gang).nodes == ["a", "c"] and "b left out" in what
    # nobody else has room: b is tried again rather than shrinking the job
    again, _ = decide(rec, _members("a", "b"), _finder(-1), 5.0) or (None, "")
    assert again is not None and Gang.from_dict(again.gang).nodes == ["a", "b"]


# -- config ------------------------------------------------------------------------------------------


def test_config_keys_are_validated_with_the_key_named() -> None:
    cfg = ClusterConfig(lease_ttl_s=10)
    assert cfg.decision_timeout == 2.0 and cfg.fence_grace_s == 2.0 and cfg.lineage_wait == 30.0
    assert ClusterConfig(lease_ttl_s=2, etcd_timeout_s=0.5).decision_timeout == 1.0
    with pytest.raises(ValueError, match="cluster.decision_timeout_s"):
        ClusterConfig(lease_ttl_s=4, decision_timeout_s=4.0)
    with pytest.raises(ValueError, match="cluster.fence_grace_s"):
        ClusterConfig(fence_grace_s=-1.0)
    with pytest.raises(ValueError, match="cluster.lineage_wait_s"):
        ClusterConfig(lineage_wait_s="soon")  # type: ignore[arg-type]


# -- real sockets and a real etcd ----------------------------------------------------------------------


def test_a_member_that_accepts_but_never_answers_costs_one_deadline(tmp_path: Any) -> None:
    """A real API client against a loopback socket that takes the connection and never replies
    (a stopped agent's kernel still completes the handshake): the survey returns at its deadline."""
    import socket
    import time

    from trainguard.agent.cluster.peertier import token_client_factory

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # never accepted: the handshake completes, no byte ever comes back
    port = silent.getsockname()[1]
    try:
        members = {"a": NodeInfo("a", "127.0.0.1:1", 1, 0.0), "s": NodeInfo("s", f"127.0.0.1:{port}", 1, 0.0)}
        rec = JobRecordDoc("j", _spec(), "", state="pending", cause="submitted", gang=Gang().to_dict())
        table = Table(rec)
        store = BlobStore(tmp_path / "held", own_node="a", own_root=tmp_path / "shm")
        slow = token_client_factory("t", 30.0)  # the transfer client: 30 s per call
        gang = GangCoordinator("a", table, store, slow, scratch=str(tmp_path / "asm"),  # type: ignore[arg-type]
                               emit=lambda k, m, f: None, is_leader=lambda: True, members=lambda: members,
                               wake=lambda: None, quick_client_for=token_client_factory("t", TIMEOUT),
                               decision_timeout_s=TIMEOUT)
        t0 = time.monotonic()
        gang.sync(table.read())
        took = time.monotonic() - t0
        assert table.rec.state == "running" and Gang.from_dict(table.rec.gang).nodes == ["a"]  # s left out
        assert "s" in gang._unreachable_said["j"]
        print(f"\nFIGURE decision with a member that never answers (real socket): {took:.3f} s, "
              f"survey {gang.last_survey_s:.3f} s, deadline {TIMEOUT} s")
    finally:
        silent.close()


def test_commit_records_in_etcd_round_trip_and_a_bad_one_is_a_counted_drop(tmp_path: Any) -> None:
    from trainguard.agent.cluster.etcd import EtcdClient
    from trainguard.agent.cluster.etcdserver import LocalEtcd
    from trainguard.agent.cluster.lineage import CommitTable

    with LocalEtcd(tmp_path / "etcd", size=1) as etcd:
        client = EtcdClient(etcd.endpoints, timeout_s=2.0, plaintext=True)
        table = CommitTable(client, "/trainguard/t/")
        table.write("j", CommitRecord("a", 20, 2, ("a", "b"), 5.0))
        table.write("j", CommitRecord("b", 18, 2, ("a", "b"), 6.0))
        table.write("other", CommitRecord("a", 99, 1, (), 1.0))
        client.put("/trainguard/t/commits/j/c", b'{"step": "lots"}')
        got = table.read("j")
        assert sorted(got) == ["a", "b"] and got["a"].step == 20 and got["b"].parts == ("a", "b")
        assert table.drops.dropped == 1
        table.clear("j")
        assert table.read("j") == {} and table.read("other")["a"].step == 99


def test_single_owner_job_of_a_lost_node_moves_only_after_the_grace(tmp_path: Any) -> None:
    from types import SimpleNamespace

    from trainguard.agent.cluster.service import ClusterService

    clock = [10.0]
    events: list[str] = []
    svc = ClusterService(ClusterConfig(fence_grace_s=2.0), node="b", memory_root=str(tmp_path / "shm"),
                         emit=lambda k, m, f: events.append(k), clock=lambda: clock[0])
    rec = JobRecordDoc("solo", {"job": "solo", "nproc": 1}, "a", peer="b", state="running")
    table = Table(rec)
    svc.jobs = table  # type: ignore[assignment]
    svc.membership = SimpleNamespace(members=lambda: _members("b"), claim=lambda: None)  # type: ignore[assignment]
    svc._heal(table.read())
    clock[0] = 11.9
    svc._heal(table.read())
    assert table.writes == [] and events == []
    clock[0] = 12.0
    svc._heal(table.read())
    assert table.rec.node == "b" and table.rec.epoch == 1 and events == ["job_moved"]
