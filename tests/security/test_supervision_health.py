"""Supervision that cannot die quietly: a loop iteration that raises is counted and survived, and a
loop that hangs stops the systemd watchdog feed and shows in status and /metrics."""

from __future__ import annotations

import contextlib
import socket
import sys
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import in_process_agent_config
from tests.helpers.telemetry import make_msg
from tests.helpers.waiting import wait_for
from trainguard.agent.daemon import Agent
from trainguard.agent.lifecycle.jobs import JobSpec


def _events(agent: Agent, kind: str) -> list[dict[str, Any]]:
    return [{**e, **e.get("fields", {})} for e in agent.events.since(0, 10_000) if e["kind"] == kind]


def _scrape(agent: Agent) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{agent.metrics_port}/metrics", timeout=10) as resp:
        return str(resp.read().decode())


@pytest.fixture
def notify_socket(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[socket.socket]:
    """A unix datagram socket standing in for systemd's $NOTIFY_SOCKET."""
    path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(0.2)
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    try:
        yield sock
    finally:
        sock.close()


def _drain(sock: socket.socket) -> list[str]:
    out = []
    while True:
        try:
            out.append(sock.recv(4096).decode())
        except (TimeoutError, BlockingIOError):
            return out


def _agent(tmp_path: Path, stale_s: float = 60.0) -> Agent:
    cfg = in_process_agent_config(tmp_path / "agent")
    cfg.recovery.warm_launcher = False
    cfg.launcher.cgroups = "off"
    cfg.agent.heartbeat_stale_s = stale_s
    agent = Agent(cfg)
    agent.start()
    return agent


def test_rank_monitor_survives_a_collaborator_that_raises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    agent = _agent(tmp_path)
    try:
        launcher = agent.supervisor.launcher
        real_reap = launcher.reap
        failures = {"left": 5}

        def reap(ranks: Any) -> Any:
            if failures["left"] > 0:
                failures["left"] -= 1
                raise MemoryError("forged: skeleton_bytes too large")
            return real_reap(ranks)

        monkeypatch.setattr(launcher, "reap", reap)
        record = agent.supervisor.submit(JobSpec("fragile", 1, command=[sys.executable, "-c", "pass"], max_restarts=0))
        # The rank exits at once; it is reaped only if the monitor thread lived through five MemoryErrors.
        wait_for(lambda: record.state.finished, 60, "the job's rank to be reaped")
        assert record.state.value == "succeeded", (record.state, record.reason)
        assert agent.supervisor._thread.is_alive()
        threads = {t.name: t for t in agent.health.check()}
        assert threads["rank-monitor"].healthy
        assert threads["rank-monitor"].errors == 5
        assert "MemoryError" in threads["rank-monitor"].last_error
        failed = _events(agent, "thread_iteration_failed")
        assert failed and failed[0]["thread"] == "rank-monitor"
        assert 'trainguard_thread_errors_total{thread="rank-monitor"} 5.0' in _scrape(agent)
    finally:
        agent.shutdown()


def test_telemetry_thread_survives_a_table_that_raises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    agent = _agent(tmp_path)
    try:
        real_add = agent.table.add_many
        calls = {"n": 0}

        def add_many(msgs: Any, now: Any = None) -> Any:
            calls["n"] += 1
            if calls["n"] == 1:
                raise RuntimeError("table bug")
            return real_add(msgs, now)

        monkeypatch.setattr(agent.table, "add_many", add_many)
        sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            sender.sendto(make_msg("ext", rank=0, step=1).encode(), agent.paths.telemetry_socket)
            wait_for(lambda: calls["n"] >= 1, 10, "the first datagram")
            sender.sendto(make_msg("ext", rank=0, step=2).encode(), agent.paths.telemetry_socket)
            wait_for(lambda: agent.table.latest("ext", 0) is not None, 10, "the second datagram to be stored")
        finally:
            sender.close()
        assert agent.telemetry.dropped_total.get("internal") == 1
        assert {t.name: t.errors for t in agent.health.check()}["telemetry"] == 1
    finally:
        agent.shutdown()


def test_a_hung_thread_stops_the_watchdog_feed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               notify_socket: socket.socket) -> None:
    agent = _agent(tmp_path, stale_s=0.5)
    release = threading.Event()
    try:
        _drain(notify_socket)
        assert agent.feed_watchdog()
        assert "WATCHDOG=1" in _drain(notify_socket)

        def hang(msgs: Any, now: Any = None) -> Any:
            release.wait(30)
            raise RuntimeError("released")

        monkeypatch.setattr(agent.table, "add_many", hang)
        sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        with contextlib.closing(sender):
            sender.sendto(make_msg("ext", rank=0, step=1).encode(), agent.paths.telemetry_socket)
        wait_for(lambda: not agent.health.healthy(), 10, "the telemetry thread to be found stuck")
        assert not agent.feed_watchdog()
        assert not any("WATCHDOG=1" in m for m in _drain(notify_socket))
        status = agent.control.status()
        assert status["healthy"] is False
        stuck = [t for t in status["threads"] if not t["healthy"]]
        assert [t["name"] for t in stuck] == ["telemetry"] and stuck[0]["reason"] == "stuck"
        text = _scrape(agent)
        assert "trainguard_agent_healthy 0.0" in text
        assert 'trainguard_thread_healthy{thread="telemetry"} 0.0' in text
        assert 'trainguard_thread_healthy{thread="rank-monitor"} 1.0' in text
        assert _events(agent, "thread_unhealthy")[0]["thread"] == "telemetry"

        release.set()  # the thread goes round again: the feed resumes
        wait_for(lambda: agent.health.healthy(), 10, "the telemetry thread to beat again")
        assert agent.feed_watchdog()
        assert "WATCHDOG=1" in _drain(notify_socket)
    finally:
        release.set()
        agent.shutdown()
