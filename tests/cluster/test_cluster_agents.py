"""Real agent processes (`trainguard agent` with a [cluster] section) on loopback with a real etcd: registration and one
leader, the token-protected API between agents, and node loss: one agent is SIGKILLed with its
ranks, the leader moves the job, the survivor restores it from the peer tier in its own RAM."""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from trainguard.agent.api.client import ApiClient, ApiClientError
from trainguard.agent.cluster.blobstore import CKPT_NS
from trainguard.agent.cluster.demo import ClusterNode, wait_for
from trainguard.agent.cluster.etcd import EtcdClient
from trainguard.agent.cluster.etcdserver import LocalEtcd

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Callable[..., ClusterNode]]:
    etcd = LocalEtcd(tmp_path / "etcd", size=1).start()
    token = secrets.token_hex(16)
    nodes: list[ClusterNode] = []

    def make(name: str, slots: int = 2, **kw: Any) -> ClusterNode:
        node = ClusterNode(tmp_path / name, name, etcd.endpoints, token, cluster=f"t{os.getpid()}", slots=slots, **kw)
        nodes.append(node)
        return node

    make.etcd = etcd  # type: ignore[attr-defined]
    make.token = token  # type: ignore[attr-defined]
    try:
        yield make
    finally:
        for n in nodes:
            n.stop()
        etcd.stop()


def test_agents_register_elect_one_leader_and_refuse_wrong_tokens(cluster: Callable[..., ClusterNode]) -> None:
    a, b = cluster("a", ttl=4), cluster("b", ttl=4)
    etcd = EtcdClient(cluster.etcd.endpoints, plaintext=True)  # type: ignore[attr-defined]
    prefix = f"/trainguard/t{os.getpid()}/"
    kvs = wait_for(lambda: (k := etcd.get_prefix(prefix + "nodes/")[0]) and len(k) == 2 and k, 20, "two nodes")
    apis = {kv.key.rsplit("/", 1)[1]: kv for kv in kvs}
    assert set(apis) == {"a", "b"} and b'"api": "127.0.0.1:' in apis["a"].value
    leader = etcd.get(prefix + "leader")
    assert leader is not None and leader.value.decode() in ("a", "b")
    for node in (a, b):
        elected = wait_for(lambda n=node: n.events("leader_elected"), 10, "leader_elected event")
        assert elected[-1]["fields"]["leader"] == leader.value.decode()
    assert wait_for(lambda: a.events("node_joined") or b.events("node_joined"), 10, "node_joined")
    wait_for(lambda: a.metric("trainguard_cluster_members") == 2 == b.metric("trainguard_cluster_members"), 10,
             "both agents count two members")
    assert a.metric("trainguard_cluster_etcd_up") == 1 == b.metric("trainguard_cluster_etcd_up")
    assert (a.metric("trainguard_cluster_is_leader") or 0) + (b.metric("trainguard_cluster_is_leader") or 0) == 1

    host, port = b.api.rsplit(":", 1)
    wrong = ApiClient.remote(host, int(port), token="x" * 32)
    with pytest.raises(ApiClientError) as err:
        wrong.put_blob(CKPT_NS, "a/job/step_1/f", b"data")
    assert err.value.status in (401, 403)
    with pytest.raises(ApiClientError) as err2:
        wrong.get_blob(CKPT_NS, "_origins")
    assert err2.value.status in (401, 403)
    assert b.events("api_auth_failed")
    # the right token works (empty store)
    assert b.client.get_blob(CKPT_NS, "_origins") == b"{}"

    # etcd frozen for half the TTL: both agents ride it out, nobody is declared lost
    member = cluster.etcd.members[0]  # type: ignore[attr-defined]
    member.pause()
    try:
        time.sleep(2.0)
    finally:
        member.resume()
    wait_for(lambda: a.events("etcd_reachable") and b.events("etcd_reachable"), 10, "etcd reachable again")
    time.sleep(4.5)  # past the TTL: a lease that had not been refreshed would be gone now
    assert len(etcd.get_prefix(prefix + "nodes/")[0]) == 2
    for node in (a, b):
        assert node.events("node_lost") == [] and node.events("cluster_lease_renewed") == []
        assert node.proc.poll() is None
    assert etcd.get(prefix + "leader").value == leader.value  # type: ignore[union-attr]
    # the stall was felt (refreshes failed and were retried), and cost nothing
    assert (a.metric("trainguard_cluster_lease_refresh_failures_total") or 0) + \
        (b.metric("trainguard_cluster_lease_refresh_failures_total") or 0) > 0


@pytest.mark.slow
def test_node_loss_job_resumes_on_survivor_from_peer_tier(cluster: Callable[..., ClusterNode], tmp_path: Path) -> None:
    from bench.trainjobs import tiny_config
    from trainguard.trainer.checkpoint import load_full_model_state

    a = cluster("a", slots=2)
    b = cluster("b", slots=1)  # the survivor has room for one rank: dp 2 -> 1, resharded restore
    trainer = tiny_config(str(tmp_path / "corpus"), steps=2000, parallel={"dp": 2}).to_dict()
    a.client.submit_job({"job": "big", "nproc": 2, "trainer": trainer})

    # wait until b holds a's copy of a memory checkpoint
    held = b.shm / ".peer-held" / "ckpt" / "a" / "big"
    wait_for(lambda: max(b.held_steps("a", "big") or [0]) >= 8, 150, f"a peer copy on b\n{a.log()[-3000:]}")
    a.kill_with_ranks("big")  # node a is gone: agent and ranks, nothing cleaned up
    killed_at = time.monotonic()
    lost_step = max(b.held_steps("a", "big"))

    lost = wait_for(lambda: b.events("node_lost"), 15, "node_lost on b")
    assert lost[0]["fields"]["node"] == "a"
    adopted = wait_for(lambda: b.events("job_adopted"), 20, f"job adopted on b\n{b.log()[-3000:]}")
    assert adopted[0]["job"] == "big"
    moved = b.events("job_moved")
    assert moved and moved[0]["fields"]["dst"] == "b" and "dp 2 -> 1" in moved[0]["message"]
    selected = wait_for(lambda: [e for e in b.events("restore_selected") if e.get("job") == "big"], 30, "restore")
    assert selected[0]["fields"]["tier"] == "peer"
    restored_step = selected[0]["fields"]["step"]
    assert restored_step >= lost_step - 4  # nothing older than the newest peer copy at the kill (+ one in flight)
    resumed = wait_for(lambda: [e for e in b.events("job_resumed") if e.get("job") == "big"], 90,
                       f"job resumed on b\n{b.log()[-3000:]}")
    assert resumed
    took = time.monotonic() - killed_at
    job = b.client.job("big")
    assert job["nproc"] == 1 and job["state"] in ("running", "starting")

    # the parameters b restored are exactly a's memory checkpoint at that step
    a_copy = a.shm / "big" / f"step_{restored_step}"
    b_copy = held / f"step_{restored_step}"
    pa, pb = load_full_model_state(str(a_copy)), load_full_model_state(str(b_copy))
    assert pa.keys() == pb.keys() and len(pa) > 0
    for name in pa:
        assert (pa[name] == pb[name]).all(), name
    print(f"node loss -> resumed on survivor in {took:.1f}s from peer step {restored_step}")


def test_drain_node_moves_a_job_off_a_live_node_and_the_old_copy_stops(cluster: Callable[..., ClusterNode],
                                                                      tmp_path: Path) -> None:
    """An operator drains node b (through a's API): the leader moves b's job to a while b is alive,
    b stops its copy (fenced), a restores it from the peer copy in its own RAM and trains on."""
    from bench.trainjobs import tiny_config

    a = cluster("a", slots=2)
    wait_for(lambda: a.metric("trainguard_cluster_is_leader") == 1, 20, "a leads")
    b = cluster("b", slots=2)
    trainer = tiny_config(str(tmp_path / "corpus"), steps=3000, parallel={"dp": 2}).to_dict()
    b.client.submit_job({"job": "work", "nproc": 2, "trainer": trainer})
    wait_for(lambda: max(a.held_steps("b", "work") or [0]) >= 8, 150, f"a peer copy on a\n{b.log()[-3000:]}")
    with pytest.raises(ApiClientError) as refused:
        a.client.drain("work", node="a")  # the job does not run there
    assert refused.value.status == 409 and "does not run on node a" in str(refused.value)

    reply = a.client.drain("work", node="b")
    assert reply["state"] == "recorded" and reply["moves_to"] == ["a"], reply
    moved = wait_for(lambda: [e for e in a.events("job_moved") if e.get("job") == "work"], 30,
                     f"the leader moves the job\n{a.log()[-2000:]}")
    assert moved[0]["fields"]["src"] == "b" and moved[0]["fields"]["dst"] == "a"
    assert "drained node b" in moved[0]["message"]
    wait_for(lambda: [e for e in b.events("job_fenced") if e.get("job") == "work"], 30, "b stops its copy")
    wait_for(lambda: b.client.job("work")["state"] in ("stopped", "failed", "succeeded"), 30, "b's ranks gone")
    selected = wait_for(lambda: [e for e in a.events("restore_selected") if e.get("job") == "work"], 60, "restore on a")
    assert selected[0]["fields"]["tier"] in ("peer", "memory", "disk")
    wait_for(lambda: [e for e in a.events("job_resumed") if e.get("job") == "work"], 90, f"job resumed on a\n{a.log()[-3000:]}")
    assert a.client.job("work")["state"] in ("running", "starting")
    # b stays a member (it was drained, not lost) and the job is not placed back on it.
    assert not b.events("node_lost") and not a.events("node_lost")
    time.sleep(3)
    assert b.client.job("work")["state"] != "running"


def test_node_loss_shrinks_dp_4_to_3_and_keeps_the_global_batch(cluster: Callable[..., ClusterNode],
                                                               tmp_path: Path) -> None:
    """dp 4 -> 3 by node loss: the survivor has room for 3 ranks; the job restarts there with dp 3
    and the global batch 8 kept exactly (3 + 3 + 2), from the peer copy of the lost node's checkpoint."""
    from bench.trainjobs import tiny_config

    a = cluster("a", slots=4)
    b = cluster("b", slots=3)
    trainer = tiny_config(str(tmp_path / "corpus"), steps=3000, parallel={"dp": 4}).to_dict()
    assert trainer["global_batch"] == 8
    a.client.submit_job({"job": "big", "nproc": 4, "trainer": trainer})
    wait_for(lambda: max(b.held_steps("a", "big") or [0]) >= 8, 180, f"a peer copy on b\n{a.log()[-3000:]}")
    a.kill_with_ranks("big")
    moved = wait_for(lambda: [e for e in b.events("job_moved") if e.get("job") == "big"], 30, "the leader moves it")
    assert "dp 4 -> 3" in moved[0]["message"]

    def shrunk_sizes() -> list[int] | None:
        job = {j["job"]: j for j in b.client.status()["jobs"]}.get("big") or {}
        tel = [r.get("telemetry") or {} for r in job.get("ranks", [])]
        sizes = sorted(t["batch_size"] for t in tel if t.get("world_size") == 3)
        return sizes if len(sizes) == 3 else None

    sizes = wait_for(shrunk_sizes, 120, f"dp 3 reporting on b\n{b.log()[-3000:]}")
    assert sizes == [2, 3, 3]  # the global batch of 8 kept exactly
    selected = [e for e in b.events("restore_selected") if e.get("job") == "big"]
    assert selected and selected[0]["fields"]["tier"] == "peer"
    assert b.client.job("big")["nproc"] == 3
