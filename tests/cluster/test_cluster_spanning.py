"""One gloo job spanning two real agents (`trainguard agent` with a [cluster] section) on loopback with a real etcd: the
leader places it, each agent starts its block with global ranks, a rank failure restarts both
nodes' ranks together from a checkpoint assembled out of the nodes' parts, and the loss of a
node (agent and ranks SIGKILLed) moves the job onto the survivor with dp reduced, restoring the
lost node's part from the copy the survivor holds in RAM (peer tier)."""

from __future__ import annotations

import os
import secrets
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from trainguard.agent.api.client import ApiClientError
from trainguard.agent.cluster.demo import ClusterNode, wait_for
from trainguard.agent.cluster.etcdserver import LocalEtcd

pytestmark = pytest.mark.slow


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[LocalEtcd]:
    server = LocalEtcd(tmp_path / "etcd", size=1).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(params=[1])
def two_nodes(tmp_path: Path, request: pytest.FixtureRequest, etcd: LocalEtcd) -> Iterator[tuple[ClusterNode, ClusterNode]]:
    """Agents a and b with ``request.param`` slots each (or ``(slots, lease TTL s)``)."""
    slots, ttl = request.param if isinstance(request.param, tuple) else (request.param, 3)
    token = secrets.token_hex(16)
    nodes: list[ClusterNode] = []
    try:
        for name in ("a", "b"):
            nodes.append(ClusterNode(tmp_path / name, name, etcd.endpoints, token, cluster=f"s{os.getpid()}",
                                     slots=slots, ttl=ttl))
            # a leads (it starts alone), so the leader's node, which takes global rank 0, is known
            wait_for(lambda: nodes[0].metric("trainguard_cluster_is_leader") == 1, 20, "a leads")
        yield nodes[0], nodes[1]
    finally:
        for n in nodes:
            n.stop()


def _events(node: ClusterNode, kind: str, job: str = "big") -> list[dict[str, Any]]:
    return [e for e in node.events(kind) if e.get("job") == job]


def _progress(node: ClusterNode, job: str = "big") -> int:
    """The newest step the node's ranks of ``job`` reported (-1 before it has any there)."""
    try:
        step = node.client.job(job).get("progress_step")
    except ApiClientError:
        return -1
    return step if isinstance(step, int) else -1


def _keep_parts(nodes: list[ClusterNode], step: int, dest: Path) -> Path:
    """Copy every node's memory-tier part of ``step`` now: the moment the leader chose it, before
    the restarted job's new checkpoints push it out of the memory tier (it keeps the newest 3)."""
    for n in nodes:
        src = n.shm / f"big.part-{n.name}" / f"step_{step}"
        if src.exists():
            shutil.copytree(src, dest / n.name)
    return dest


def _merge(parts: list[Path], dest: Path) -> Path:
    """The checkpoint as its writers left it: the union of the parts' files."""
    for part in parts:
        shutil.copytree(part, dest, dirs_exist_ok=True, ignore=shutil.ignore_patterns("trainguard-manifest.json"))
    return dest


def test_job_spans_two_agents_restarts_together_and_survives_node_loss(
        two_nodes: tuple[ClusterNode, ClusterNode], tmp_path: Path) -> None:
    from bench.trainjobs import tiny_config
    from trainguard.trainer.checkpoint import load_full_model_state

    a, b = two_nodes
    trainer = tiny_config(str(tmp_path / "corpus"), steps=3000, parallel={"dp": 2}).to_dict()
    reply = a.client._json("POST", "/v1/jobs", {"job": "big", "nproc": 2, "nodes": 2, "trainer": trainer,
                                                 "faults": ["kill:rank=1,step=10"]})
    assert reply["placement"].startswith("pending")

    # placement: one rank per node, tp groups trivially whole, rank 0 (the c10d store) on a
    placed = wait_for(lambda: _events(a, "gang_placed") or _events(b, "gang_placed"), 30, "placement")
    assert "a: ranks 0-0; b: ranks 1-1" in placed[0]["message"]
    for node, ranks in ((a, "ranks 0-0 of 2"), (b, "ranks 1-1 of 2")):
        started = wait_for(lambda n=node: _events(n, "gang_ranks_started"), 30, f"{node.name} starts its block")
        assert ranks in started[0]["message"]
    job_b = b.client.job("big")
    assert job_b["local_ranks"] == [1, 1] and job_b["nproc"] == 2

    # rank 1 (on b) is killed at step 10: b asks, the leader orders attempt 2 on both nodes
    requested = wait_for(lambda: _events(b, "job_restart_requested"), 60, f"b reports the dead rank\n{b.log()[-2000:]}")
    assert "rank 1 died" in requested[0]["message"]
    for node in (a, b):
        wait_for(lambda n=node: [e for e in _events(n, "gang_ranks_started") if e["fields"]["attempt"] == 2], 60,
                 f"{node.name} restarts for attempt 2\n{node.log()[-2000:]}")
    second = [e for e in _events(a, "gang_ranks_started") if e["fields"]["attempt"] == 2][0]
    assert 0 <= second["fields"]["restore_step"] <= 10  # a checkpoint from before the kill, not step 0 by default
    wait_for(lambda: _events(a, "job_resumed") and _events(b, "job_resumed"), 60, "both nodes train again")
    time.sleep(2)
    assert not [e for e in _events(a, "gang_placed") + _events(b, "gang_placed") if e["fields"]["attempt"] > 2], \
        "one failure, one restart"

    # node a is lost (agent and rank SIGKILLed); b holds a's part in RAM
    wait_for(lambda: max(b.held_steps("a", "big.part-a") or [0]) > second["fields"]["restore_step"] + 4, 120,
             "a newer peer copy of a's part on b")
    a.kill_with_ranks("big")
    killed = time.monotonic()
    lost = wait_for(lambda: b.events("node_lost"), 20, "node_lost on b")
    assert lost[0]["fields"]["node"] == "a"
    moved = wait_for(lambda: [e for e in _events(b, "gang_placed") if e["fields"]["attempt"] == 3], 30,
                     f"the leader re-places the job\n{[(e['kind'], e['message']) for e in b.all_events()][-25:]}")
    assert "b: ranks 0-0" in moved[0]["message"] and "dp 2 -> 1" in moved[0]["message"]
    kept = _keep_parts([a, b], moved[0]["fields"]["restore_step"], tmp_path / "kept")
    selected = wait_for(lambda: [e for e in _events(b, "restore_selected") if e["fields"]["tier"] == "assembled"
                                 and e["fields"]["step"] > second["fields"]["restore_step"]], 60, "assembled restore")
    step = selected[-1]["fields"]["step"]
    assert selected[-1]["fields"]["parts"] == {"a": "b", "b": "b"}  # a's part from b's held copy
    wait_for(lambda: [e for e in _events(b, "job_resumed") if e["fields"].get("restored_from", {}).get("step") == step],
             90, f"job resumed on b\n{b.log()[-3000:]}")
    took = time.monotonic() - killed
    job = b.client.job("big")
    assert job["nproc"] == 1 and job["state"] in ("running", "starting") and job["local_ranks"] == [0, 0]

    # what b restored is bit-equal to what the two nodes wrote at that step
    assert step == moved[0]["fields"]["restore_step"]
    written = _merge([kept / "a", kept / "b"], tmp_path / "written")
    assembled = b.shm / ".assembled" / "big" / f"step_{step}"
    got = load_full_model_state(str(shutil.copytree(assembled, tmp_path / "assembled")))
    want = load_full_model_state(str(written))
    assert want.keys() == got.keys() and len(want) > 0
    for name in want:
        assert (want[name] == got[name]).all(), name
    print(f"node loss -> job resumed on b in {took:.1f}s from assembled step {step}")


@pytest.mark.parametrize("two_nodes", [(2, 6)], indirect=True)  # TTL 6 s: the etcd freeze below stays well inside it
def test_rank_zero_node_judges_every_rank_from_forwarded_telemetry(
        two_nodes: tuple[ClusterNode, ClusterNode], tmp_path: Path, capsys: pytest.CaptureFixture[str],
        etcd: LocalEtcd) -> None:
    """dp=4 over two nodes, rank 3 (on b) made 3x slower: b forwards its ranks' telemetry to a (rank
    0's node), a detects the straggler and migrates its shards through the plan rank 0 reads; b
    judges nothing itself."""
    from bench.trainjobs import tiny_config

    a, b = two_nodes
    trainer = tiny_config(str(tmp_path / "corpus"), steps=3000, parallel={"dp": 4}, global_batch=16).to_dict()
    a.client.submit_job({"job": "big", "nproc": 4, "nodes": 2, "trainer": trainer,
                         "faults": ["slow:rank=3,factor=3,step=20"]})
    placed = wait_for(lambda: _events(a, "gang_placed") or _events(b, "gang_placed"), 30, "placement")
    assert "a: ranks 0-1; b: ranks 2-3" in placed[0]["message"]

    detected = wait_for(lambda: [e for e in _events(a, "straggler_detected") if (e.get("rank") if "rank" in e else e["fields"].get("rank")) == 3],
                        120, f"a detects rank 3 on b\n{a.log()[-2000:]}")
    assert detected
    status = a.client.job("big")
    assert status["local_ranks"] == [0, 1]
    assert a.metric("trainguard_cluster_telemetry_forwarded_total") in (0, None)
    assert (b.metric("trainguard_cluster_telemetry_forwarded_total") or 0) > 0
    plan = a.client.get_plan("big")
    sizes = plan.get("batch_sizes")
    assert plan["version"] >= 1 and sizes and len(sizes) == 4 and sizes[3] < max(sizes)  # shards moved off rank 3
    assert not b.events("straggler_detected")  # only rank 0's node judges
    # the plan lives with rank 0's node and is published to the job's etcd record (what a new rank-0
    # node would start from): b sees the migrated split there
    recorded = wait_for(lambda: (b.client.status()["cluster"]["spanning_jobs"]["big"]["plan"] or {}).get("batch_sizes"),
                        20, "the plan in the etcd record")
    assert len(recorded) == 4 and recorded[3] < max(recorded)

    from trainguard.cli import main as cli_main

    assert cli_main(["status", "--agent", b.api, "--token-file", str(b.token_file)]) == 0
    shown = capsys.readouterr().out
    assert "leader a" in shown and "spanning job big  running  attempt 1  dp=4 tp=1 pp=1  a: ranks 0-1; b: ranks 2-3" in shown

    # etcd frozen for up to half the lease TTL: the ranks train on, nobody is declared lost, no restart
    before = a.client.job("big")["progress_step"]
    etcd.members[0].pause()
    try:
        during = wait_for(lambda: (p := a.client.job("big")["progress_step"]) > before and p, 3.0,
                          "a step while etcd is frozen")
    finally:
        etcd.members[0].resume()
    time.sleep(2.0)
    assert during > before and not a.events("node_lost") and not b.events("node_lost")
    assert [e["fields"]["attempt"] for e in _events(a, "gang_placed")] == [1]

    # a stop on any node stops the job on every node (stopping one node's ranks alone would be healed)
    assert b.client.stop_job("big")["state"] == "stopping on every node"
    wait_for(lambda: a.client.job("big")["state"] == "stopped" == b.client.job("big")["state"], 30, "stopped everywhere")
    time.sleep(1.5)
    assert a.client.job("big")["state"] == "stopped" == b.client.job("big")["state"]  # and not restarted
    assert [e["fields"]["attempt"] for e in _events(a, "gang_placed")] == [1]  # no restart of a stopped job


def test_cluster_demo_runs(tmp_path: Path) -> None:
    import io

    from trainguard.agent.cluster.demo import run_demo

    out = io.StringIO()
    assert run_demo(3000, tmp_path, out=out) == 0, out.getvalue()
    text = out.getvalue()
    assert "a: ranks 0-0; b: ranks 1-1" in text and "node_lost" in text and "dp 2 -> 1" in text
    assert "on node b: state running, 1 rank(s)" in text and "parts from {'a': 'b', 'b': 'b'}" in text


@pytest.mark.parametrize("two_nodes", [2], indirect=True)
def test_tensor_parallel_groups_stay_inside_nodes_and_reshard_after_node_loss(
        two_nodes: tuple[ClusterNode, ClusterNode], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """dp=2 x tp=2 over two 2-slot nodes: each node holds one whole tp group (dp spans the nodes);
    after node a is lost, b runs dp=1 x tp=2 from the checkpoint assembled out of both nodes' parts."""
    from trainguard.cli import main as cli_main
    from trainguard.trainer.checkpoint import load_full_model_state

    a, b = two_nodes
    tiny = [f"--set={kv}" for kv in ("model.layers=2", "model.d_model=32", "model.heads=4", "model.context=32",
                                     "data.max_bytes=2000000", "global_batch=8", f"data.cache_dir={tmp_path / 'corpus'}")]
    # submitted the way a user does: `trainguard train --nodes 2` on node a
    assert cli_main(["train", "--state-dir", str(a.root / "state"), "--job", "big", "--nproc", "4", "--dp", "2",
                     "--tp", "2", "--nodes", "2", "--steps", "3000", *tiny]) == 0
    assert "big: recorded in the cluster; the leader places it on 2 nodes" in capsys.readouterr().out
    placed = wait_for(lambda: _events(a, "gang_placed"), 30, "placement")
    assert "dp=2 tp=2 pp=1 on 2 node(s): a: ranks 0-1; b: ranks 2-3" in placed[0]["message"]
    started = wait_for(lambda: _events(b, "gang_ranks_started"), 30, "b starts its block")
    assert "ranks 2-3 of 4 here (1 whole tp=2 group(s))" in started[0]["message"]
    wait_for(lambda: max(b.held_steps("a", "big.part-a") or [0]) >= 8, 120, f"a's part on b\n{b.log()[-2000:]}")
    a.kill_with_ranks("big")
    moved = wait_for(lambda: [e for e in _events(b, "gang_placed") if "node a lost" in e["message"]], 30,
                     f"re-placed on b\n{b.log()[-2000:]}")
    assert "dp=1 tp=2 pp=1 on 1 node(s): b: ranks 0-1; dp 2 -> 1" in moved[0]["message"]
    kept = _keep_parts([a, b], moved[0]["fields"]["restore_step"], tmp_path / "kept")
    resumed = wait_for(lambda: [e for e in _events(b, "job_resumed")
                                if (e["fields"].get("restored_from") or {}).get("tier") == "assembled"], 90,
                       f"resumed on b\n{b.log()[-3000:]}")
    step = resumed[0]["fields"]["restored_from"]["step"]
    written = _merge([kept / "a", kept / "b"], tmp_path / "written")
    got = load_full_model_state(str(shutil.copytree(b.shm / ".assembled" / "big" / f"step_{step}", tmp_path / "got")))
    want = load_full_model_state(str(written))
    assert want.keys() == got.keys() and len(want) > 0 and all((want[k] == got[k]).all() for k in want)


def test_a_spare_node_joins_the_job_at_a_later_attempt_and_it_trains_again(
        two_nodes: tuple[ClusterNode, ClusterNode], tmp_path: Path, etcd: LocalEtcd) -> None:
    """A node new to a job joins it at attempt > 1: every rank scopes its plan-sync keys by the
    cluster's attempt, not the node's own count of starts (none on the spare, whose rank would
    wait on plan/0/ while rank 0 writes under its own node's later count)."""
    from bench.trainjobs import tiny_config

    a, b = two_nodes
    trainer = tiny_config(str(tmp_path / "corpus"), steps=3000, parallel={"dp": 2}).to_dict()
    a.client._json("POST", "/v1/jobs", {"job": "big", "nproc": 2, "nodes": 2, "trainer": trainer})
    placed = wait_for(lambda: _events(a, "gang_placed"), 30, "placement")
    assert "a: ranks 0-0; b: ranks 1-1" in placed[0]["message"]
    wait_for(lambda: _progress(a) >= 8, 90, f"training on a and b\n{a.log()[-2000:]}")

    # the spare joins after the placement, so that it is new to the job
    c = ClusterNode(tmp_path / "c", "c", etcd.endpoints, a.token_file.read_text().strip(), cluster=f"s{os.getpid()}",
                    slots=1, ttl=3)
    try:
        wait_for(lambda: [e for e in a.events("node_joined") if e["fields"]["node"] == "c"], 20, "c joins")
        b.kill_with_ranks("big")
        killed = time.monotonic()
        moved = wait_for(lambda: [e for e in _events(a, "gang_placed") if "c: ranks 1-1" in e["message"]], 60,
                         f"the leader places the job on a and c\n{[(e['kind'], e['message']) for e in a.all_events()][-20:]}")
        attempt = moved[0]["fields"]["attempt"]
        assert attempt >= 2 and "a: ranks 0-0" in moved[0]["message"]
        started = wait_for(lambda: _events(c, "gang_ranks_started"), 60, f"c starts its block\n{c.log()[-2000:]}")
        assert started[0]["fields"]["attempt"] == attempt, [(e["kind"], e["message"]) for e in a.all_events()][-20:]
        # both nodes' ranks train again: rank 1 on c passed plan sync points with rank 0 on a
        resumed = wait_for(lambda: _events(c, "job_resumed") and _events(a, "job_resumed"),
                           120, f"training again on a and c\nc:\n{c.log()[-3000:]}\na:\n{a.log()[-2000:]}")
        took = time.monotonic() - killed
        job_c = c.client.job("big")
        assert job_c["attempt"] == attempt and job_c["local_ranks"] == [1, 1]
        restore = moved[0]["fields"]["restore_step"]
        step = wait_for(lambda: (s := _progress(c)) >= max(restore, 0) + 12 and s, 90,
                        "c's rank trains on past several plan sync points")
        assert step >= max(restore, 0) + 12 and resumed
        print(f"node loss -> training again on a and the spare c (attempt {attempt}, restore step {restore}) "
              f"in {took:.1f} s")
    finally:
        c.stop()
