"""The trainer's side of the agent contract (agent/wire.py): telemetry out, plan in.

Training must never wait on the agent and never fail because of it: every call here is
non-blocking, swallows OS errors, and costs a syscall or two per step.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from trainguard.agent.wire import ENV_PLAN, ENV_SOCKET, Plan, Telemetry, read_plan_file


@dataclass
class LinkStats:
    sent: int = 0
    dropped: int = 0


class TelemetrySender:
    """Fire-and-forget datagrams to the agent's telemetry socket.

    With no socket configured, or no agent listening, ``send`` drops the message and counts it.
    """

    def __init__(self, path: str | None) -> None:
        self.path = path
        self.stats = LinkStats()
        self._sock: socket.socket | None = None
        if path:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self._sock.setblocking(False)

    @classmethod
    def from_env(cls) -> TelemetrySender:
        return cls(os.environ.get(ENV_SOCKET) or None)

    def send(self, msg: Telemetry) -> bool:
        if self._sock is None or self.path is None:
            self.stats.dropped += 1
            return False
        try:
            self._sock.sendto(msg.encode(), self.path)
        except (OSError, ValueError):
            # No agent, a full queue (EAGAIN) or a too-large message: training goes on.
            self.stats.dropped += 1
            return False
        self.stats.sent += 1
        return True

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


class PlanWatcher:
    """Reads the agent's plan file when it changed since the last look (one ``stat`` per call)."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self._seen: tuple[int, int] | None = None
        self.current = Plan()

    @classmethod
    def from_env(cls) -> PlanWatcher:
        return cls(os.environ.get(ENV_PLAN) or None)

    def poll(self) -> Plan:
        """The newest valid plan; the previous one when the file is missing, unchanged or bad."""
        if not self.path:
            return self.current
        try:
            st = os.stat(self.path)
        except OSError:
            return self.current
        key = (st.st_mtime_ns, st.st_size)
        if key == self._seen:
            return self.current
        plan = read_plan_file(self.path)
        self._seen = key
        if plan is not None and plan.version >= self.current.version:
            self.current = plan
        return self.current
