"""Nodes made of network namespaces for ``trainguard run --nnodes`` (its tests and benchmark): a bridge namespace and one
namespace per node with a veth into the bridge, an address in 10.234.0.0/24, its own hostname and
/etc/hosts (gloo binds where the hostname resolves). Every name carries the test process's pid
and a run id so parallel runs never collide; ``Nodes.close`` kills every process in every
namespace it made and deletes them, even on failure.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SUBNET = "10.234.0"
PREFIX = "tgmn-"
PORT = 29400


class NetnsUnavailable(RuntimeError):
    """Network namespaces cannot be made here (not root, or a tool is missing)."""


def run(*args: str, timeout: float = 20.0, check: bool = True) -> str:
    proc = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, check=False)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} exited {proc.returncode}: {proc.stderr.strip()}")
    return proc.stdout


def pids_in(ns: str) -> list[int]:
    return [int(p) for p in run("ip", "netns", "pids", ns, check=False).split()]


def kill_all_in(ns: str) -> None:
    for _ in range(50):
        pids = pids_in(ns)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)


def sweep_stale(prefix: str = PREFIX, dirs: tuple[Path, ...] = (Path("/dev/shm"),)) -> None:
    """Deletes namespaces and directories (in ``dirs``) named ``<prefix><pid>-...`` whose test or
    bench process no longer exists (one killed before its clean-up ran); live ones stay."""
    def dead(name: str) -> bool:
        pid = name[len(prefix):].split("-", 1)[0]
        return pid.isdigit() and not os.path.exists(f"/proc/{pid}")

    for line in run("ip", "netns", "list", check=False).splitlines():
        ns = line.split()[0] if line.split() else ""
        if ns.startswith(prefix) and dead(ns):
            kill_all_in(ns)
            run("ip", "netns", "del", ns, check=False)
    for root in dirs:
        for path in root.glob(f"{prefix}*"):
            if dead(path.name):
                shutil.rmtree(path, ignore_errors=True)


@dataclass
class Node:
    name: str
    ns: str
    addr: str
    hosts_file: Path
    shm: Path
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def popen(self, argv: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        """``argv`` inside this node, with its hostname and /etc/hosts."""
        script = 'hostname "$1" && mount --bind "$2" /etc/hosts && shift 2 && exec "$@"'
        full = ["ip", "netns", "exec", self.ns, "unshare", "--uts", "--", "sh", "-c", script, "sh", self.name,
                str(self.hosts_file), *argv]
        environ = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
        with open(log, "ab") as fh:
            proc = subprocess.Popen(full, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=REPO,
                                    env=environ)
        self.procs.append(proc)
        return proc

    def start_agent(self, root: Path, timeout: float = 60.0, memory_every: int = 100000) -> Path:
        """This node's ``trainguard agent`` (snapshots after every step, a memory-tier checkpoint
        every ``memory_every`` steps, no cgroups, no eBPF); returns its state directory once its
        API answers."""
        state = root / f"state-{self.name}"
        state.mkdir()
        cfg = root / f"agent-{self.name}.toml"
        cfg.write_text(f'[agent]\nnode = "{self.name}"\ninterval_s = 0.25\n[collectors]\nebpf = false\ngpu = false\n'
                       '[launcher]\ncgroups = "off"\n'
                       f'[checkpoint]\nmemory_root = "{self.shm}"\nsnapshot_every = 1\nmemory_every = {memory_every}\n'
                       'disk_every = 100000\nobject_every = 100000\n')
        log = root / f"agent-{self.name}.log"
        proc = self.popen([sys.executable, "-m", "trainguard", "agent", "--state-dir", str(state), "--config", str(cfg),
                           "--metrics-addr", "127.0.0.1:0"], log)
        deadline = time.monotonic() + timeout
        while not (state / "run" / "agent.sock").exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"agent on {self.name} not up:\n{log.read_text()[-3000:]}")
            time.sleep(0.1)
        return state

    def cut(self) -> None:
        """This node's link down: it loses every peer and the peers lose it, silently."""
        run("ip", "-n", self.ns, "link", "set", "eth0", "down")

    def kill(self) -> None:
        """SIGKILL everything in this node: its launcher, agent and ranks."""
        kill_all_in(self.ns)


class Nodes:
    """The bridge and the node namespaces; a context manager that removes them all."""

    def __init__(self, root: Path, names: list[str]) -> None:
        missing = [t for t in ("ip", "unshare", "hostname") if shutil.which(t) is None]
        if os.geteuid() != 0 or missing:
            raise NetnsUnavailable(f"multi-node runs need root and {missing or 'these tools'} (network namespaces); "
                        f"running as uid {os.geteuid()}")
        sweep_stale()
        run_id = secrets.token_hex(3)
        self.bridge = f"{PREFIX}{os.getpid()}-{run_id}-br"
        self.namespaces: list[str] = []
        self.nodes: dict[str, Node] = {}
        hosts = "127.0.0.1 localhost\n" + "".join(f"{SUBNET}.{11 + i} {n}\n" for i, n in enumerate(names))
        for i, name in enumerate(names):
            hosts_file = root / f"hosts-{name}"
            hosts_file.write_text(hosts)
            self.nodes[name] = Node(name, f"{PREFIX}{os.getpid()}-{run_id}-{i}", f"{SUBNET}.{11 + i}", hosts_file,
                                    Path("/dev/shm") / f"{PREFIX}{os.getpid()}-{run_id}-{name}")
        self.run_id = run_id

    def __getitem__(self, name: str) -> Node:
        return self.nodes[name]

    def __enter__(self) -> Nodes:
        try:
            self._add(self.bridge)
            run("ip", "-n", self.bridge, "link", "add", "br0", "type", "bridge")
            run("ip", "-n", self.bridge, "link", "set", "br0", "up")
            for i, node in enumerate(self.nodes.values()):
                self._add(node.ns)
                port = f"n{self.run_id}{i}"
                run("ip", "-n", self.bridge, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns",
                    node.ns)
                run("ip", "-n", self.bridge, "link", "set", port, "master", "br0")
                run("ip", "-n", self.bridge, "link", "set", port, "up")
                run("ip", "-n", node.ns, "link", "set", "lo", "up")
                run("ip", "-n", node.ns, "addr", "add", f"{node.addr}/24", "dev", "eth0")
                run("ip", "-n", node.ns, "link", "set", "eth0", "up")
        except BaseException:
            self.close()
            raise
        return self

    def _add(self, ns: str) -> None:
        run("ip", "netns", "add", ns)
        self.namespaces.append(ns)

    def close(self) -> None:
        for ns in self.namespaces:
            kill_all_in(ns)
        for node in self.nodes.values():
            for proc in node.procs:
                try:
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    proc.kill()
        for ns in reversed(self.namespaces):
            run("ip", "netns", "del", ns, check=False)
        for node in self.nodes.values():
            shutil.rmtree(node.shm, ignore_errors=True)

    def __exit__(self, *exc: object) -> None:
        self.close()


def trainguard_run(node: Node, first: Node, *flags: str, log: Path, env: dict[str, str] | None = None
                   ) -> subprocess.Popen[bytes]:
    """``trainguard run`` on ``node`` meeting at ``first``'s address."""
    argv = [sys.executable, "-m", "trainguard", "run", "--rdzv-backend", "c10d", "--rdzv-endpoint",
            f"{first.addr}:{PORT}", *flags]
    return node.popen(argv, log, env)
