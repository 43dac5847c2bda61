"""Durable event log: one JSON object per line, flushed and fsync'd per event, rotated by size.

Every detection, decision and action the agent takes is an event with its cause. An agent killed
mid-write leaves at most one torn last line, which readers skip; sequence numbers continue across
restarts so API cursors stay valid.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

LOG_NAME = "events.jsonl"

SEVERITIES = ("debug", "info", "warning", "error", "critical")

MAX_FIELD_CHARS = 512
"""Longest string kept in an event field: a request path or a rank's error text from outside is
cut here, so a flood of auth failures cannot rotate the audit trail away with big lines."""
MAX_MESSAGE_CHARS = 2048
"""Longest message or cause kept (messages quote some fields)."""
LONG_FIELDS = {"stacks": 16384}
"""Fields the agent fills with long text of its own (py-spy stacks of hung ranks), per string."""
_MAX_ITEMS = 256
"""Most entries of one list or mapping kept in a field."""


def _cut(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return f"{text[:limit]}...[{len(text) - limit} more chars cut]"


def bound_field(value: Any, limit: int = MAX_FIELD_CHARS, depth: int = 0) -> Any:
    """``value`` with every string cut to ``limit`` characters and every container to a bounded
    size and depth, so no event line grows with what an outsider sent."""
    if isinstance(value, str):
        return _cut(value, limit)
    if isinstance(value, bytes):
        return _cut(value.decode("utf-8", "replace"), limit)
    if value is None or isinstance(value, (bool, int, float)):
        return value
    if depth >= 4:
        return _cut(str(value), limit)
    if isinstance(value, dict):
        items = list(value.items())
        out = {_cut(str(k), limit): bound_field(v, limit, depth + 1) for k, v in items[:_MAX_ITEMS]}
        if len(items) > _MAX_ITEMS:
            out["..."] = f"{len(items) - _MAX_ITEMS} more entries cut"
        return out
    if isinstance(value, (list, tuple, set, frozenset)):
        seq = list(value)
        cut = [bound_field(v, limit, depth + 1) for v in seq[:_MAX_ITEMS]]
        if len(seq) > _MAX_ITEMS:
            cut.append(f"...{len(seq) - _MAX_ITEMS} more items cut")
        return cut
    return _cut(str(value), limit)


REDACTED = "<redacted>"


def redact_env(value: Any) -> Any:
    """``value`` with every job environment in it (an ``env`` mapping, also inside a job spec)
    shown by its variable names only: events are read with any token, and a job's env holds its
    credentials (HF_TOKEN, cloud keys)."""
    if isinstance(value, dict):
        return {k: ({name: REDACTED for name in v} if k == "env" and isinstance(v, dict) else redact_env(v))
                for k, v in value.items()}
    if isinstance(value, list):
        return [redact_env(v) for v in value]
    return value


@dataclass(frozen=True)
class Event:
    seq: int
    ts: float
    kind: str
    severity: str
    node: str
    message: str
    cause: str = ""
    job: str | None = None
    rank: int | None = None
    fields: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "seq": self.seq,
            "ts": round(self.ts, 6),
            "kind": self.kind,
            "severity": self.severity,
            "node": self.node,
            "message": self.message,
        }
        if self.cause:
            body["cause"] = self.cause
        if self.job is not None:
            body["job"] = self.job
        if self.rank is not None:
            body["rank"] = self.rank
        if self.fields:
            body["fields"] = self.fields
        return body


def _parse_line(line: bytes) -> dict[str, Any] | None:
    try:
        body = json.loads(line)
    except ValueError:
        return None  # a torn last line from a crash mid-write
    return body if isinstance(body, dict) and isinstance(body.get("seq"), int) else None


def read_log_file(path: str) -> Iterator[dict[str, Any]]:
    try:
        with open(path, "rb") as fh:
            for line in fh:
                body = _parse_line(line)
                if body is not None:
                    yield body
    except FileNotFoundError:
        return


class EventLog:
    """Append-only, thread-safe. ``recent`` keeps the tail in memory for the API."""

    def __init__(
        self,
        directory: str,
        node: str,
        *,
        max_bytes: int = 16 * 1024 * 1024,
        keep: int = 5,
        memory: int = 2000,
        clock: Callable[[], float] = time.time,
        fsync: bool = True,
    ) -> None:
        os.makedirs(directory, mode=0o750, exist_ok=True)
        self.directory = directory
        self.path = os.path.join(directory, LOG_NAME)
        self.node = node
        self.max_bytes = max_bytes
        self.keep = keep
        self.clock = clock
        self.fsync = fsync
        self._lock = threading.Lock()
        self._recent: deque[dict[str, Any]] = deque(maxlen=memory)
        self._listeners: list[Callable[[Event], None]] = []
        self.counts: dict[tuple[str, str], int] = {}
        self.write_errors = 0
        self._seq = self._recover()
        self._fh = open(self.path, "ab")
        self._terminate_torn_line()

    def _files_oldest_first(self) -> list[str]:
        rotated = [f"{self.path}.{i}" for i in range(self.keep, 0, -1)]
        return [p for p in rotated + [self.path] if os.path.exists(p)]

    def _recover(self) -> int:
        seq = 0
        for path in self._files_oldest_first():
            for body in read_log_file(path):
                seq = max(seq, body["seq"])
                self._recent.append(body)
        return seq

    def _terminate_torn_line(self) -> None:
        # A crash mid-write can leave a line without its newline; the next event must not be glued to it.
        try:
            with open(self.path, "rb") as fh:
                fh.seek(0, os.SEEK_END)
                if fh.tell() == 0:
                    return
                fh.seek(-1, os.SEEK_END)
                if fh.read(1) != b"\n":
                    self._fh.write(b"\n")
                    self._fh.flush()
        except OSError:
            pass

    def subscribe(self, listener: Callable[[Event], None]) -> None:
        """Called after each event is durable (exporter counters, live API streams)."""
        self._listeners.append(listener)

    def emit(
        self,
        kind: str,
        message: str,
        *,
        severity: str = "info",
        cause: str = "",
        job: str | None = None,
        rank: int | None = None,
        **fields: Any,
    ) -> Event:
        if severity not in SEVERITIES:
            severity = "info"
        fields = redact_env(fields)
        message = _cut(str(message), MAX_MESSAGE_CHARS)
        cause = _cut(str(cause), MAX_MESSAGE_CHARS)
        if job is not None:
            job = _cut(str(job), MAX_FIELD_CHARS)
        fields = {_cut(str(k), MAX_FIELD_CHARS): bound_field(v, LONG_FIELDS.get(k, MAX_FIELD_CHARS))
                  for k, v in fields.items()}
        with self._lock:
            self._seq += 1
            event = Event(self._seq, self.clock(), kind, severity, self.node, message, cause, job, rank, fields)
            body = event.to_dict()
            line = json.dumps(body, separators=(",", ":"), default=str) + "\n"
            try:
                self._fh.write(line.encode())
                self._fh.flush()
                if self.fsync:
                    os.fsync(self._fh.fileno())
                if self._fh.tell() >= self.max_bytes:
                    self._rotate()
            except OSError:
                # A full disk must not take the agent down; the event still reaches memory and listeners.
                self.write_errors += 1
            self._recent.append(body)
            self.counts[(kind, severity)] = self.counts.get((kind, severity), 0) + 1
        for listener in list(self._listeners):
            try:
                listener(event)
            except Exception:  # noqa: BLE001 - a listener bug must not lose the event
                pass
        return event

    def _rotate(self) -> None:
        self._fh.close()
        for i in range(self.keep - 1, 0, -1):
            src = f"{self.path}.{i}"
            if os.path.exists(src):
                os.replace(src, f"{self.path}.{i + 1}")
        os.replace(self.path, f"{self.path}.1")
        self._fh = open(self.path, "ab")
        dir_fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    def since(self, seq: int, limit: int = 500, kind: str | None = None) -> list[dict[str, Any]]:
        """Events with sequence number > seq, oldest first (from memory, then from disk if needed)."""
        with self._lock:
            recent = list(self._recent)
        if recent and recent[0]["seq"] > seq + 1:
            # The cursor is older than the in-memory tail: read the files.
            recent = [b for p in self._files_oldest_first() for b in read_log_file(p)]
        out = [b for b in recent if b["seq"] > seq and (kind is None or b["kind"] == kind)]
        return out[:limit]

    @property
    def last_seq(self) -> int:
        return self._seq

    def close(self) -> None:
        with self._lock:
            try:
                self._fh.close()
            except OSError:
                pass
