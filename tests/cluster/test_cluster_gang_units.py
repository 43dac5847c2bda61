"""The leader's decisions for jobs spanning nodes (agent.cluster.gang), as pure functions."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from tests.helpers.telemetry import make_msg
from trainguard.agent.cluster.gang import Gang, decide, part_key, place_gang
from trainguard.agent.cluster.jobs import JobRecordDoc
from trainguard.agent.cluster.membership import NodeInfo
from trainguard.agent.cluster.placement import PlacementError


def _spec(dp: int = 2, tp: int = 1, pp: int = 1, nodes: int = 2, max_restarts: int = 3) -> dict[str, Any]:
    return {"job": "j", "nproc": dp * tp * pp, "nodes": nodes, "max_restarts": max_restarts,
            "trainer": {"parallel": {"dp": dp, "tp": tp, "pp": pp}}}


def _members(**slots: int) -> dict[str, NodeInfo]:
    return {n: NodeInfo(n, f"10.0.0.{i + 1}:7000", s, 0.0) for i, (n, s) in enumerate(sorted(slots.items()))}


class Finder:
    def __init__(self, step: int = -1, sources: dict[str, list[str]] | None = None) -> None:
        self.step, self.sources = step, sources or {}
        self.calls: list[int | None] = []

    def __call__(self, rec: JobRecordDoc, g: Gang, apis: dict[str, str], max_step: int | None) -> tuple[int, dict[str, list[str]]]:
        self.calls.append(max_step)
        return self.step, self.sources


def _decided(rec: JobRecordDoc, members: dict[str, NodeInfo], finder: Finder, now: float) -> tuple[JobRecordDoc, str]:
    out = decide(rec, members, finder, now)
    assert out is not None, "expected a decision"
    return out


def _running(attempt: int = 1, blocks: list[list[Any]] | None = None, **gang: Any) -> JobRecordDoc:
    g = Gang(attempt=attempt, blocks=blocks or [["a", 0, 1], ["b", 1, 1]], dp=2, master_addr="10.0.0.1",
             master_port=5000, nodes_seen=["a", "b"], **gang)
    return JobRecordDoc("j", _spec(), "a", state="running", gang=g.to_dict())


def test_place_spreads_over_the_requested_nodes_and_keeps_tp_groups_whole() -> None:
    spec, placement, note = place_gang(_spec(dp=2), {"a": 2, "b": 2})
    assert [(b.node, b.rank_offset, b.nproc) for b in placement.blocks] == [("a", 0, 1), ("b", 1, 1)] and not note
    spec, placement, _ = place_gang(_spec(dp=2, tp=2), {"a": 3, "b": 2})
    assert [(b.node, b.nproc) for b in placement.blocks] == [("a", 2), ("b", 2)] and not placement.check()
    # one node left with room for one replica: dp shrinks, tp and pp never
    spec, placement, note = place_gang(_spec(dp=2, tp=2), {"b": 2})
    assert placement.dp == 1 and placement.tp == 2 and spec["nproc"] == 2 and "dp 2 -> 1" in note
    assert spec["trainer"]["parallel"]["dp"] == 1 and spec["nodes"] == 2  # kept: it grows back over 2 nodes
    with pytest.raises(PlacementError, match="tp=2"):
        place_gang(_spec(dp=2, tp=2), {"a": 1, "b": 1})


def test_pending_job_gets_its_first_attempt_with_the_master_on_block_zero() -> None:
    rec = JobRecordDoc("j", _spec(), "", state="pending", cause="submitted", gang=Gang().to_dict())
    finder = Finder()
    new, what = _decided(rec, _members(a=1, b=1), finder, 100.0)
    g = Gang.from_dict(new.gang)
    assert new.state == "running" and g.attempt == 1 and g.blocks == [["a", 0, 1], ["b", 1, 1]]
    assert g.master_addr == "10.0.0.1" and g.master_port == 0 and g.restore_step == -1
    assert finder.calls == [] and "from step 0" in what and new.node == "a"


def test_quiet_running_job_is_left_alone_and_stale_requests_are_ignored() -> None:
    assert decide(_running(), _members(a=1, b=1), Finder(), 0.0) is None
    stale = _running(attempt=3, requests={"b": {"attempt": 2, "cause": "old", "bad_step": None}})
    assert decide(stale, _members(a=1, b=1), Finder(), 0.0) is None


def test_restart_request_restarts_every_node_from_the_chosen_step() -> None:
    rec = _running(requests={"b": {"attempt": 1, "cause": "rank 1 died", "bad_step": None, "at": 3.0}})
    finder = Finder(8, {"a": ["a", "b"], "b": ["b"]})
    new, _ = _decided(rec, _members(a=1, b=1), finder, 5.0)
    g = Gang.from_dict(new.gang)
    assert g.attempt == 2 and g.restore_step == 8 and g.sources == {"a": ["a", "b"], "b": ["b"]}
    assert g.requests == {} and g.master_port == 0 and "rank 1 died" in new.cause and finder.calls == [None]
    assert g.failed_at == 3.0  # the recovery clock starts at the failure, not at the leader's decision
    # a part that could not be assembled: the next choice must be older than that step
    bad = _running(attempt=2, requests={"a": {"attempt": 2, "cause": "restore failed", "bad_step": 8}}, restore_step=8)
    finder2 = Finder(4)
    new2, _ = _decided(bad, _members(a=1, b=1), finder2, 6.0)
    assert finder2.calls == [7] and Gang.from_dict(new2.gang).restore_step == 4


def test_lost_node_shrinks_the_job_onto_the_survivors() -> None:
    new, what = _decided(_running(), _members(b=1), Finder(12, {"a": ["b"], "b": ["b"]}), 9.0)
    g = Gang.from_dict(new.gang)
    assert g.blocks == [["b", 0, 1]] and g.dp == 1 and new.spec["nproc"] == 1 and "node a lost" in new.cause
    assert g.restore_step == 12 and "dp 2 -> 1" in what and g.nodes_seen == ["a", "b"] and g.failed_at == 9.0


def test_finished_everywhere_and_crash_loop() -> None:
    done = _running(done={"a": "succeeded", "b": "succeeded"})
    new, what = _decided(done, _members(a=1, b=1), Finder(), 0.0)
    assert new.state == "finished" and what == "finished"
    half = _running(done={"a": "succeeded"})
    assert decide(half, _members(a=1, b=1), Finder(), 0.0) is None
    # the same restore step again and again: no progress, give up after max_restarts
    looping = _running(attempt=5, restore_step=8, stalls=3, requests={"a": {"attempt": 5, "cause": "x", "bad_step": None}})
    new, _ = _decided(looping, _members(a=1, b=1), Finder(8), 0.0)
    assert new.state == "failed" and "crash loop" in new.cause
    progressing = _running(attempt=5, restore_step=8, stalls=3, requests={"a": {"attempt": 5, "cause": "x", "bad_step": None}})
    new, _ = _decided(progressing, _members(a=1, b=1), Finder(12), 0.0)
    assert new.state == "running" and Gang.from_dict(new.gang).stalls == 0


def test_no_room_waits_pending_without_rewriting_the_same_reason() -> None:
    rec = JobRecordDoc("j", _spec(dp=2, tp=2), "", state="pending", cause="submitted", gang=Gang().to_dict())
    new, what = _decided(rec, _members(a=1), Finder(), 0.0)
    assert new.state == "pending" and new.cause.startswith("waiting:") and "cannot place" in what
    assert decide(new, _members(a=1), Finder(), 1.0) is None


def test_part_key_and_record_round_trip() -> None:
    assert part_key("job-1", "node-a") == "job-1.part-node-a"
    rec = _running()
    back = JobRecordDoc.from_json(rec.to_json())
    assert back == rec and Gang.from_dict(back.gang).block_of("b") == (1, 1, 1)


def test_leader_takes_rank_zero_and_a_shrunk_job_grows_back_when_nodes_return() -> None:
    rec = JobRecordDoc("j", _spec(), "", state="pending", cause="submitted", gang=Gang().to_dict())
    new, _ = _decided_as(rec, _members(a=1, b=1), "b")
    g = Gang.from_dict(new.gang)
    assert g.blocks == [["b", 0, 1], ["a", 1, 1]] and g.master_addr == "10.0.0.2" and g.want_dp == 2
    # shrunk to dp 1 on b by a node loss; a is back; the next restart point grows it again
    shrunk = JobRecordDoc("j", _spec(dp=1), "b", state="running", gang=Gang(
        attempt=3, blocks=[["b", 0, 1]], dp=1, master_addr="10.0.0.2", master_port=5000, nodes_seen=["a", "b"],
        want_dp=2, requests={"b": {"attempt": 3, "cause": "rank 0 died", "bad_step": None}}).to_dict())
    grown, what = _decided_as(shrunk, _members(a=1, b=1), "b")
    g = Gang.from_dict(grown.gang)
    assert g.dp == 2 and grown.spec["nproc"] == 2 and g.blocks == [["b", 0, 1], ["a", 1, 1]]
    assert "dp 1 -> 2 as nodes rejoined" in what
    stays = decide(shrunk, _members(a=1, b=1), Finder(), 0.0, leader="b", rejoin=False)
    assert stays is not None and Gang.from_dict(stays[0].gang).dp == 1


def _decided_as(rec: JobRecordDoc, members: dict[str, NodeInfo], leader: str) -> tuple[JobRecordDoc, str]:
    out = decide(rec, members, Finder(), 0.0, leader=leader)
    assert out is not None
    return out


def test_forwarded_telemetry_keeps_valid_messages_of_the_job_and_counts_the_rest() -> None:
    from trainguard.agent.cluster.gang import decode_forwarded

    def msg(job: str, rank: int) -> str:
        return make_msg(job, rank, step=5).encode().decode()

    good, dropped = decode_forwarded("j", [msg("j", 2), msg("other", 3), "{not json", 42, msg("j", 3)])
    assert [m.rank for m in good] == [2, 3] and dropped == 3


def test_a_drained_node_is_left_by_the_next_attempt_and_never_used_again() -> None:
    rec = replace(_running(), drained=["b"])
    new, _ = _decided(rec, _members(a=2, b=2), Finder(12, {"a": ["a"], "b": ["b"]}), 5.0)
    g = Gang.from_dict(new.gang)
    # Both ranks packed on a (room for 2): dp kept, and the drained node stays out.
    assert g.nodes == ["a"] and g.dp == 2 and "node b drained" in new.cause and g.restore_step == 12
    assert new.drained == ["b"]
    # Once running on a, no further attempt: b is alive but not a member for this job.
    assert decide(new, _members(a=2, b=2), Finder(), 6.0) is None
    # The job is placed elsewhere, never on b, at later restarts too.
    restarted = replace(new, gang={**new.gang, "requests": {"a": {"attempt": g.attempt, "cause": "rank died"}}})
    again, _ = _decided(restarted, _members(a=2, b=2), Finder(), 7.0)
    assert Gang.from_dict(again.gang).nodes == ["a"]
