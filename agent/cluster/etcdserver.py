"""Start a throw-away local etcd (one member or a small cluster) on loopback.

For tests, the cluster demo and benchmarks: real ``etcd`` binaries (Debian's etcd-server), free
ports on 127.0.0.1, a data directory the caller owns. Production clusters run their own etcd; the
agent only needs its endpoints.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from trainguard.agent.cluster.etcd import EtcdClient, EtcdUnavailable
from trainguard.agent.lifecycle.launcher import free_port

ETCD_BINARY = "etcd"


@dataclass
class EtcdMember:
    name: str
    client_port: int
    peer_port: int
    data_dir: Path
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def pause(self) -> None:
        """SIGSTOP: the member stops answering (a stall), its TCP port stays open."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(10)


@dataclass
class LocalEtcd:
    """``members`` etcd processes forming one cluster on 127.0.0.1 (fast election settings)."""

    root: Path
    size: int = 1
    binary: str = ETCD_BINARY
    members: list[EtcdMember] = field(default_factory=list)
    tls: tuple[str, str, str] | None = None
    """(cert, key, ca) PEM files: clients speak HTTPS and must present a certificate from ca."""
    client_tls: tuple[str, str] | None = None
    """(cert, key) this helper's own readiness probe presents when ``tls`` is set."""

    @property
    def endpoints(self) -> list[str]:
        return [m.endpoint for m in self.members]

    def start(self, timeout: float = 30.0, attempts: int = 3) -> LocalEtcd:
        """Start the members and wait until the cluster takes a write. Their ports are probed free
        and then bound by etcd, so another process can take one in between (CI saw a member exit
        with "address already in use"): then the whole cluster starts again on fresh ports, as the
        peer ports are written into every member's initial cluster."""
        exe = shutil.which(self.binary)
        if exe is None:
            raise FileNotFoundError(f"{self.binary} not found (Debian: apt-get install etcd-server)")
        self.root.mkdir(parents=True, exist_ok=True)
        for attempt in range(1, attempts + 1):
            self._spawn(exe)
            try:
                self.wait_ready(timeout)
                return self
            except RuntimeError as e:
                if attempt == attempts or "address already in use" not in str(e):
                    raise
                self.stop()
                for m in self.members:
                    shutil.rmtree(m.data_dir, ignore_errors=True)
        raise AssertionError("unreachable")

    def _spawn(self, exe: str) -> None:
        self.members = [
            EtcdMember(f"m{i}", free_port(), free_port(), self.root / f"m{i}.etcd", self.root / f"m{i}.log")
            for i in range(self.size)
        ]
        initial = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        token = f"tg-{os.getpid()}-{self.members[0].client_port}"  # one per cluster, shared by members
        scheme = "https" if self.tls else "http"
        for m in self.members:
            args = [
                exe, "--name", m.name, "--data-dir", str(m.data_dir),
                "--listen-client-urls", f"{scheme}://{m.endpoint}", "--advertise-client-urls", f"{scheme}://{m.endpoint}",
                "--listen-peer-urls", m.peer_url, "--initial-advertise-peer-urls", m.peer_url,
                "--initial-cluster", initial, "--initial-cluster-state", "new",
                "--initial-cluster-token", token,
                # Fast elections on loopback; small defaults keep a test cluster light.
                "--heartbeat-interval", "50", "--election-timeout", "500",
                "--snapshot-count", "10000", "--quota-backend-bytes", str(256 << 20),
            ]
            if self.tls is not None:
                cert, key, ca = self.tls
                args += ["--cert-file", cert, "--key-file", key, "--trusted-ca-file", ca, "--client-cert-auth"]
            with open(m.log_path, "ab") as log:
                m.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        client = self.client(timeout_s=0.5)
        while True:
            for m in self.members:
                if m.proc is not None and m.proc.poll() is not None:
                    raise RuntimeError(f"etcd member {m.name} exited: {m.log_path.read_text()[-2000:]}")
            try:
                client.put("/trainguard-ready", "1")
                return
            except (EtcdUnavailable, Exception):  # noqa: BLE001 - not up yet, whatever it says
                if time.monotonic() > deadline:
                    raise RuntimeError("etcd did not become ready") from None
                time.sleep(0.1)

    def client(self, timeout_s: float = 1.0, endpoints: list[str] | None = None) -> EtcdClient:
        """A client of this cluster (with the probe's certificate when it speaks TLS)."""
        eps = endpoints or self.endpoints
        if self.tls is None:
            return EtcdClient(eps, timeout_s=timeout_s, plaintext=True)
        cert, key = self.client_tls or ("", "")
        return EtcdClient(eps, timeout_s=timeout_s, ca=self.tls[2], cert=cert, key=key)

    def leader(self) -> EtcdMember | None:
        """The member that is raft leader now (by asking each live one)."""
        for m in self.members:
            if not m.alive():
                continue
            try:
                client = self.client(timeout_s=0.5, endpoints=[m.endpoint])
                status = client._post("/maintenance/status", {})
            except Exception:  # noqa: BLE001
                continue
            if status.get("leader") and status.get("leader") == status.get("header", {}).get("member_id"):
                return m
        return None

    def stop(self) -> None:
        for m in self.members:
            m.kill()

    def __enter__(self) -> LocalEtcd:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
