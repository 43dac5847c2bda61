"""Cluster demo: two agents and a local etcd on loopback run one job spanning both; one node dies
with its ranks, the job goes on on the other from its own checkpoint part and the peer copy of the
lost node's part.

    python -m trainguard.agent.cluster.demo [--steps N] [--keep DIR]

``ClusterNode`` (one agent process with its own state dir, TCP API, token, shared-memory root and
cluster config) is also what the tests use.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from trainguard.agent.api.client import ApiClient
from trainguard.agent.api.tls import TlsFiles, client_context
from trainguard.agent.cluster.etcdserver import LocalEtcd
from trainguard.agent.cluster.signing import write_key
from trainguard.agent.waiting import wait_for

REPO = Path(__file__).resolve().parents[2]  # the checkout (agent/ resolved through the link)


def _tls_lines(tls: TlsFiles | None) -> str:
    if tls is None:
        return "allow_plaintext = true\n"  # loopback only: nothing crosses a network
    return (f'tls_cert = "{tls.cert}"\ntls_key = "{tls.key}"\ntls_ca = "{tls.ca}"\n'
            f'tls_client_auth = {"true" if tls.client_auth else "false"}\n')


def shared_key(directory: Path) -> Path:
    """``directory/cluster.key``, created (0600) if it is not there yet: one cluster key for the
    nodes a test or the demo makes side by side."""
    path = directory / "cluster.key"
    try:
        write_key(str(path))
    except FileExistsError:
        pass
    return path


class ClusterNode:
    """One simulated node: ``trainguard agent`` (``python -m trainguard.agent.cli agent``) with its own
    directories and an ``agent.toml`` whose ``[cluster]`` section points at the shared etcd."""

    def __init__(self, root: Path, name: str, endpoints: list[str], token: str, *, cluster: str, slots: int,
                 memory_every: int = 4, ttl: int = 3, peer_interval: int | None = None, object_url: str = "",
                 object_every: int = 2000, tls: TlsFiles | None = None, etcd_tls: bool = False,
                 shm: Path | None = None, cluster_extra: str = "", key_file: Path | None = None) -> None:
        """``peer_interval``: steps between peer-tier copies (default: every memory checkpoint);
        ``object_url``: an object tier (``file://...``) every ``object_every`` steps; ``tls``: this
        node's certificate and the cluster's CA (mutual TLS), else plain HTTP on loopback;
        ``etcd_tls``: etcd speaks HTTPS too (same CA, this node's certificate), else plain HTTP on
        loopback (``etcd_plaintext``); ``shm``: the memory root of a node that comes back (its RAM
        kept what it had); ``cluster_extra``: more ``[cluster]`` lines; ``key_file``: the cluster
        key (default: ``cluster.key`` beside ``root``, made once and shared by every node made in
        the same directory)."""
        self.name = name
        self.root = root
        root.mkdir(parents=True)
        self.key_file = key_file or shared_key(root.parent)
        self.token_file = root / "tokens"
        self.token_file.write_text(token + "\n")
        os.chmod(self.token_file, 0o600)
        self.shm = shm or Path("/dev/shm") / f"tg-cluster-{os.getpid()}-{secrets.token_hex(4)}-{name}"
        (root / "agent.toml").write_text(
            f'[agent]\nnode = "{name}"\ninterval_s = 0.25\n'
            f'[api]\ntcp = "127.0.0.1:0"\ntoken_file = "{self.token_file}"\n' + _tls_lines(tls)
            + f'[collectors]\nebpf = false\ngpu = false\n'
            f'[checkpoint]\nmemory_root = "{self.shm}"\nmemory_every = {memory_every}\nmemory_keep = 3\n'
            f'disk_every = 100000\nobject_every = {object_every}\n'
            + (f'[checkpoint.object]\nurl = "{object_url}"\n' if object_url else '')
            + f'[cluster]\nname = "{cluster}"\netcd_endpoints = {json.dumps(endpoints)}\n'
            f'lease_ttl_s = {ttl}\npoll_s = 0.2\netcd_timeout_s = 0.5\nslots = {slots}\n'
            f'peer_interval = {peer_interval or memory_every}\npeer_keep = 2\n' + cluster_extra
            + (f'etcd_ca = "{tls.ca}"\netcd_cert = "{tls.cert}"\netcd_key = "{tls.key}"\n' if tls and etcd_tls
               else 'etcd_plaintext = true\n')  # loopback only: nothing crosses a network
            + f'key_file = "{self.key_file}"\n'
        )
        self.log_path = root / "agent.log"
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "trainguard", "agent", "--state-dir", str(root / "state"),
                 "--config", str(root / "agent.toml"), "--metrics-addr", "127.0.0.1:0"],
                stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env)
        addr_file = root / "state" / "run" / "api.addr"
        wait_for(lambda: self.proc.poll() is not None or addr_file.exists(), 60, f"agent {name} up")
        if self.proc.poll() is not None:
            raise RuntimeError(f"agent {name} exited:\n{self.log()}")
        host, port = addr_file.read_text().strip().rsplit(":", 1)
        self.api = f"{host}:{port}"
        self.client = ApiClient.remote(host, int(port), token=token, timeout=30,
                                       tls=client_context(tls) if tls is not None else None)

    def metric(self, name: str) -> float | None:
        """One unlabelled sample from this agent's /metrics."""
        import urllib.request

        port = (self.root / "state" / "run" / "metrics.addr").read_text().strip().rsplit(":", 1)[1]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            for line in resp.read().decode().splitlines():
                if line.startswith(name + " "):
                    return float(line.split()[1])
        return None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def all_events(self) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = self.client.events(since=0, limit=5000)["events"]
        return events

    def events(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.all_events() if e["kind"] == kind]

    def held_steps(self, origin: str, job: str) -> list[int]:
        d = self.shm / ".peer-held" / "ckpt" / origin / job
        try:
            return sorted(int(p.name[5:]) for p in d.iterdir() if p.name.startswith("step_"))
        except FileNotFoundError:
            return []

    def kill_with_ranks(self, job: str) -> None:
        """What a node loss looks like: agent and ranks gone at once, nothing cleaned up."""
        ranks = [r["pid"] for r in self.client.job(job)["ranks"]]
        self.proc.kill()
        for pid in ranks:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.shm, ignore_errors=True)


_SHOWN = ("node_joined", "leader_elected", "node_lost", "gang_placed", "gang_ranks_started", "restore_selected",
          "checkpoint_part_unusable", "job_restart_requested", "job_resumed")


def run_demo(steps: int, root: Path, out: Any = sys.stdout) -> int:
    """Two agents, one job spanning both (one rank each, dp=2); node a dies with its rank; the
    leader restarts the job on b with dp=1 from a checkpoint assembled out of b's own part and
    the copy of a's part that b holds in RAM."""
    from trainguard.trainer.config import config_from_cli  # torch-free

    token = secrets.token_hex(16)
    etcd = LocalEtcd(root / "etcd", size=1).start()
    print(f"etcd on {etcd.endpoints[0]}", file=out)
    nodes: list[ClusterNode] = []
    try:
        a = ClusterNode(root / "a", "a", etcd.endpoints, token, cluster="demo", slots=1)
        nodes.append(a)
        wait_for(lambda: a.metric("trainguard_cluster_is_leader") == 1, 20, "a leads")
        b = ClusterNode(root / "b", "b", etcd.endpoints, token, cluster="demo", slots=1)
        nodes.append(b)
        print(f"node a: API {a.api}, 1 slot; node b: API {b.api}, 1 slot", file=out)
        trainer = config_from_cli(nproc=2, steps=steps, overrides=["model.layers=2", "model.d_model=32",
                                                                   "model.context=32", "global_batch=8"])
        a.client.submit_job({"job": "demo", "nproc": 2, "nodes": 2, "trainer": trainer})
        print("job 'demo' (dp=2 over 2 nodes) submitted to node a", file=out)
        placed = wait_for(lambda: [e for n in nodes for e in n.events("gang_placed")], 60, "placement")
        print(f"  leader placed it: {placed[0]['message']}", file=out)
        wait_for(lambda: max(b.held_steps("a", "demo.part-a") or [0]) >= 12, 180, "a peer copy of a's part")
        before = b.client.job("demo")["progress_step"]
        print(f"training at step {before}; node b holds node a's checkpoint parts at steps "
              f"{b.held_steps('a', 'demo.part-a')} in RAM", file=out)
        print("killing node a (agent and its rank, SIGKILL) ...", file=out)
        seen: set[int] = {e["seq"] for e in b.all_events()}  # show only what follows the kill
        killed = time.monotonic()
        a.kill_with_ranks("demo")
        resumed: dict[str, Any] = {}

        def show() -> bool:
            for e in b.all_events():
                if e["seq"] in seen or e["kind"] not in _SHOWN:
                    continue
                seen.add(e["seq"])
                print(f"  b +{time.monotonic() - killed:5.1f}s {e['kind']:<22} {e['message']}", file=out)
                if e["kind"] == "job_resumed" and e.get("job") == "demo":
                    resumed.update(e)
            return bool(resumed)

        wait_for(show, 120, "the job to resume on node b")
        time.sleep(3)
        job = b.client.job("demo")
        restored = (resumed.get("fields") or {}).get("restored_from") or {}
        print(f"job 'demo' on node b: state {job['state']}, {job['nproc']} rank(s), step {job['progress_step']}; "
              f"restored step {restored.get('step')} (parts from {restored.get('parts')}), "
              f"about {max(0, before - int(restored.get('step', 0)))} step(s) redone, "
              f"{(resumed.get('fields') or {}).get('recovery_s')} s from the first failure to training again", file=out)
        return 0 if job["state"] in ("running", "starting", "succeeded") else 1
    finally:
        for n in nodes:
            n.stop()
        etcd.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainguard.agent.cluster.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--keep", help="keep logs and state under this directory")
    args = p.parse_args(argv)
    if args.keep:
        return run_demo(args.steps, Path(args.keep))
    with tempfile.TemporaryDirectory(prefix="tg-cluster-demo-") as tmp:
        return run_demo(args.steps, Path(tmp))


if __name__ == "__main__":
    sys.exit(main())
