"""Hosts made of network namespaces: a bridge namespace that also runs etcd (HTTPS with client
certificates), and one namespace per host with a veth into a bridge, an address in 10.233.0.0/24,
its own hostname and /etc/hosts, and one ``trainguard agent`` whose TCP API speaks mutual TLS.

The bridge namespace holds two bridges joined by a trunk veth: ``br0`` carries etcd's address and
the near hosts, ``br1`` the hosts named ``far``. A host whose own link is cut (``cut``) loses etcd
and every peer; cutting the trunk (``partition``) splits the far hosts, which keep each other, from
the near hosts and etcd, dropping frames silently as a real partition does. Every name
(namespaces, veths, shared-memory roots) carries a per-run id so two pytest workers never collide;
``Fabric.close`` kills every process in every namespace it made and deletes them, even on failure.
"""

from __future__ import annotations

import base64
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from bench.netns import kill_all_in, run, sweep_stale
from trainguard.agent.api.client import ApiClient
from trainguard.agent.cluster.config import ClusterConfig

REPO = Path(__file__).resolve().parents[2]
SUBNET = "10.233.0"
BRIDGE_ADDR = f"{SUBNET}.1"
ETCD_PORT = 2379
API_PORT = 7443


PREFIX = "tgmh-"
"""Namespaces and shared-memory roots are named ``tgmh-<pid of the test process>-<run id>-...``."""


def require_namespaces() -> None:
    """Fails (never skips) where the set-up cannot be made: CI runs these tests as root."""
    missing = [tool for tool in ("ip", "bridge", "unshare", "etcd", "curl", "hostname") if shutil.which(tool) is None]
    if os.geteuid() != 0 or missing:
        pytest.fail(f"multi-host tests need root and {missing or 'these tools'} (network namespaces, bridge, "
                    f"etcd-server, curl); running as uid {os.geteuid()}")
    try:
        import trustme  # noqa: F401
    except ImportError:
        pytest.fail("multi-host tests need trustme (pip install trustme) for the cluster's certificates")


def _write_secret(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(path, 0o600)


@dataclass
class Tls:
    cert: Path
    key: Path
    ca: Path


@dataclass
class Host:
    """One host: its namespace, address, certificate and (once started) its agent."""

    name: str
    ns: str
    addr: str
    bridge_port: str
    root: Path
    shm: Path
    tls: Tls
    hosts_file: Path = Path("/etc/hosts")
    proc: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    _seq: int = 0
    seen: list[dict[str, Any]] = field(default_factory=list)
    _events_lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def state_dir(self) -> Path:
        return self.root / "state"

    @property
    def socket(self) -> Path:
        return self.state_dir / "run" / "agent.sock"

    @property
    def log_path(self) -> Path:
        return self.root / "agent.log"

    def log(self, tail: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-tail:]
        except FileNotFoundError:
            return ""

    def client(self, timeout: float = 5.0) -> ApiClient:
        """The agent's unix-socket API: a path on the shared filesystem, reachable from the test's
        namespace whatever happens to the host's network."""
        return ApiClient.local(self.socket, timeout=timeout)

    def agent_alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def pids(self) -> list[int]:
        return [int(p) for p in run("ip", "netns", "pids", self.ns, check=False).split()]

    def new_events(self) -> list[dict[str, Any]]:
        """Events the agent logged since the last call (kept in ``seen`` too)."""
        with self._events_lock:
            got: list[dict[str, Any]] = self.client(timeout=3).events(since=self._seq, limit=5000)["events"]
            if got:
                self._seq = got[-1]["seq"]
                self.seen.extend(got)
            return got

    def events(self, kind: str, job: str | None = None) -> list[dict[str, Any]]:
        """Every event of ``kind`` seen so far (refreshed now when the agent answers)."""
        if self.agent_alive():
            try:
                self.new_events()
            except Exception:  # noqa: BLE001 - a dead or busy agent: what was seen stays
                pass
        return [e for e in self.seen if e["kind"] == kind and (job is None or e.get("job") == job)]

    def committed_parts(self, job: str) -> set[tuple[str, int]]:
        """(part's node, step) of every committed checkpoint part of ``job`` in this host's RAM: its
        own parts and the copies it holds for peers (a step directory counts once its manifest is in)."""
        found: set[tuple[str, int]] = set()
        own = self.shm / f"{job}.part-{self.name}"
        held = self.shm / ".peer-held" / "ckpt"
        dirs = [(self.name, own)]
        try:
            dirs += [(o.name, o / f"{job}.part-{o.name}") for o in held.iterdir()]
        except FileNotFoundError:
            pass
        for node, d in dirs:
            try:
                for step_dir in d.iterdir():
                    if step_dir.name.startswith("step_") and (step_dir / "trainguard-manifest.json").exists():
                        found.add((node, int(step_dir.name[5:])))
            except (FileNotFoundError, ValueError):
                continue
        return found


class Fabric:
    """The bridge namespace with etcd, the host namespaces, the CA and every certificate."""

    def __init__(self, root: Path, names: Iterable[str], *, far: Iterable[str] = (), ttl: int = 5,
                 cluster_extra: dict[str, Any] | None = None, memory_every: int = 4,
                 loopback_hostname: bool = False) -> None:
        """``far``: hosts on the far side of the trunk; ``loopback_hostname``: each host's own name
        resolves to 127.0.1.1 in its /etc/hosts, as Debian's installer writes it (peers' names
        still resolve to their addresses)."""
        require_namespaces()
        import trustme

        sweep_stale(PREFIX)
        self.root = root
        self.run_id = secrets.token_hex(3)
        self.bridge_ns = f"{PREFIX}{os.getpid()}-{self.run_id}-br"
        self.cluster = f"mh{self.run_id}"
        self.ttl = ttl
        self.memory_every = memory_every
        self.cluster_extra = dict(cluster_extra or {})
        self.token = secrets.token_hex(16)
        self.namespaces: list[str] = []
        self.etcd: subprocess.Popen[bytes] | None = None
        self.far = set(far)
        self.hosts: dict[str, Host] = {}
        self.pki = root / "pki"
        self.pki.mkdir(parents=True)
        self._ca = trustme.CA(organization_name="trainguard test cluster")
        self.ca_path = self.pki / "ca.pem"
        self._ca.cert_pem.write_to_path(str(self.ca_path))
        self.etcd_tls = self._issue("etcd", BRIDGE_ADDR)
        self.observer_tls = self._issue("observer")
        self.token_file = root / "tokens"
        _write_secret(self.token_file, self.token + "\n")
        self.key_file = root / "cluster.key"
        _write_secret(self.key_file, secrets.token_hex(32) + "\n")
        for i, name in enumerate(names):
            addr = f"{SUBNET}.{11 + i}"
            self.hosts[name] = Host(name, f"{PREFIX}{os.getpid()}-{self.run_id}-{i}", addr, f"b{self.run_id}{i}",
                                    root / name, Path("/dev/shm") / f"{PREFIX}{os.getpid()}-{self.run_id}-{name}",
                                    self._issue(name, addr))
        for host in self.hosts.values():
            own = [f"127.0.1.1 {host.name}\n"] if loopback_hostname else []
            host.hosts_file = root / f"hosts-{host.name}"
            host.hosts_file.write_text("127.0.0.1 localhost\n" + "".join(own) + f"{BRIDGE_ADDR} etcd\n"
                                       + "".join(f"{h.addr} {h.name}\n" for h in self.hosts.values()
                                                 if not (loopback_hostname and h is host)))

    def _issue(self, name: str, addr: str | None = None) -> Tls:
        """A certificate with the name as CN and DNS SAN and the address as IP SAN (client and server use)."""
        ids = [name] + ([addr] if addr else [])
        leaf = self._ca.issue_cert(*ids, common_name=name)
        cert, key = self.pki / f"{name}.pem", self.pki / f"{name}.key"
        for i, blob in enumerate(leaf.cert_chain_pems):
            blob.write_to_path(str(cert), append=i > 0)
        leaf.private_key_pem.write_to_path(str(key))
        os.chmod(key, 0o600)
        return Tls(cert, key, self.ca_path)

    # -- network -------------------------------------------------------------------------------

    def start(self) -> Fabric:
        br = self.bridge_ns
        self._add_ns(br)
        run("ip", "-n", br, "link", "set", "lo", "up")
        for bridge in ("br0", "br1"):
            run("ip", "-n", br, "link", "add", bridge, "type", "bridge")
            run("ip", "-n", br, "link", "set", bridge, "up")
        run("ip", "-n", br, "addr", "add", f"{BRIDGE_ADDR}/24", "dev", "br0")
        run("ip", "-n", br, "link", "add", "trunk0", "type", "veth", "peer", "name", "trunk1")
        for end, bridge in (("trunk0", "br0"), ("trunk1", "br1")):
            run("ip", "-n", br, "link", "set", end, "master", bridge)
            run("ip", "-n", br, "link", "set", end, "up")
        for host in self.hosts.values():
            self._add_ns(host.ns)
            run("ip", "-n", br, "link", "add", host.bridge_port, "type", "veth", "peer", "name", "eth0",
                "netns", host.ns)
            run("ip", "-n", br, "link", "set", host.bridge_port, "master", "br1" if host.name in self.far else "br0")
            run("ip", "-n", br, "link", "set", host.bridge_port, "up")
            run("ip", "-n", host.ns, "link", "set", "lo", "up")
            run("ip", "-n", host.ns, "addr", "add", f"{host.addr}/24", "dev", "eth0")
            run("ip", "-n", host.ns, "link", "set", "eth0", "up")
        self._start_etcd()
        return self

    def _add_ns(self, ns: str) -> None:
        run("ip", "netns", "add", ns)
        self.namespaces.append(ns)

    def _start_etcd(self) -> None:
        url = f"https://{BRIDGE_ADDR}:{ETCD_PORT}"
        t = self.etcd_tls
        args = ["ip", "netns", "exec", self.bridge_ns, "etcd", "--name", "m0", "--data-dir", str(self.root / "etcd"),
                "--listen-client-urls", url, "--advertise-client-urls", url,
                "--listen-peer-urls", "http://127.0.0.1:2380", "--initial-advertise-peer-urls", "http://127.0.0.1:2380",
                "--initial-cluster", "m0=http://127.0.0.1:2380", "--initial-cluster-state", "new",
                "--initial-cluster-token", self.cluster, "--heartbeat-interval", "50", "--election-timeout", "500",
                "--cert-file", str(t.cert), "--key-file", str(t.key), "--trusted-ca-file", str(t.ca),
                "--client-cert-auth"]
        with open(self.root / "etcd.log", "ab") as log:
            self.etcd = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while True:
            if self.etcd.poll() is not None:
                raise RuntimeError(f"etcd exited: {(self.root / 'etcd.log').read_text()[-2000:]}")
            try:
                self.etcd_range("/trainguard-ready")
                return
            except (RuntimeError, ValueError):
                if time.monotonic() > deadline:
                    raise RuntimeError("etcd did not answer over TLS in 30 s") from None
                time.sleep(0.2)

    def etcd_range(self, prefix: str) -> dict[str, Any]:
        """Keys under ``prefix`` read from inside the bridge namespace with the observer's client
        certificate (the test's own namespace has no route to the cluster)."""
        key = base64.b64encode(prefix.encode()).decode()
        end = base64.b64encode(prefix[:-1].encode() + bytes([prefix.encode()[-1] + 1])).decode()
        t = self.observer_tls
        out = run("ip", "netns", "exec", self.bridge_ns, "curl", "-sS", "--max-time", "3", "--cacert", str(t.ca),
                  "--cert", str(t.cert), "--key", str(t.key), "-X", "POST",
                  f"https://{BRIDGE_ADDR}:{ETCD_PORT}/v3/kv/range",
                  "-d", json.dumps({"key": key, "range_end": end}), timeout=10)
        reply = json.loads(out)
        return {base64.b64decode(kv["key"]).decode(): json.loads(base64.b64decode(kv["value"]) or b"null")
                for kv in reply.get("kvs", [])} if "header" in reply else _raise(reply)

    def job_record(self, job: str) -> dict[str, Any] | None:
        rec = self.etcd_range(f"/trainguard/{self.cluster}/jobs/{job}")
        return rec.get(f"/trainguard/{self.cluster}/jobs/{job}")

    # -- agents --------------------------------------------------------------------------------

    def start_agent(self, name: str, *, slots: int = 1, timeout: float = 90.0) -> Host:
        """Starts ``name``'s agent inside its namespace with its own hostname and /etc/hosts."""
        host = self.hosts[name]
        host.root.mkdir(parents=True, exist_ok=True)
        cfg = host.root / "agent.toml"
        cfg.write_text(self.agent_config(host, slots))
        script = 'hostname "$1" && mount --bind "$2" /etc/hosts && shift 2 && exec "$@"'
        args = ["ip", "netns", "exec", host.ns, "unshare", "--uts", "--", "sh", "-c", script, "sh", host.name,
                str(host.hosts_file), sys.executable, "-m", "trainguard", "agent", "--state-dir", str(host.state_dir),
                "--config", str(cfg), "--metrics-addr", "127.0.0.1:0"]
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        with open(host.log_path, "ab") as log:
            host.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         cwd=REPO, env=env)
        host.started_at = time.time()
        deadline = time.monotonic() + timeout
        addr = host.state_dir / "run" / "api.addr"
        while not (addr.exists() and host.socket.exists()):
            if host.proc.poll() is not None:
                raise RuntimeError(f"agent {name} exited {host.proc.returncode}:\n{host.log()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"agent {name} not up in {timeout} s:\n{host.log()}")
            time.sleep(0.1)
        return host

    def agent_config(self, host: Host, slots: int) -> str:
        """TLS everywhere: etcd over HTTPS with this host's client certificate, the TCP API with
        mutual TLS; keys newer agents know (``key_file`` and ``cluster_extra``) only where the
        config has them."""
        t = host.tls
        known = ClusterConfig.__dataclass_fields__
        extra = {k: v for k, v in self.cluster_extra.items() if k in known}
        if "key_file" in known:
            extra["key_file"] = str(self.key_file)
        return (
            f'[agent]\nnode = "{host.name}"\ninterval_s = 0.25\n'
            f'[api]\ntcp = "{host.addr}:{API_PORT}"\ntoken_file = "{self.token_file}"\n'
            f'tls_cert = "{t.cert}"\ntls_key = "{t.key}"\ntls_ca = "{t.ca}"\ntls_client_auth = true\n'
            '[collectors]\nebpf = false\ngpu = false\n'
            # one cgroup tree for every namespace: job cgroups would collide on trainguard/<job>
            '[launcher]\ncgroups = "off"\n'
            f'[checkpoint]\nmemory_root = "{host.shm}"\nmemory_every = {self.memory_every}\nmemory_keep = 3\n'
            'disk_every = 100000\nobject_every = 100000\n'
            f'[cluster]\nname = "{self.cluster}"\netcd_endpoints = ["{BRIDGE_ADDR}:{ETCD_PORT}"]\n'
            f'lease_ttl_s = {self.ttl}\npoll_s = 0.25\netcd_timeout_s = {min(1.0, round(self.ttl / 3 - 0.2, 2))}\n'
            f'slots = {slots}\npeer_interval = {self.memory_every}\npeer_keep = 2\n'
            f'advertise = "{host.addr}:{API_PORT}"\n'
            f'etcd_ca = "{t.ca}"\netcd_cert = "{t.cert}"\netcd_key = "{t.key}"\n'
            + "".join(f"{k} = {json.dumps(v)}\n" for k, v in extra.items())
        )

    # -- faults --------------------------------------------------------------------------------

    def kill(self, name: str) -> float:
        """SIGKILL of every process in the host's namespace (agent and ranks at once); returns when."""
        host = self.hosts[name]
        at = time.time()
        deadline = time.monotonic() + 15
        while (pids := host.pids()) and time.monotonic() < deadline:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)
        if host.proc is not None:
            host.proc.wait(15)
        return at

    def cut(self, name: str) -> float:
        """The host's link down inside its namespace: it loses etcd and every peer."""
        at = time.time()
        run("ip", "-n", self.hosts[name].ns, "link", "set", "eth0", "down")
        return at

    def heal(self, name: str) -> float:
        at = time.time()
        run("ip", "-n", self.hosts[name].ns, "link", "set", "eth0", "up")
        return at

    def partition(self) -> float:
        """The trunk down: the far hosts keep each other but lose the near hosts and etcd."""
        at = time.time()
        run("ip", "-n", self.bridge_ns, "link", "set", "trunk1", "down")
        return at

    def heal_partition(self) -> float:
        at = time.time()
        run("ip", "-n", self.bridge_ns, "link", "set", "trunk1", "up")
        return at

    # -- teardown ------------------------------------------------------------------------------

    def close(self) -> None:
        """Agents get SIGTERM and 10 s, then everything left in every namespace is SIGKILLed and the
        namespaces and shared-memory roots are removed."""
        for host in self.hosts.values():
            if host.agent_alive():
                assert host.proc is not None
                host.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for host in self.hosts.values():
            if host.proc is not None:
                try:
                    host.proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
        for ns in reversed(self.namespaces):
            kill_all_in(ns)
        for host in self.hosts.values():
            if host.proc is not None and host.proc.poll() is None:
                host.proc.kill()
            if host.proc is not None:
                host.proc.wait(10)
        if self.etcd is not None:
            if self.etcd.poll() is None:
                self.etcd.kill()
            self.etcd.wait(10)
        for ns in reversed(self.namespaces):
            run("ip", "netns", "del", ns, check=False)
        for host in self.hosts.values():
            shutil.rmtree(host.shm, ignore_errors=True)

    def __enter__(self) -> Fabric:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()


def _raise(reply: dict[str, Any]) -> dict[str, Any]:
    raise RuntimeError(f"etcd: {reply}")
