"""No silent rollback with real agents (`trainguard agent`) and a real etcd on loopback: a job spans
nodes a and b, b keeps its checkpoint part only in its own RAM (no peer copy), b is SIGKILLed with
its ranks. The leader does not place the job on b again while b's lease lives (its API is dead),
waits for b because b recorded a newer committed step than a can restore, says so
(``lineage_waiting``), and after ``cluster.lineage_wait_s`` (3 x TTL) goes on from what it has
with ``lineage_steps_given_up`` naming the steps and nodes; when b comes back within the wait,
the job restarts on both nodes from b's newer step instead."""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from trainguard.agent.cluster.demo import ClusterNode, wait_for
from trainguard.agent.cluster.etcd import EtcdClient
from trainguard.agent.cluster.etcdserver import LocalEtcd
from trainguard.agent.cluster.gang import Gang
from trainguard.agent.cluster.jobs import JobRecordDoc
from trainguard.agent.cluster.lineage import CommitTable

pytestmark = pytest.mark.slow


Cluster = tuple[LocalEtcd, list[ClusterNode], str, Callable[..., ClusterNode]]


@pytest.fixture
def cluster(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Cluster]:
    """etcd, agents a and b (a leads), the cluster's name, and a way to start a node again."""
    extra = getattr(request, "param", "")
    etcd = LocalEtcd(tmp_path / "etcd", size=1).start()
    name = f"l{os.getpid()}"
    token = secrets.token_hex(16)
    nodes: list[ClusterNode] = []

    def start(node: str, root: Path, shm: Path | None = None) -> ClusterNode:
        # b's part is never copied to a: after b is lost, only b's own RAM holds it
        nodes.append(ClusterNode(root, node, etcd.endpoints, token, cluster=name, slots=1, ttl=3,
                                 peer_interval=100_000, shm=shm, cluster_extra=extra))
        return nodes[-1]

    try:
        start("a", tmp_path / "a")
        wait_for(lambda: nodes[0].metric("trainguard_cluster_is_leader") == 1, 20, "a leads")
        start("b", tmp_path / "b")
        yield etcd, nodes, name, start
    finally:
        for n in reversed(nodes):  # a node started again shares its memory root with the first one
            n.stop()
        etcd.stop()


def _run_until_committed(a: ClusterNode, b: ClusterNode, commits: CommitTable, tmp_path: Path) -> None:
    from bench.trainjobs import tiny_config

    trainer = tiny_config(str(tmp_path / "corpus"), steps=5000, parallel={"dp": 2}).to_dict()
    a.client._json("POST", "/v1/jobs", {"job": "big", "nproc": 2, "nodes": 2, "trainer": trainer})
    for node in (a, b):
        wait_for(lambda n=node: _events(n, "gang_ranks_started"), 60, f"{node.name} starts its block\n{node.log()[-2000:]}")
    # both nodes record what they commit; wait until b has committed past a few checkpoints
    recs = wait_for(lambda: (r := commits.read("big")) and min((c.step for c in r.values()), default=0) >= 12
                    and len(r) == 2 and r, 120, f"commit records of a and b\n{b.log()[-2000:]}")
    assert all(r.attempt == 1 and set(r.parts) == {"a", "b"} for r in recs.values())


def _events(node: ClusterNode, kind: str) -> list[dict[str, Any]]:
    return [e for e in node.events(kind) if e.get("job") == "big"]


def _record(client: EtcdClient, name: str) -> JobRecordDoc | None:
    kv = client.get(f"/trainguard/{name}/jobs/big")
    return JobRecordDoc.from_json(kv.value) if kv is not None else None


def test_leader_waits_for_the_lost_node_with_newer_steps_then_says_what_it_gave_up(
        cluster: Cluster, tmp_path: Path) -> None:
    etcd, (a, b), name, _start = cluster
    client = EtcdClient(etcd.endpoints, timeout_s=2.0, plaintext=True)
    commits = CommitTable(client, f"/trainguard/{name}/")
    _run_until_committed(a, b, commits, tmp_path)

    b.kill_with_ranks("big")
    waiting = wait_for(lambda: _events(a, "lineage_waiting"), 60,
                       f"the leader waits for b\n{[(e['kind'], e['message']) for e in a.all_events()][-20:]}")
    assert waiting[0]["fields"]["nodes"] == ["b"] and waiting[0]["fields"]["step"] >= 12
    newest = waiting[0]["fields"]["step"]
    rec = _record(client, name)
    assert rec is not None and rec.state == "pending" and "(unreachable)" in rec.cause and f"step {newest}" in rec.cause
    # no attempt placed b again while its lease was still alive (its API answered nothing)
    assert not [e for e in _events(a, "gang_placed") if e["fields"]["attempt"] > 1]

    given = wait_for(lambda: _events(a, "lineage_steps_given_up"), 60,
                     f"the leader gives the steps up\n{[(e['kind'], e['message']) for e in a.all_events()][-20:]}")
    fields = given[0]["fields"]
    assert fields["newest"] == newest and "b" in fields["committed"] and fields["unreachable"] == ["b"]
    assert fields["restore_step"] < newest and f"-{newest} committed on" in given[0]["message"]
    placed = [e for e in _events(a, "gang_placed") if e["fields"]["attempt"] == 2]
    assert placed and "a: ranks 0-0" in placed[0]["message"] and "b:" not in placed[0]["message"]
    rec = _record(client, name)
    assert rec is not None and rec.state == "running"
    g = Gang.from_dict(rec.gang)
    assert g.attempt == 2 and g.nodes == ["a"] and g.lineage_floor == 2 and g.given_up["newest"] == newest
    wait_for(lambda: [e for e in _events(a, "gang_ranks_started") if e["fields"]["attempt"] == 2], 60,
             f"a trains again\n{a.log()[-2000:]}")
    print(f"\nFIGURE lineage: b committed step {newest}; the leader waited {fields.get('waited_s', '?')} s "
          f"(lineage_wait_s = 3 x TTL 3 s) and went on from step {fields['restore_step']}")


@pytest.mark.parametrize("cluster", ["lineage_wait_s = 120.0\n"], indirect=True)
def test_a_node_that_comes_back_within_the_wait_gives_the_newer_step(cluster: Cluster, tmp_path: Path) -> None:
    etcd, (a, b), name, start = cluster
    client = EtcdClient(etcd.endpoints, timeout_s=2.0, plaintext=True)
    commits = CommitTable(client, f"/trainguard/{name}/")
    _run_until_committed(a, b, commits, tmp_path)

    b.kill_with_ranks("big")
    waiting = wait_for(lambda: _events(a, "lineage_waiting"), 60, "the leader waits for b")
    newest = waiting[0]["fields"]["step"]
    wait_for(lambda: [e for e in a.events("node_lost") if e["fields"].get("node") == "b"], 30, "b's lease expires")
    back = start("b", tmp_path / "b-back", shm=b.shm)  # the same host again: its RAM kept its part
    placed = wait_for(lambda: [e for e in _events(a, "gang_placed") if e["fields"]["attempt"] == 2], 90,
                      f"the job restarts with b back\n{[(e['kind'], e['message']) for e in a.all_events()][-20:]}")
    # Never behind what the wait named; b's record of a later step may land after the wait's event.
    assert placed[0]["fields"]["restore_step"] >= newest and "b: ranks 1-1" in placed[0]["message"]
    assert not _events(a, "lineage_steps_given_up")
    for node in (a, back):
        wait_for(lambda n=node: [e for e in _events(n, "gang_ranks_started") if e["fields"]["attempt"] == 2], 60,
                 f"{node.name} restarts from step {newest}\n{node.log()[-2000:]}")
    print(f"\nFIGURE lineage: b came back; the job restarted from its newer step {newest}, nothing given up")
