"""Job records on disk, so that an agent started again on the same state directory (after a crash,
SIGKILL or a systemd restart) finds the jobs the previous one ran and adopts their ranks.

One ``record.json`` per job in its directory under ``jobs/``, rewritten atomically on every state
change and launch. A rank is named by its pid *and* its start time (``/proc/<pid>/stat`` field 22,
clock ticks since boot), so a recycled pid is never mistaken for the rank. A record without a start
time (the rank had already ended when it was written) proves nothing by itself: such a pid counts as
the rank only when the launcher proves it (the pid in the job's cgroup or slice).
"""

from __future__ import annotations

import json
import logging
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from trainguard.agent.safefs import write_atomic
from trainguard.agent.wire import exit_status_path, process_start_ticks, read_exit_status

log = logging.getLogger(__name__)

RECORD_FILE = "record.json"
VERSION = 1


@dataclass(frozen=True)
class RankRecord:
    rank: int
    local_rank: int
    pid: int
    start_ticks: int | None
    log_path: str

    def alive(self, proc_root: Path = Path("/proc")) -> bool:
        """Is this very process still running (same pid, same start time)? Without a recorded
        start time a running pid may be anyone's: False (``proven`` makes such a record usable)."""
        now = process_start_ticks(self.pid, proc_root)
        return now is not None and self.start_ticks is not None and now == self.start_ticks

    def proven(self, owns: Callable[[int], bool], proc_root: Path = Path("/proc")) -> RankRecord | None:
        """This record with the running process's start time when ``owns(pid)`` proves the pid is
        the job's (a record without a start time); None when it cannot be proved."""
        now = process_start_ticks(self.pid, proc_root)
        if now is None or not owns(self.pid):
            return None
        return replace(self, start_ticks=now)

    def recorded_status(self) -> int | None:
        """How this very process ended as its warm launcher recorded it (None: no record of it)."""
        return read_exit_status(exit_status_path(self.log_path), self.pid, self.start_ticks)


@dataclass(frozen=True)
class SavedJob:
    spec: dict[str, Any]
    state: str
    attempt: int
    restarts: int
    progress_step: int
    submitted: float
    ranks: list[RankRecord]
    spans_nodes: bool
    restored_from: dict[str, Any] | None = None


class RecordStore:
    """Reads and writes the job records under ``jobs_dir``."""

    def __init__(self, jobs_dir: str, proc_root: Path = Path("/proc")) -> None:
        self.jobs_dir = Path(jobs_dir)
        self.proc_root = proc_root
        self.errors = 0
        """Records that could not be written or read (a full disk, a truncated file)."""

    def path(self, job: str) -> Path:
        return self.jobs_dir / job / RECORD_FILE

    def save(self, job: dict[str, Any], ranks: list[tuple[int, int, int, str]]) -> None:
        """``job``: JobRecord.to_dict() fields; ``ranks``: (rank, local_rank, pid, log) of the live
        attempt. Never raises: a record that cannot be written costs adoption, not the job."""
        doc = {
            "version": VERSION,
            "spec": job["spec"],
            "state": job["state"],
            "attempt": job["attempt"],
            "restarts": job["restarts"],
            "progress_step": job["progress_step"],
            "submitted": job["submitted"],
            "spans_nodes": job.get("local_ranks") is not None,
            "restored_from": job.get("restored_from"),
            "ranks": [
                {"rank": rank, "local_rank": local, "pid": pid, "start_ticks": process_start_ticks(pid, self.proc_root),
                 "log_path": log_path}
                for rank, local, pid, log_path in ranks
            ],
        }
        path = self.path(job["job"])
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            # Through a temp file and a rename, fsync'd with its directory: after a crash or a power
            # loss the record is the old one or the new one, never empty.
            write_atomic(path, json.dumps(doc).encode(), durable=True, root=self.jobs_dir)
        except OSError as exc:
            self.errors += 1
            log.warning("job %s: could not write its record (%s); a restarted agent will not adopt it", job["job"], exc)

    def forget(self, job: str) -> None:
        try:
            self.path(job).unlink()
        except OSError:
            pass

    def load_all(self) -> tuple[list[SavedJob], list[str]]:
        """Every readable record, and a line per unreadable one (file and why)."""
        saved: list[SavedJob] = []
        problems: list[str] = []
        if not self.jobs_dir.is_dir():
            return saved, problems
        for path in sorted(self.jobs_dir.glob(f"*/{RECORD_FILE}")):
            try:
                doc = json.loads(path.read_text())
                saved.append(SavedJob(
                    spec=dict(doc["spec"]), state=str(doc["state"]), attempt=int(doc["attempt"]),
                    restarts=int(doc["restarts"]), progress_step=int(doc["progress_step"]),
                    submitted=float(doc["submitted"]), spans_nodes=bool(doc.get("spans_nodes")),
                    restored_from=doc.get("restored_from"),
                    ranks=[RankRecord(int(r["rank"]), int(r["local_rank"]), int(r["pid"]),
                                      None if r.get("start_ticks") is None else int(r["start_ticks"]),
                                      str(r["log_path"])) for r in doc["ranks"]],
                ))
            except (OSError, ValueError, KeyError, TypeError) as exc:
                self.errors += 1
                problems.append(f"{path}: {type(exc).__name__}: {exc}")
        return saved, problems


class AdoptedProcess:
    """A rank a previous agent started, now watched by this one; quacks like ``subprocess.Popen``
    for the supervisor. Not our child, so no waitpid: its end is seen through a pidfd (the
    supervisor's monitor) or /proc, and its exit status comes from the eBPF exit event when that
    collector runs (``status_hint``, in Popen's convention: -N for signal N), else from the file
    the warm launcher that forked it writes when it reaps it (``wire.exit_status_path``: also for a
    rank that ended before this agent started), else from ``resolve()`` (the supervisor's
    judgement from the job's own telemetry); ``status_source`` says which."""

    HINT_WAIT_S = 0.5
    """How long a seen end waits for its status to come (the eBPF event is usually first; the
    launcher writes its file once it has reaped the rank)."""

    def __init__(self, rank: RankRecord, resolve: Callable[[], int], *,
                 proc_root: Path = Path("/proc"), clock: Callable[[], float] = time.monotonic) -> None:
        self.record = rank
        self.pid = rank.pid
        self.args = [f"adopted pid {rank.pid}"]
        self.resolve = resolve
        self.proc_root = proc_root
        self.clock = clock
        self.returncode: int | None = None
        self.status_hint: int | None = None
        self.status_source = ""
        self._gone_at: float | None = None

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        if self.record.alive(self.proc_root):
            return None
        if self.status_hint is not None:
            self.returncode, self.status_source = self.status_hint, "ebpf"
            return self.returncode
        recorded = self.record.recorded_status()
        if recorded is not None:
            self.returncode, self.status_source = recorded, "launcher"
            return self.returncode
        now = self.clock()
        self._gone_at = now if self._gone_at is None else self._gone_at
        if now - self._gone_at < self.HINT_WAIT_S:
            return None
        self.returncode = self.resolve()
        self.status_source = "telemetry" if self.returncode == 0 else "unknown"
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else self.clock() + timeout
        while True:
            code = self.poll()
            if code is not None:
                return code
            if deadline is not None and self.clock() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            time.sleep(0.02)
