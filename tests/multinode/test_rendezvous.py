"""The rendezvous protocol on one machine's loopback, with a real TCPStore: rounds close with the
nodes that came, keep the nodes' order across rounds, end for everyone when one node ends them,
and a node coming to a running round with room ends it; the agent side refuses malformed blocks."""

from __future__ import annotations

import datetime
import io
import json
import socket
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch.distributed as dist

from trainguard.agent.lifecycle.jobs import JobSpec
from trainguard.agent.lifecycle.launcher import free_port
from trainguard.agent.lifecycle.rdzvjobs import block_from
from trainguard.launch.multinode import Driver
from trainguard.launch.noderanks import ChildRanks
from trainguard.launch.rendezvous import RdzvConfig, Rendezvous, Round
from trainguard.launch.resumepoint import Agreed, Holdings


def nodes(n: int, *, low: int, high: int, nproc: tuple[int, ...] = (), **conf: float) -> list[Rendezvous]:
    port = free_port()
    out = []
    for i in range(n):
        cfg = RdzvConfig("127.0.0.1", port, "t1", low, high, nproc[i] if nproc else 2, poll_s=0.02, **conf)
        out.append(Rendezvous(cfg))
    return out


def join_all(rdzvs: list[Rendezvous]) -> list[Round]:
    with ThreadPoolExecutor(len(rdzvs)) as pool:
        return list(pool.map(lambda r: r.join(), rdzvs))


def test_a_round_gives_each_node_its_ranks_and_the_order_holds_across_rounds() -> None:
    rdzvs = nodes(3, low=3, high=3, nproc=(2, 1, 3))
    assert rdzvs[0].serving and not rdzvs[1].serving
    first = join_all(rdzvs)
    assert {r.world_size for r in first} == {6} and sorted(r.group_rank for r in first) == [0, 1, 2]
    by_group = sorted(first, key=lambda r: r.group_rank)
    sizes = [(2, 1, 3)[first.index(r)] for r in by_group]
    assert [r.rank_offset for r in by_group] == [0, sizes[0], sizes[0] + sizes[1]]
    assert len({(r.master_addr, r.master_port) for r in first}) == 1
    verdict = rdzvs[2].end(first[0].number, "rank 5 died", code=137)
    assert all(r.ended(first[0].number) for r in rdzvs)
    assert (verdict.failures, verdict.code, verdict.failure) == (1, 137, True)
    assert rdzvs[0].verdict(first[0].number) == verdict  # the first cause wins for every node
    second = join_all(list(reversed(rdzvs)))[::-1]
    assert [(r.group_rank, r.rank_offset) for r in second] == [(r.group_rank, r.rank_offset) for r in first]
    assert {r.number for r in second} == {1} and {r.restart_count for r in second} == {1}


def test_min_nodes_close_after_the_last_call_and_a_latecomer_ends_the_round() -> None:
    a, b = nodes(2, low=1, high=2, last_call_s=0.3)
    alone = a.join()
    assert (alone.nodes, alone.world_size) == (1, 2)
    got: list[Round] = []
    late = threading.Thread(target=lambda: got.append(b.join()))
    late.start()
    late.join(timeout=0.1)
    assert a.verdict(alone.number).failure is False  # b asked for a new round: not a failure
    both = a.join()
    late.join(timeout=10)
    assert both.nodes == 2 and got[0].nodes == 2 and both.restart_count == 0


def test_the_crash_loop_count_restarts_where_a_round_made_progress() -> None:
    (node,) = nodes(1, low=1, high=1)
    streaks = []
    for progressed in (False, False, True, False, None):
        rnd = node.join()
        streaks.append(node.end(rnd.number, "rank 0 died", progressed=progressed).streak)
    assert streaks == [1, 2, 1, 2, 3]
    assert node.verdict(rnd.number).failures == 5


def agree(held: list[Holdings]) -> tuple[list[Agreed], list[int]]:
    """What each node agreed, and each node's group rank (the order the nodes joined in)."""
    rdzvs = nodes(len(held), low=len(held), high=len(held))
    rounds = join_all(rdzvs)
    with ThreadPoolExecutor(len(held)) as pool:
        got = list(pool.map(lambda p: p[0].agree(p[1], p[2]), zip(rdzvs, rounds, held, strict=True)))
    return got, [r.group_rank for r in rounds]


def test_agreed_step_is_the_newest_snapshot_every_node_holds() -> None:
    got, _ = agree([Holdings((5, 6, 7), 3), Holdings((6, 8), None)])
    assert got == [Agreed(6, None, ())] * 2


def test_without_a_newer_common_snapshot_the_nodes_agree_on_the_newest_whole_checkpoint() -> None:
    """A new world (no snapshot at its size): the newest checkpoint any node holds, and who holds it."""
    got, groups = agree([Holdings((), 100), Holdings((), None), Holdings((), 100)])
    assert got == [Agreed(None, 100, tuple(sorted((groups[0], groups[2]))))] * 3
    got, groups = agree([Holdings((40,), 100), Holdings((40,), 50)])
    assert got == [Agreed(None, 100, (groups[0],))] * 2
    assert agree([Holdings(), Holdings()])[0] == [Agreed(None, None, ())] * 2


def test_a_malformed_offer_in_the_store_offers_nothing() -> None:
    assert Holdings.parse('{"snapshots": [3, "x", -1, true], "checkpoint": "9"}') == Holdings((3,), None)
    assert Holdings.parse("not json") == Holdings()
    assert Holdings.parse('{"checkpoint": 4}') == Holdings()


@pytest.mark.parametrize("body, words", [
    ({"rank_offset": 0, "nproc": 2, "world_size": 1, "master_addr": "h", "master_port": 1, "group_rank": 0,
      "attempt": 1}, "must lie in world_size"),
    ({"rank_offset": 0, "nproc": 2, "world_size": 2, "master_addr": "h", "master_port": 1, "group_rank": 0,
      "attempt": True}, "block.attempt"),
    ({"rank_offset": 0, "nproc": 2, "world_size": 2, "master_addr": "h", "master_port": 1, "group_rank": 0,
      "attempt": 1, "snapshot_step": "7"}, "snapshot_step"),
    ({"rank_offset": 0, "nproc": 2, "world_size": 2, "master_addr": "h", "master_port": 1, "group_rank": 0,
      "attempt": 1, "env": {"A": 1}}, "block.env"),
])
def test_malformed_blocks_are_refused_with_one_line(body: dict, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        block_from(body)


def test_max_restarts_counts_failures_once_over_every_node(tmp_path: Path) -> None:
    """Both nodes' ranks fail in every round: each round is one failure, not one per node, and
    past --max-restarts every node stops with the ranks' exit status."""
    marks = tmp_path / "marks"
    marks.mkdir()
    command = [sys.executable, "-c", f"import os; open(os.path.join({str(marks)!r}, "
               "os.environ['RANK'] + '-' + os.environ['TORCHELASTIC_RESTART_COUNT']), 'w'); raise SystemExit(3)"]
    rdzvs = nodes(2, low=2, high=2)
    errs = [io.StringIO(), io.StringIO()]
    drivers = [Driver(r, ChildRanks(command, JobSpec("t1", 2, command=command, max_restarts=1), {}, out=io.StringIO()),
                      nproc=2, run_id="t1", max_restarts=1, err=e) for r, e in zip(rdzvs, errs, strict=True)]
    with ThreadPoolExecutor(2) as pool:
        codes = list(pool.map(lambda d: d.run(), drivers))
    assert codes == [3, 3], [e.getvalue() for e in errs]
    # A node's ranks may be torn down before they ran once the other node ended the round, so not
    # every rank marks every round; no rank ever ran a third round, and the second ran.
    counts = {p.name.split("-")[1] for p in marks.iterdir()}
    assert counts == {"0", "1"}, sorted(p.name for p in marks.iterdir())
    assert all("no restarts left (--max-restarts 1" in e.getvalue() for e in errs)


def test_a_watcher_wakes_when_another_node_ends_the_round_and_a_released_one_does_not() -> None:
    rdzvs = nodes(2, low=2, high=2)
    first = join_all(rdzvs)
    woke = [threading.Event(), threading.Event()]
    releases = [r.watch(rnd, e.set) for r, rnd, e in zip(rdzvs, first, woke, strict=True)]
    assert not any(e.is_set() for e in woke)
    rdzvs[1].end(first[1].number, "rank 3 died")
    assert woke[0].wait(10) and woke[1].wait(10)  # the ender's own watcher wakes too
    for release in releases:
        release()
    # A round left another way (its ranks finished): releasing the watcher wakes no one.
    second = join_all(rdzvs)
    quiet = threading.Event()
    release = rdzvs[0].watch(second[0], quiet.set)
    release()
    assert not quiet.is_set()
    rdzvs[0].end(second[0].number, "rank 0 died")  # after the release: its wake key says it left
    assert not quiet.wait(0.2)


def test_each_restart_writes_its_phases_in_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    phases = tmp_path / "phases.jsonl"
    monkeypatch.setenv("TRAINGUARD_RDZV_PHASES", str(phases))
    command = [sys.executable, "-c", "raise SystemExit(3)"]
    rdzvs = nodes(2, low=2, high=2)
    drivers = [Driver(r, ChildRanks(command, JobSpec("t1", 2, command=command, max_restarts=1), {}, out=io.StringIO()),
                      nproc=2, run_id="t1", max_restarts=1, err=io.StringIO()) for r in rdzvs]
    with ThreadPoolExecutor(2) as pool:
        assert list(pool.map(lambda d: d.run(), drivers)) == [3, 3]
    lines = [json.loads(line) for line in phases.read_text().splitlines()]
    # One restart (round 0 -> 1) per node; the second failure ends the run and starts nothing.
    assert sorted(p["node"] for p in lines) == [socket.gethostname()] * 2 and {p["round"] for p in lines} == {0}
    for p in lines:
        marks = [p[k] for k in ("seen", "ended", "stopped", "joined", "agreed", "started")]
        assert all(m > 0 for m in marks) and marks == sorted(marks), p
        assert "exited with 3" in p["cause"]


def test_the_first_node_serves_each_rounds_ranks_a_fresh_store() -> None:
    rdzvs = nodes(2, low=2, high=2)
    first = join_all(rdzvs)
    server = next(r for r, rnd in zip(rdzvs, first, strict=True) if rnd.group_rank == 0)
    assert server.rank_store is not None and server.rank_store.port == first[0].master_port
    assert [r.rank_store for r in rdzvs if r is not server] == [None]
    # A rank that starts before any other finds the store up: a client connects at once.
    client = dist.TCPStore(first[0].master_addr, first[0].master_port, is_master=False,
                           timeout=datetime.timedelta(seconds=5))
    client.set("rank2", "here")
    assert bytes(server.rank_store.store.get("rank2")) == b"here"
    old = first[0].master_port
    rdzvs[0].end(first[0].number, "rank 1 died")
    second = join_all(rdzvs)
    assert second[0].master_port != old and server.rank_store is not None
    assert server.rank_store.port == second[0].master_port
    with pytest.raises(RuntimeError):  # the round before's store went with its ranks
        dist.TCPStore(first[0].master_addr, old, is_master=False, timeout=datetime.timedelta(seconds=1))
