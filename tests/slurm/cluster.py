"""A real Slurm cluster made of network namespaces: Debian's slurmctld, one slurmd per node and a
munged with its own key and socket, every daemon in the foreground.

The controller's namespace holds a bridge with the controller's address; each node namespace gets
a veth into that bridge and an address in 10.232.0.0/24 (no route out, so nothing leaves). Each
daemon runs with its own hostname and /etc/hosts through ``nsenter --net`` plus ``unshare --mount
--uts`` (``ip netns exec`` remounts /sys, which hides the cgroup tree slurmd 22.05 needs), and each
node has a /dev/shm of its own. Clients
(``sbatch``, ``srun``, ``sinfo``, ``scontrol``) run in the controller's namespace. Jobs see the
repository under test on PYTHONPATH and this interpreter's directory first on PATH, so
``trainguard`` and ``python`` in a batch script are the code under test.

Every name carries the test process's pid and a run id so two pytest workers never collide;
``SlurmCluster.close`` kills every process in every namespace it made and deletes them, even after
a failure, and ``wait()``s on each daemon it started.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from bench.netns import kill_all_in, pids_in, run, sweep_stale

REPO = Path(__file__).resolve().parents[2]
SUBNET = "10.232.0"
CTL_ADDR = f"{SUBNET}.1"
CTL_NAME = "ctl"
PREFIX = "tgsl-"
"""Namespaces are named ``tgsl-<pid of the test process>-<run id>-<role>``."""

TOOLS = ("ip", "nsenter", "unshare", "hostname", "munged", "mungekey", "slurmctld", "slurmd", "sbatch", "srun",
         "sinfo", "scontrol", "scancel")


def require_slurm() -> None:
    """Fails (never skips) where the cluster cannot be made: CI runs these tests as root after
    scripts/setup.sh installed slurm-wlm and munge."""
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if os.geteuid() != 0 or missing:
        pytest.fail(f"Slurm tests need root and {missing or 'these tools'} (Debian's slurm-wlm, munge, iproute2, "
                    f"util-linux; scripts/setup.sh installs them); running as uid {os.geteuid()}")


def _in_host(ns: str, hostname: str, hosts_file: Path, argv: list[str], *, own_shm: bool = False) -> list[str]:
    """argv run in ``ns``'s network, with its own hostname and /etc/hosts (private mount and UTS
    namespaces, so neither leaks to the machine); ``own_shm``: a /dev/shm of its own too, as a
    real node has (its tmpfs goes when the last process of the mount namespace ends)."""
    shm = "mount -t tmpfs -o mode=1777 tmpfs /dev/shm && " if own_shm else ""
    script = f'hostname "$1" && mount --bind "$2" /etc/hosts && {shm}shift 2 && exec "$@"'
    return ["nsenter", f"--net=/run/netns/{ns}", "unshare", "--mount", "--uts", "--", "sh", "-c", script, "sh",
            hostname, str(hosts_file), *argv]


@dataclass
class Node:
    name: str
    ns: str
    addr: str
    bridge_port: str
    root: Path
    state_dir: Path
    """The node daemon's state directory (``agents=True``), its ranks' ``TRAINGUARD_STATE_DIR``:
    under /tmp, as its socket paths must fit AF_UNIX's 108 bytes."""
    proc: subprocess.Popen[bytes] | None = None
    agent: subprocess.Popen[bytes] | None = None
    killed: bool = False

    def pids(self) -> list[int]:
        return pids_in(self.ns)


class SlurmCluster:
    """slurmctld in the controller's namespace, one slurmd per node, one munged for all."""

    def __init__(self, root: Path, nodes: Iterable[str] = ("n1", "n2"), *, cpus: int = 2,
                 slurmd_timeout: int = 3, message_timeout: int = 2, agents: bool = False) -> None:
        """``slurmd_timeout``/``message_timeout``: how soon the controller marks a silent node DOWN
        (Slurm's defaults, 300 s and 10 s, take minutes; these take seconds). ``agents``: a
        ``trainguard agent`` on every node as its daemon, which Slurm's TaskProlog names to each
        task in ``TRAINGUARD_STATE_DIR`` (as a site would name a daemon not at the default paths)."""
        require_slurm()
        sweep_stale(PREFIX, (Path("/tmp"),))
        self.root = root
        self.run_id = secrets.token_hex(3)
        base = f"{PREFIX}{os.getpid()}-{self.run_id}"
        self.ctl_ns = f"{base}-ctl"
        self.nodes = {name: Node(name, f"{base}-{name}", f"{SUBNET}.{11 + i}", f"v{self.run_id}{i}",
                                 root / "nodes" / name, Path("/tmp") / base / name / "agent")
                      for i, name in enumerate(nodes)}
        self.agents = agents
        self.cpus = cpus
        self.slurmd_timeout = slurmd_timeout
        self.message_timeout = message_timeout
        self.namespaces: list[str] = []
        self.munged: subprocess.Popen[bytes] | None = None
        self.slurmctld: subprocess.Popen[bytes] | None = None
        self.clients: list[subprocess.Popen[bytes]] = []
        self.etc = root / "etc"
        self.rundir = root / "run"
        self.logs = root / "log"
        self.conf = self.etc / "slurm.conf"
        self.hosts_file = self.etc / "hosts"
        # munged refuses a socket or key below a directory others cannot search (pytest's are 0700),
        # and unix socket paths must be short: both live under /tmp
        self.short_dir = Path("/tmp") / base
        self.munge_socket = self.short_dir / "run" / "munge.sock"

    # -- set-up --------------------------------------------------------------------------------

    def start(self, timeout: float = 60.0) -> SlurmCluster:
        for d in (self.etc, self.rundir, self.logs, self.root / "state", self.root / "jobs"):
            d.mkdir(parents=True, exist_ok=True)
        self.short_dir.mkdir(mode=0o755)
        for node in self.nodes.values():
            (self.root / "spool" / node.name).mkdir(parents=True, exist_ok=True)
            node.root.mkdir(parents=True, exist_ok=True)
            node.state_dir.parent.mkdir(mode=0o700)
        prolog = self.etc / "task-prolog.sh"
        prolog.write_text(f'#!/bin/sh\necho "export TRAINGUARD_STATE_DIR={self.short_dir}/$(hostname)/agent"\n'
                          if self.agents else "#!/bin/sh\n")
        prolog.chmod(0o755)
        self.hosts_file.write_text(f"127.0.0.1 localhost\n{CTL_ADDR} {CTL_NAME}\n"
                                   + "".join(f"{n.addr} {n.name}\n" for n in self.nodes.values()))
        self.conf.write_text(self.slurm_conf())
        self._start_munged()
        self._network()
        self.slurmctld = self._daemon(self.ctl_ns, CTL_NAME, ["slurmctld", "-D", "-f", str(self.conf)], "slurmctld")
        for node in self.nodes.values():
            node.proc = self._daemon(node.ns, node.name, ["slurmd", "-D", "-f", str(self.conf)], f"slurmd-{node.name}",
                                     own_shm=True)
        self.wait_states(dict.fromkeys(self.nodes, "idle"), timeout)
        if self.agents:
            for node in self.nodes.values():
                node.agent = self._start_agent(node)
            for node in self.nodes.values():
                self._wait_agent(node, timeout)
        return self

    def _start_agent(self, node: Node) -> subprocess.Popen[bytes]:
        """The agent joins slurmd's namespaces (network, hostname, mounts): it shares the node's
        /dev/shm with the ranks Slurm starts there."""
        assert node.proc is not None
        cfg = node.root / "agent.toml"
        # one cgroup tree for every namespace: job cgroups would collide
        cfg.write_text(f'[agent]\nnode = "{node.name}"\ninterval_s = 0.25\n'
                       '[collectors]\nebpf = false\ngpu = false\n[launcher]\ncgroups = "off"\n'
                       '[checkpoint]\nmemory_every = 4\nmemory_keep = 3\n')
        argv = ["nsenter", f"--target={node.proc.pid}", "--net", "--uts", "--mount", "--", sys.executable, "-m",
                "trainguard", "agent", "--state-dir", str(node.state_dir), "--config", str(cfg),
                "--metrics-addr", "127.0.0.1:0"]
        with open(self.logs / f"agent-{node.name}.out", "ab") as out:
            return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=self.env(), cwd=REPO)

    def _wait_agent(self, node: Node, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        sock = node.state_dir / "run" / "agent.sock"
        while not sock.exists():
            assert node.agent is not None
            if node.agent.poll() is not None:
                raise RuntimeError(f"agent on {node.name} exited {node.agent.returncode}\n{self.diagnose()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"agent on {node.name} not up in {timeout} s\n{self.diagnose()}")
            time.sleep(0.1)

    def slurm_conf(self) -> str:
        r = self.root
        return (
            "ClusterName=tgtest\n"
            f"SlurmctldHost={CTL_NAME}({CTL_ADDR})\n"
            f"AuthInfo=socket={self.munge_socket}\n"
            "SlurmUser=root\nSlurmdUser=root\n"
            "ProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\n"
            "SelectType=select/cons_tres\nSelectTypeParameters=CR_CPU\n"
            "AccountingStorageType=accounting_storage/none\nJobAcctGatherType=jobacct_gather/none\n"
            "SwitchType=switch/none\nMpiDefault=none\nMailProg=/bin/true\n"
            "ReturnToService=2\n"
            f"SlurmdTimeout={self.slurmd_timeout}\nMessageTimeout={self.message_timeout}\n"
            "KillWait=2\nInactiveLimit=0\nWaitTime=0\n"
            f"TaskProlog={self.etc}/task-prolog.sh\n"
            f"StateSaveLocation={r}/state\nSlurmdSpoolDir={r}/spool/%n\n"
            f"SlurmctldPidFile={r}/run/slurmctld.pid\nSlurmdPidFile={r}/run/slurmd-%n.pid\n"
            f"SlurmctldLogFile={self.logs}/slurmctld.log\nSlurmdLogFile={self.logs}/slurmd-%n.log\n"
            "SlurmctldDebug=info\nSlurmdDebug=info\n"
            + "".join(f"NodeName={n.name} NodeAddr={n.addr} CPUs={self.cpus} State=UNKNOWN\n"
                      for n in self.nodes.values())
            + f"PartitionName=main Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP\n"
        )

    def _start_munged(self) -> None:
        key_dir = self.short_dir / "key"
        key_dir.mkdir(mode=0o700)
        self.munge_socket.parent.mkdir(mode=0o755)
        key = key_dir / "munge.key"
        run("mungekey", "-c", "-k", str(key))
        os.chmod(key, 0o600)
        args = ["munged", "-F", f"--socket={self.munge_socket}", f"--key-file={key}",
                f"--pid-file={self.munge_socket.parent}/munged.pid", f"--seed-file={key_dir}/munge.seed",
                f"--log-file={self.logs}/munged.log"]
        with open(self.logs / "munged.out", "ab") as out:
            self.munged = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 15
        while not self.munge_socket.exists():
            if self.munged.poll() is not None:
                raise RuntimeError(f"munged exited {self.munged.returncode}: {self.log('munged.out')}"
                                   f"{self.log('munged.log')}")
            if time.monotonic() > deadline:
                raise RuntimeError("munged made no socket in 15 s")
            time.sleep(0.05)

    def _network(self) -> None:
        ctl = self.ctl_ns
        self._add_ns(ctl)
        run("ip", "-n", ctl, "link", "set", "lo", "up")
        run("ip", "-n", ctl, "link", "add", "br0", "type", "bridge")
        run("ip", "-n", ctl, "link", "set", "br0", "up")
        run("ip", "-n", ctl, "addr", "add", f"{CTL_ADDR}/24", "dev", "br0")
        for node in self.nodes.values():
            self._add_ns(node.ns)
            run("ip", "-n", ctl, "link", "add", node.bridge_port, "type", "veth", "peer", "name", "eth0",
                "netns", node.ns)
            run("ip", "-n", ctl, "link", "set", node.bridge_port, "master", "br0")
            run("ip", "-n", ctl, "link", "set", node.bridge_port, "up")
            run("ip", "-n", node.ns, "link", "set", "lo", "up")
            run("ip", "-n", node.ns, "addr", "add", f"{node.addr}/24", "dev", "eth0")
            run("ip", "-n", node.ns, "link", "set", "eth0", "up")

    def _add_ns(self, ns: str) -> None:
        run("ip", "netns", "add", ns)
        self.namespaces.append(ns)

    def _daemon(self, ns: str, hostname: str, argv: list[str], log: str, *,
                own_shm: bool = False) -> subprocess.Popen[bytes]:
        with open(self.logs / f"{log}.out", "ab") as out:
            return subprocess.Popen(_in_host(ns, hostname, self.hosts_file, argv, own_shm=own_shm), stdout=out,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=self.env())

    # -- clients -------------------------------------------------------------------------------

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        """What clients and (through Slurm's default ``--export=ALL``) every job step see: this
        cluster's slurm.conf, the repository under test first on PYTHONPATH and this interpreter's
        bin directory (the venv's ``python`` and ``trainguard``) first on PATH."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PYTEST_", "TRAINGUARD_"))}
        env["SLURM_CONF"] = str(self.conf)
        env["PYTHONPATH"] = str(REPO)
        env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '/usr/sbin:/usr/bin:/sbin:/bin')}"
        env.update(extra or {})
        return env

    def client_argv(self, argv: list[str]) -> list[str]:
        return _in_host(self.ctl_ns, CTL_NAME, self.hosts_file, argv)

    def client(self, *argv: str, timeout: float = 30.0, check: bool = True,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """A Slurm client command run in the controller's namespace."""
        proc = subprocess.run(self.client_argv(list(argv)), capture_output=True, text=True, timeout=timeout,
                              check=False, env=self.env(env), cwd=self.root)
        if check and proc.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} exited {proc.returncode}: {proc.stderr.strip()}\n{self.diagnose()}")
        return proc

    def popen(self, *argv: str, log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        """A client left running (a blocking ``srun``), its output in ``log``; ``close`` kills it
        with everything else in the controller's namespace."""
        with open(log, "ab") as out:
            proc = subprocess.Popen(self.client_argv(list(argv)), stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env=self.env(env), cwd=self.root)
        self.clients.append(proc)
        return proc

    def sbatch(self, script: str, *options: str, env: dict[str, str] | None = None) -> str:
        """Submits ``script`` (its text) and returns the job id."""
        path = self.root / "jobs" / f"job-{secrets.token_hex(3)}.sh"
        path.write_text(script)
        out = self.client("sbatch", "--parsable", f"--chdir={self.root / 'jobs'}", *options, str(path), env=env)
        return out.stdout.strip().split(";", 1)[0]

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job``'s fields (JobState, NodeList, ExitCode ...); empty once it is gone."""
        proc = self.client("scontrol", "-o", "show", "job", job_id, check=False)
        fields: dict[str, str] = {}
        for word in proc.stdout.split():
            key, sep, value = word.partition("=")
            if sep:
                fields[key] = value
        return fields

    def wait_job(self, job_id: str, states: Iterable[str], timeout: float) -> dict[str, str]:
        """Waits until the job is in one of ``states``; fails with the cluster's logs."""
        wanted = set(states)
        deadline = time.monotonic() + timeout
        while True:
            fields = self.job(job_id)
            if fields.get("JobState") in wanted:
                return fields
            if time.monotonic() > deadline:
                raise AssertionError(f"job {job_id} not {sorted(wanted)} in {timeout} s: {fields}\n{self.diagnose()}")
            time.sleep(0.2)

    def node_states(self) -> dict[str, str]:
        out = self.client("sinfo", "-h", "-N", "-o", "%N %t", check=False).stdout
        states: dict[str, str] = {}
        for line in out.splitlines():
            if len(parts := line.split()) == 2:
                states[parts[0]] = parts[1].rstrip("*~#!%$@^-")
        return states

    def wait_states(self, wanted: dict[str, str], timeout: float) -> dict[str, str]:
        """Waits until each named node is in its state (sinfo's short names: idle, alloc, down ...)."""
        deadline = time.monotonic() + timeout
        while True:
            for name, proc in self._daemons(alive=True):
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited {proc.returncode}\n{self.diagnose()}")
            states = self.node_states()
            if all(states.get(n) == s for n, s in wanted.items()):
                return states
            if time.monotonic() > deadline:
                raise AssertionError(f"nodes {states} not {wanted} in {timeout} s\n{self.diagnose()}")
            time.sleep(0.1)

    # -- faults --------------------------------------------------------------------------------

    def kill_node(self, name: str) -> float:
        """SIGKILL of every process in the node's namespace (slurmd, step daemons, tasks) at once;
        returns when."""
        node = self.nodes[name]
        node.killed = True
        at = time.time()
        deadline = time.monotonic() + 15
        while (pids := node.pids()) and time.monotonic() < deadline:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)
        for proc in (node.proc, node.agent):
            if proc is not None:
                proc.wait(15)
        return at

    # -- diagnosis -----------------------------------------------------------------------------

    def log(self, name: str, tail: int = 2500) -> str:
        try:
            return (self.logs / name).read_text(errors="replace")[-tail:]
        except FileNotFoundError:
            return ""

    def diagnose(self) -> str:
        parts = [f"--- {p.name} ---\n{p.read_text(errors='replace')[-2000:]}"
                 for p in sorted(self.logs.glob("*")) if p.is_file() and p.stat().st_size]
        return "\n".join(parts)

    # -- teardown ------------------------------------------------------------------------------

    def _daemons(self, alive: bool = False) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
        """Every daemon started; ``alive``: those not killed on purpose."""
        if self.slurmctld is not None:
            yield "slurmctld", self.slurmctld
        for node in self.nodes.values():
            if alive and node.killed:
                continue
            if node.proc is not None:
                yield f"slurmd {node.name}", node.proc
            if node.agent is not None:
                yield f"agent {node.name}", node.agent

    def close(self) -> None:
        """Everything in every namespace is SIGKILLed (jobs, step daemons, slurmd, slurmctld,
        clients), each daemon reaped, munged stopped and the namespaces removed."""
        for ns in reversed(self.namespaces):
            kill_all_in(ns)
        for proc in [*self.clients, *(p for _, p in self._daemons())]:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)
        if self.munged is not None:
            if self.munged.poll() is None:
                self.munged.terminate()
                try:
                    self.munged.wait(5)
                except subprocess.TimeoutExpired:
                    self.munged.kill()
            self.munged.wait(10)
        for ns in reversed(self.namespaces):
            run("ip", "netns", "del", ns, check=False)
        shutil.rmtree(self.short_dir, ignore_errors=True)

    def __enter__(self) -> SlurmCluster:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()
