"""Heartbeats of the agent's long-lived threads, and the check that gates the systemd watchdog.

Each loop beats once per iteration (``beat(owner, name)``) and reports an iteration that raised
(``failed(owner, name, exc)``) instead of dying. The daemon watches the beats it cares about and
feeds the watchdog only while every watched thread has beaten recently, as kubelet's PLEG check
does: a thread that died or hangs makes the agent unhealthy, and systemd restarts it.

Beats are kept per owner object (weakly), so several agents in one process never share them.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

DEFAULT_STALE_S = 60.0
"""A watched thread without a beat for this long is stuck (``agent.heartbeat_stale_s``)."""
ERROR_REPORT_S = 60.0
"""Failed iterations of one thread are reported at most this often (the first at once), so a loop
that fails every time round costs the event log one line a minute, not one per iteration."""


class Beat:
    """The heartbeat of one loop: when it last went round, and how many iterations raised."""

    __slots__ = ("name", "last", "started", "errors", "last_error", "thread", "stopped", "__weakref__")

    def __init__(self, name: str, now: float) -> None:
        self.name = name
        self.last = now
        self.started = now
        self.errors = 0
        self.last_error = ""
        self.thread: threading.Thread | None = None
        self.stopped = False


_lock = threading.Lock()
_beats: weakref.WeakKeyDictionary[Any, dict[str, Beat]] = weakref.WeakKeyDictionary()
_clock: Callable[[], float] = time.monotonic


def beat_of(owner: Any, name: str) -> Beat:
    """The beat of ``owner``'s loop ``name`` (made on first use)."""
    with _lock:
        per = _beats.get(owner)
        if per is None:
            per = _beats[owner] = {}
        found = per.get(name)
        if found is None:
            found = per[name] = Beat(name, _clock())
        return found


def beat(owner: Any, name: str) -> None:
    """One iteration of the calling thread's loop went round."""
    b = beat_of(owner, name)
    b.last = _clock()
    b.thread = threading.current_thread()
    b.stopped = False


def stopped(owner: Any, name: str) -> None:
    """The loop ended on purpose (shutdown): it is no longer expected to beat."""
    beat_of(owner, name).stopped = True


def failed(owner: Any, name: str, exc: BaseException) -> None:
    """An iteration raised: count it and log it (the first time with its traceback); the loop goes on."""
    b = beat_of(owner, name)
    b.errors += 1
    b.last_error = f"{type(exc).__name__}: {exc}"[:512]
    if b.errors == 1:
        log.error("thread %s: an iteration failed (it goes on; later failures are counted)", name, exc_info=exc)
    else:
        log.warning("thread %s: iteration failed (%d so far): %s", name, b.errors, b.last_error)


@dataclass(frozen=True)
class ThreadHealth:
    name: str
    healthy: bool
    age_s: float
    """Seconds since the last beat."""
    errors: int
    """Iterations that raised and were survived."""
    reason: str
    """Empty when healthy; else "stuck" (no beat for longer than allowed) or "dead" (its thread ended)."""
    since_s: float
    """Seconds the thread has been unhealthy (0 when healthy)."""
    last_error: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "healthy": self.healthy, "age_s": round(self.age_s, 3), "errors": self.errors,
                "reason": self.reason, "unhealthy_for_s": round(self.since_s, 3), "last_error": self.last_error}


class Watch:
    """The threads an agent supervises: ``check`` says which are stuck or dead, ``healthy`` gates
    the watchdog. A thread is watched from ``watch`` on; a beat it never sent counts from then."""

    def __init__(self, stale_after_s: float = DEFAULT_STALE_S, *,
                 on_change: Callable[[ThreadHealth], None] | None = None,
                 on_errors: Callable[[str, int, str], None] | None = None) -> None:
        if stale_after_s <= 0:
            raise ValueError(f"agent.heartbeat_stale_s: must be > 0, got {stale_after_s}")
        self.stale_after_s = stale_after_s
        self.on_change = on_change
        """Called (on the checking thread) when a thread turns unhealthy or recovers."""
        self.on_errors = on_errors
        """Called with (thread, new failed iterations, last error) when a check finds new ones,
        at most once per ``ERROR_REPORT_S`` a thread."""
        self._reported: dict[str, int] = {}
        self._report_at: dict[str, float] = {}
        self._watched: dict[str, tuple[Beat, float]] = {}
        self._bad: dict[str, float] = {}
        self._lock = threading.Lock()

    def watch(self, owner: Any, name: str, stale_after_s: float | None = None) -> None:
        """Supervise ``owner``'s loop ``name``; ``stale_after_s`` overrides the default for a loop
        whose iterations are long by nature."""
        b = beat_of(owner, name)
        with self._lock:
            self._watched[name] = (b, stale_after_s or self.stale_after_s)

    def unwatch(self, name: str) -> None:
        with self._lock:
            self._watched.pop(name, None)
            self._bad.pop(name, None)

    def errors(self) -> dict[str, int]:
        """Failed iterations per watched thread, survived and counted."""
        with self._lock:
            return {name: b.errors for name, (b, _stale) in self._watched.items()}

    def check(self, now: float | None = None) -> list[ThreadHealth]:
        now = _clock() if now is None else now
        out: list[ThreadHealth] = []
        changed: list[ThreadHealth] = []
        errors: list[tuple[str, int, str]] = []
        with self._lock:
            for name, (b, stale) in sorted(self._watched.items()):
                age = max(0.0, now - b.last)
                reason = ""
                if not b.stopped:
                    if b.thread is not None and not b.thread.is_alive():
                        reason = "dead"
                    elif age > stale:
                        reason = "stuck"
                was_bad = name in self._bad
                if reason and not was_bad:
                    # Counted from when it should have beaten: the last beat plus its allowance.
                    self._bad[name] = min(now, b.last + stale) if reason == "stuck" else now
                elif not reason and was_bad:
                    del self._bad[name]
                since = now - self._bad[name] if reason else 0.0
                th = ThreadHealth(name, not reason, age, b.errors, reason, since, b.last_error)
                out.append(th)
                if bool(reason) != was_bad:
                    changed.append(th)
                if b.errors > self._reported.get(name, 0) and now >= self._report_at.get(name, now):
                    errors.append((name, b.errors - self._reported.get(name, 0), b.last_error))
                    self._reported[name] = b.errors
                    self._report_at[name] = now + ERROR_REPORT_S
        try:
            for th in changed:
                if self.on_change is not None:
                    self.on_change(th)
            for name, n, last in errors:
                if self.on_errors is not None:
                    self.on_errors(name, n, last)
        except Exception:  # noqa: BLE001 - reporting must not break the check
            log.exception("health listener failed")
        return out

    def healthy(self, now: float | None = None) -> bool:
        return all(t.healthy for t in self.check(now))
