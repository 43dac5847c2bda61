"""sd_notify over a real unix datagram socket, and the unit file through systemd-analyze."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

from trainguard.agent.config import load_config
from trainguard.agent.recovery.service import memory_root_for
from trainguard.agent.sdnotify import Notifier

UNIT = Path(__file__).resolve().parents[2] / "agent" / "systemd" / "trainguard-agent.service"


def test_notify_messages_arrive(tmp_path, monkeypatch) -> None:
    path = str(tmp_path / "notify.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    server.bind(path)
    server.settimeout(2)
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    n = Notifier()
    assert n.enabled
    n.ready("1 job running")
    n.watchdog()
    n.status("busy")
    n.stopping()
    got = [server.recv(4096).decode() for _ in range(4)]
    assert got[0].splitlines()[:2] == ["READY=1", "STATUS=1 job running"]
    assert f"MAINPID={os.getpid()}" in got[0]
    assert got[1:] == ["WATCHDOG=1", "STATUS=busy", "STOPPING=1"]
    server.close()


def test_abstract_socket_and_disabled(monkeypatch) -> None:
    name = f"trainguard-test-{os.getpid()}"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    server.bind("\0" + name)
    server.settimeout(2)
    assert Notifier(f"@{name}").watchdog()
    assert server.recv(100) == b"WATCHDOG=1"
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    quiet = Notifier()
    assert not quiet.enabled and not quiet.ready("x")


def test_watchdog_interval(monkeypatch) -> None:
    monkeypatch.setenv("WATCHDOG_USEC", "30000000")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert Notifier.watchdog_interval_s() == 15.0
    monkeypatch.setenv("WATCHDOG_PID", "1")
    assert Notifier.watchdog_interval_s() is None


def test_unit_hardening_settings() -> None:
    text = UNIT.read_text()
    settings = dict(line.split("=", 1) for line in text.splitlines() if "=" in line and not line.startswith("#"))
    assert settings["Type"] == "notify"
    assert int(settings["WatchdogSec"]) > 0
    assert settings["ProtectSystem"] == "strict"
    assert settings["NoNewPrivileges"] == "yes"
    caps = settings["CapabilityBoundingSet"].split()
    for cap in ("CAP_BPF", "CAP_PERFMON", "CAP_KILL", "CAP_SYS_PTRACE"):
        assert cap in caps
    assert "CAP_SYS_ADMIN" not in caps
    writable = settings["ReadWritePaths"].split()
    assert "/var/lib/trainguard" in writable and "/run/trainguard" in writable
    # /dev/shm as a whole is not the agent's: only the memory root its default config uses.
    assert "/dev/shm" not in writable and "/dev/shm" in settings["ReadOnlyPaths"].split()
    shm = [p for p in writable if p.startswith("/dev/shm/")]
    assert shm == [memory_root_for(load_config(None))], shm
    assert f"d={shm[0]};" in text  # ExecStartPre= makes that one, safely, before the sandbox binds it
    for key in ("MemoryMax", "TasksMax"):
        assert settings.get(key), f"{key}= missing"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed (test_unit_hardening_settings still checks the unit)")
def test_systemd_analyze_verify(tmp_path) -> None:
    # verify checks that ExecStart exists; point it at this checkout's interpreter.
    unit = tmp_path / "trainguard-agent.service"
    unit.write_text(UNIT.read_text().replace("/usr/local/bin/trainguard", shutil.which("python3") or "/usr/bin/python3"))
    res = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "Unknown" not in res.stderr and "Failed" not in res.stderr, res.stderr


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed (test_unit_hardening_settings still checks the unit)")
def test_exposure_stays_at_or_below_2_6() -> None:
    """`systemd-analyze security` of the unit, a score (5.7 before the ranks ran as units of their
    own, 3.5 before #41's hardening): a unit change that widens the sandbox fails here."""
    res = subprocess.run(["systemd-analyze", "security", "--offline=yes", str(UNIT)], capture_output=True, text=True)
    line = next(ln for ln in res.stdout.splitlines() if "Overall exposure level" in ln)
    assert float(line.split(":")[1].split()[0]) <= 2.6, line

