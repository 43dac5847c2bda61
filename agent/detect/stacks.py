"""What each rank of a hung job is doing: its Python stack (``py-spy dump``), its scheduler state
and wait channel (``/proc``), and its kernel stack where readable. Every probe is bounded by a
timeout so a stuck process cannot stall the agent's loop.

py-spy cannot read a process stopped by a signal (state ``T``, e.g. SIGSTOP from an operator or a
debugger): it fails with "Failed to find python version". Such a rank is let run for the dump
(SIGCONT, py-spy pauses it itself while it reads) and stopped again right after; the record says
so. A py-spy that fails keeps its error in the record, never an empty header passed off as a stack.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

STATES = {"R": "running", "S": "sleeping", "D": "uninterruptible sleep", "T": "stopped", "t": "tracing stop",
          "Z": "zombie", "X": "dead", "I": "idle", "P": "parked", "W": "waking"}


@dataclass
class RankProbe:
    pid: int
    state: str = ""
    """Scheduler state letter and its meaning, e.g. ``T (stopped)``; empty when the process is gone."""
    wchan: str = ""
    """Kernel function the process sleeps in (``do_signal_stop``, ``futex_wait_queue``, ...)."""
    stack: str = ""
    """Python stacks of every thread (py-spy), innermost frames kept."""
    error: str = ""
    """Why there is no Python stack (py-spy missing, failed, timed out)."""
    kernel_stack: str = ""
    resumed_for_dump: bool = False
    """The process was stopped and was let run for the dump, then stopped again."""

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v not in ("", False)}


def py_spy_path() -> str | None:
    beside = os.path.join(os.path.dirname(sys.executable), "py-spy")
    if os.access(beside, os.X_OK):
        return beside
    return shutil.which("py-spy")


def _read(path: Path, limit: int = 4096) -> str:
    try:
        return path.read_text(errors="replace")[:limit].strip()
    except OSError:
        return ""


def process_state(pid: int, proc_root: Path = Path("/proc")) -> tuple[str, str]:
    """(state letter, wait channel); ("", "") when the process is gone."""
    raw = _read(proc_root / str(pid) / "stat")
    if not raw:
        return "", ""
    letter = raw[raw.rfind(")") + 2:].split(" ", 1)[0]
    wchan = _read(proc_root / str(pid) / "wchan")
    return letter, "" if wchan == "0" else wchan


def _stop_again(pid: int, proc_root: Path, wait_s: float = 1.0) -> None:
    """SIGSTOP, and wait until the kernel shows it stopped (signals are delivered asynchronously)."""
    try:
        os.kill(pid, signal.SIGSTOP)
    except OSError:
        return
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and process_state(pid, proc_root)[0] not in ("T", "", "Z"):
        time.sleep(0.01)


def probe(pid: int, timeout_s: float = 10.0, py_spy: str | None = None, proc_root: Path = Path("/proc")) -> RankProbe:
    letter, wchan = process_state(pid, proc_root)
    result = RankProbe(pid, f"{letter} ({STATES.get(letter, 'unknown')})" if letter else "", wchan)
    if not letter:
        result.error = "process is gone"
        return result
    result.kernel_stack = _read(proc_root / str(pid) / "stack", 2000)
    tool = py_spy or py_spy_path()
    if tool is None:
        result.error = "py-spy not installed: no Python stack"
        return result
    if letter == "T":
        try:
            os.kill(pid, signal.SIGCONT)
            result.resumed_for_dump = True
        except OSError as exc:
            result.error = f"cannot resume the stopped process for py-spy: {exc}"
            return result
    try:
        res = subprocess.run([tool, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        result.error = f"py-spy timed out after {timeout_s:.0f}s"
        return result
    except OSError as exc:
        result.error = f"py-spy failed: {exc}"
        return result
    finally:
        if result.resumed_for_dump:
            _stop_again(pid, proc_root)
    if res.returncode != 0:
        first = next((ln for ln in res.stderr.splitlines() if ln.strip()), "no output")
        result.error = f"py-spy exited {res.returncode}: {first.strip()[:300]}"
        return result
    result.stack = res.stdout.strip()[-8000:]  # an event is not a core dump: keep the innermost frames
    return result


def probe_all(pids: list[int], timeout_s: float = 10.0) -> dict[int, RankProbe]:
    """Every pid in parallel (a 4-rank job costs one py-spy run's time, not four)."""
    if not pids:
        return {}
    tool = py_spy_path()
    with ThreadPoolExecutor(max_workers=min(8, len(pids))) as pool:
        results = pool.map(lambda p: probe(p, timeout_s, tool), pids)
        return dict(zip(pids, results, strict=True))


def dump_stacks(pids: list[int], timeout_s: float = 10.0) -> dict[int, str]:
    """Python stacks only (the error text where there is none)."""
    return {pid: (p.stack or p.error) for pid, p in probe_all(pids, timeout_s).items()}
