"""Rank logs bounded in size: ``rank<N>.log`` rotated past ``launcher.log_max_bytes``, with
``launcher.log_keep`` older files (``rank<N>.log.1`` newest) kept.

Ranks write their logs themselves (the cold launcher's inherited descriptor, the warm launcher's
forked rank, systemd's ``StandardOutput=append:``), all with O_APPEND, and outlive an agent that
restarts. So the log is rotated by copy and truncate: its content goes to ``.1`` and the live
file is cut to zero, and every writer's next append lands at its new start. Output written between
the copy and the truncation (microseconds) is lost; nothing else is.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading

log = logging.getLogger("trainguard.agent.ranklogs")


def shift(path: str, keep: int) -> None:
    """``path.1`` .. ``path.<keep-1>`` move up one; the oldest goes."""
    for i in range(keep - 1, 0, -1):
        src = f"{path}.{i}"
        if os.path.lexists(src):
            os.replace(src, f"{path}.{i + 1}")
    try:
        os.unlink(f"{path}.{keep + 1}")  # a file a larger keep left behind
    except FileNotFoundError:
        pass


def rotate(path: str, keep: int) -> bool:
    """Copy ``path`` to ``path.1`` (after shifting the older ones, ``keep`` >= 1) and truncate it;
    True when done. Neither the log nor the copy is ever opened through a link."""
    shift(path, keep)
    tmp = f"{path}.1.tmp"
    src = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        dst = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o640)
        with os.fdopen(src, "rb", closefd=False) as fin, os.fdopen(dst, "wb") as fout:
            shutil.copyfileobj(fin, fout, 1 << 20)
        os.ftruncate(src, 0)
    finally:
        os.close(src)
    os.replace(tmp, f"{path}.1")
    return True


class RankLogRotator:
    """Watches the logs of every job's ranks and rotates each that grew past ``max_bytes``."""

    def __init__(self, max_bytes: int, keep: int, interval_s: float = 1.0) -> None:
        self.max_bytes = max_bytes
        self.keep = keep
        self.interval_s = interval_s
        self.rotations = 0
        self.errors = 0
        self._paths: dict[str, set[str]] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def watch(self, job: str, path: str) -> None:
        with self._lock:
            self._paths.setdefault(job, set()).add(path)

    def forget(self, job: str) -> None:
        """The job ended: its logs are checked once more, then no longer."""
        with self._lock:
            paths = self._paths.pop(job, set())
        for path in paths:
            self._check(path)

    def start(self) -> None:
        """The background check, once per ``interval_s`` (started with the first ranks)."""
        if self._thread is None and self.max_bytes > 0:
            self._thread = threading.Thread(target=self._run, name="rank-log-rotator", daemon=True)
            self._thread.start()

    def close(self) -> None:
        self._stop.set()

    def check(self) -> None:
        with self._lock:
            paths = [p for ps in self._paths.values() for p in ps]
        for path in paths:
            self._check(path)

    def _check(self, path: str) -> None:
        try:
            if os.lstat(path).st_size <= self.max_bytes:
                return
            rotate(path, self.keep)
            self.rotations += 1
        except FileNotFoundError:
            return
        except OSError as exc:
            self.errors += 1
            log.warning("could not rotate rank log %s: %s", path, exc)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.check()
