"""Real agent processes (agent.cluster.runner) on loopback with a real etcd: registration and one
leader, the token-protected API between agents, and node loss: one agent is SIGKILLed with its
ranks, the leader moves the job, the survivor restores it from the peer tier in its own RAM."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.api.client import ApiClient, ApiClientError
from agent.cluster.blobstore import CKPT_NS
from agent.cluster.etcd import EtcdClient
from agent.cluster.etcdserver import LocalEtcd

REPO = Path(__file__).resolve().parents[1]


def wait_for(pred: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


class ClusterNode:
    def __init__(self, root: Path, name: str, endpoints: list[str], token: str, *, slots: int, memory_every: int = 4,
                 ttl: int = 3) -> None:
        self.name = name
        self.root = root
        root.mkdir(parents=True)
        self.token_file = root / "tokens"
        self.token_file.write_text(token + "\n")
        os.chmod(self.token_file, 0o600)
        self.shm = Path("/dev/shm") / f"tg-cluster-test-{os.getpid()}-{secrets.token_hex(4)}-{name}"
        (root / "agent.toml").write_text(
            f'[agent]\nnode = "{name}"\ninterval_s = 0.25\n'
            f'[api]\ntcp = "127.0.0.1:0"\ntoken_file = "{self.token_file}"\n'
            f'[collectors]\nebpf = false\ngpu = false\n'
            f'[checkpoint]\nmemory_root = "{self.shm}"\nmemory_every = {memory_every}\nmemory_keep = 3\n'
            f'disk_every = 100000\n'
        )
        eps = ", ".join(f'"{e}"' for e in endpoints)
        (root / "cluster.toml").write_text(
            f'[cluster]\nname = "t{os.getpid()}"\netcd_endpoints = [{eps}]\nlease_ttl_s = {ttl}\npoll_s = 0.2\n'
            f'etcd_timeout_s = 0.5\nslots = {slots}\npeer_interval = {memory_every}\npeer_keep = 2\n'
        )
        self.log_path = root / "agent.log"
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "agent.cluster.runner", "--state-dir", str(root / "state"),
                 "--config", str(root / "agent.toml"), "--cluster-config", str(root / "cluster.toml"),
                 "--metrics-addr", ""],
                stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env)
        addr_file = root / "state" / "run" / "api.addr"
        wait_for(lambda: self.proc.poll() is not None or addr_file.exists(), 60, f"agent {name} up")
        if self.proc.poll() is not None:
            raise RuntimeError(f"agent {name} exited:\n{self.log()}")
        host, port = addr_file.read_text().strip().rsplit(":", 1)
        self.api = f"{host}:{port}"
        self.client = ApiClient.remote(host, int(port), token=token, timeout=30)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def events(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.client.events(since=0, limit=5000)["events"] if e["kind"] == kind]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        subprocess.run(["rm", "-rf", str(self.shm)], check=False)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Callable[..., ClusterNode]]:
    etcd = LocalEtcd(tmp_path / "etcd", size=1).start()
    token = secrets.token_hex(16)
    nodes: list[ClusterNode] = []

    def make(name: str, slots: int = 2, **kw: Any) -> ClusterNode:
        node = ClusterNode(tmp_path / name, name, etcd.endpoints, token, slots=slots, **kw)
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
    etcd = EtcdClient(cluster.etcd.endpoints)  # type: ignore[attr-defined]
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


@pytest.mark.slow
def test_node_loss_job_resumes_on_survivor_from_peer_tier(cluster: Callable[..., ClusterNode], tmp_path: Path) -> None:
    from trainer.checkpoint import load_full_model_state
    from trainer.testing import tiny_config

    a = cluster("a", slots=2)
    b = cluster("b", slots=1)  # the survivor has room for one rank: dp 2 -> 1, resharded restore
    trainer = tiny_config(str(tmp_path / "corpus"), steps=2000, parallel={"dp": 2}).to_dict()
    a.client.submit_job({"job": "big", "nproc": 2, "trainer": trainer})

    # wait until b holds a's copy of a memory checkpoint
    held = b.shm / ".peer-held" / "ckpt" / "a" / "big"

    def held_steps() -> list[int]:
        try:
            return sorted(int(p.name[5:]) for p in held.iterdir() if p.name.startswith("step_"))
        except FileNotFoundError:
            return []

    wait_for(lambda: held_steps() and max(held_steps()) >= 8, 150, f"a peer copy on b\n{a.log()[-3000:]}")
    # kill node a: its agent and its ranks, no clean anything
    ranks = [r["pid"] for r in a.client.job("big")["ranks"]]
    a.proc.kill()
    for pid in ranks:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    a.proc.wait()
    killed_at = time.monotonic()
    lost_step = max(held_steps())

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
