"""Shared fixtures: a real agent process on a temporary state directory."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from trainguard.agent.config import AgentConfig, apply_state_dir
from trainguard.demo.nodefaults import CpuCgroup, cpu_cgroup_unavailable

REPO = Path(__file__).resolve().parents[1]

CPU_ISOLATION = "cpu_isolation"
"""xdist group of the tests that pin processes to CPUs, raise cgroup CPU weights and judge timing
against that: two of them at once on the 2-core machine contend with each other's hogs (CI saw a
hog-sharing rank blamed on "unknown" because the other worker's hogs slowed its healthy peer too)."""


@dataclass
class RunningAgent:
    proc: subprocess.Popen[bytes]
    state_dir: Path
    log_path: Path

    @property
    def control_socket(self) -> str:
        return str(self.state_dir / "run" / "agent.sock")

    @property
    def telemetry_socket(self) -> str:
        return str(self.state_dir / "run" / "telemetry.sock")

    def metrics_url(self) -> str:
        addr = (self.state_dir / "run" / "metrics.addr").read_text().strip()
        host, port = addr.rsplit(":", 1)
        return f"http://127.0.0.1:{port}/metrics"

    def client(self):  # noqa: ANN201
        from trainguard.agent.api.client import ApiClient

        return ApiClient.local(self.control_socket)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout)


def job_events(agent: RunningAgent, job: str, kind: str) -> list[dict[str, Any]]:
    """Every event of ``kind`` the agent logged for ``job``."""
    return [e for e in agent.client().events(since=0, limit=10000, kind=kind)["events"] if e.get("job") == job]


def start_agent(state_dir: Path, config: str | None = None, extra: list[str] | None = None, env: dict[str, str] | None = None,
                prefix: list[str] | None = None) -> RunningAgent:
    """``prefix``: argv run before the interpreter (e.g. ``setpriv`` dropping capabilities as the unit does)."""
    state_dir.mkdir(parents=True, exist_ok=True)
    args = [*(prefix or []), sys.executable, "-m", "trainguard", "agent", "--state-dir", str(state_dir), "--metrics-addr", "127.0.0.1:0"]
    if config is not None:
        cfg_path = state_dir / "agent.toml"
        cfg_path.write_text(config)
        args += ["--config", str(cfg_path)]
    args += extra or []
    log_path = state_dir / "agent.log"
    full_env = dict(os.environ)
    full_env["PYTHONPATH"] = str(REPO)
    full_env.update(env or {})
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=full_env)
    agent = RunningAgent(proc, state_dir, log_path)
    deadline = time.monotonic() + 60
    addr_file = state_dir / "run" / "metrics.addr"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"agent exited with {proc.returncode}:\n{agent.log()}")
        if os.path.exists(agent.control_socket) and addr_file.exists():
            return agent
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"agent did not come up:\n{agent.log()}")


@pytest.fixture
def agent_factory(tmp_path: Path) -> Iterator:
    started: list[RunningAgent] = []

    def factory(name: str = "agent", **kwargs) -> RunningAgent:  # noqa: ANN003
        agent = start_agent(tmp_path / name, **kwargs)
        started.append(agent)
        return agent

    yield factory
    for agent in started:
        if agent.proc.poll() is None:
            agent.proc.send_signal(signal.SIGTERM)
            try:
                agent.proc.wait(30)
            except subprocess.TimeoutExpired:
                agent.proc.kill()
                agent.proc.wait()


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A real 1 MiB filesystem that fills up: the disk-full paths are tested against it."""
    if os.geteuid() != 0:
        # test_disk_tier_write_error_leaves_nothing_half_written checks the same path without root.
        pytest.skip("mounting a 1 MiB tmpfs needs root (the CI and this machine run as root)")
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.fixture
def cpu_priority() -> Iterator[None]:
    """This test process, and so the agents and ranks it starts, in a CPU cgroup with 10x the default
    weight while the test runs: the other xdist worker's load (CI runs two) must not make stragglers
    of the healthy ranks a test judges, nor hide a throttled one (CI saw both)."""
    if cpu_cgroup_unavailable() is not None:
        yield  # not root: timing then competes with the rest of the machine, as on a busy node
        return
    group = CpuCgroup("tg-test-prio")
    group.weight(10)
    group.add(os.getpid())
    try:
        yield
    finally:
        group.remove()


def in_process_agent_config(state_dir: Path) -> AgentConfig:
    """An agent config for a daemon run inside the test's process: its state under ``state_dir``,
    metrics on a free loopback port, no eBPF or GPU collector."""
    cfg = apply_state_dir(AgentConfig(), str(state_dir))
    cfg.metrics.addr = "127.0.0.1:0"
    cfg.collectors.ebpf = False
    cfg.collectors.gpu = False
    return cfg


def join_ranks(ctx: Any, what: str, timeout: float = 240.0) -> None:
    """Join ranks forked with ``torch.multiprocessing.start_processes(join=False)``: a rank's
    exception is raised here with its traceback, and ranks still running at the end (a hang past
    ``timeout``, pytest's own timeout, a rank that failed) are killed, not left to the rest of the
    suite."""
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=1.0):  # raises ProcessRaisedException with the child's traceback
            if time.monotonic() > deadline:
                pytest.fail(f"{what} ranks did not finish in {timeout} s")
    finally:
        for process in ctx.processes:
            if process.is_alive():
                process.kill()
                process.join(10)
