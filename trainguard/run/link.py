"""The trainer's side of the agent contract (agent/wire.py): telemetry out, plan in.

Training must never wait on the agent and never fail because of it: every call here is
non-blocking, swallows OS errors, and costs a syscall or two per step.
"""

from __future__ import annotations

import atexit
import math
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

from trainguard.agent.wire import (
    ENV_PLAN,
    ENV_SOCKET,
    MAX_DATAGRAM_BYTES,
    MAX_MESSAGE_BYTES,
    Plan,
    Telemetry,
    read_plan_file,
)

FLUSH_S = 0.25
"""Seconds between two telemetry datagrams (messages in between wait for the next one). A quarter
of the agent's 1 s detection interval, so its detectors see every rank's steps at most that late.
Each datagram wakes the agent, which on a node whose cores the ranks fill then takes a rank's core
to decode it: one per 33 ms step cost a 4-rank job on 2 cores ~0.5 ms a step on each rank (~1.5 %
of its training time, bench/recovery.py's job)."""


@dataclass
class LinkStats:
    sent: int = 0
    dropped: int = 0


class TelemetrySender:
    """Fire-and-forget datagrams to the agent's telemetry socket.

    Messages are gathered and sent together, one per line, once ``flush_s`` has passed since the
    last send (or the datagram would grow too large): each message would otherwise cost a
    datagram, a wake-up of the agent and, on a node with few cores, the agent's turn on this rank's
    CPU. A step longer than ``flush_s`` is sent at once, as is anything ``urgent``; what
    is gathered goes at ``flush``/``close`` (and at exit). With no socket configured, or no agent
    listening, messages are dropped and counted.
    """

    def __init__(self, path: str | None, flush_s: float = FLUSH_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.path = path
        self.stats = LinkStats()
        self.flush_s = flush_s
        self._clock = clock
        self._sock: socket.socket | None = None
        self._held: list[bytes] = []
        self._held_bytes = 0
        self._last_send = -math.inf
        self._pid = os.getpid()
        if path:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self._sock.setblocking(False)
            atexit.register(self.flush)

    @classmethod
    def from_env(cls) -> TelemetrySender:
        return cls(os.environ.get(ENV_SOCKET) or None)

    def send(self, msg: Telemetry, urgent: bool = False) -> bool:
        """Queue ``msg``; True once it was sent or is held for the next send (False: dropped)."""
        if self._sock is None or self.path is None:
            self.stats.dropped += 1
            return False
        data = msg.encode()
        if len(data) > MAX_MESSAGE_BYTES:
            self.stats.dropped += 1
            return False
        if self._held_bytes + len(data) + 1 > MAX_DATAGRAM_BYTES:
            self.flush()
        self._held.append(data)
        self._held_bytes += len(data) + 1
        if urgent or self._clock() - self._last_send >= self.flush_s:
            return self.flush()
        return True

    def flush(self) -> bool:
        """Send what is held now; False when it was dropped (no agent, a full queue)."""
        if not self._held or self._sock is None or self.path is None:
            return True
        if os.getpid() != self._pid:  # a forked child exiting: the steps held are its parent's
            self._held, self._held_bytes = [], 0
            return True
        held, self._held, self._held_bytes = self._held, [], 0
        self._last_send = self._clock()
        try:
            self._sock.sendto(b"\n".join(held), self.path)
        except (OSError, ValueError):
            # No agent, a full queue (EAGAIN) or a too-large message: training goes on.
            self.stats.dropped += len(held)
            return False
        self.stats.sent += len(held)
        return True

    def close(self) -> None:
        if self._sock is not None:
            self.flush()
            atexit.unregister(self.flush)
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
