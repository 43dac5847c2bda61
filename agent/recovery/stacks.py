"""Python stacks of live rank processes with ``py-spy dump``, each probe bounded by a timeout so a
stuck process cannot stall the agent's loop."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor


def py_spy_path() -> str | None:
    beside = os.path.join(os.path.dirname(sys.executable), "py-spy")
    if os.access(beside, os.X_OK):
        return beside
    return shutil.which("py-spy")


def dump_stack(pid: int, timeout_s: float = 10.0, py_spy: str | None = None) -> str:
    tool = py_spy or py_spy_path()
    if tool is None:
        return "py-spy not installed: no stack"
    try:
        res = subprocess.run([tool, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"py-spy timed out after {timeout_s:.0f}s"
    except OSError as exc:
        return f"py-spy failed: {exc}"
    out = res.stdout.strip() or res.stderr.strip()
    return out[-8000:]  # an event is not a core dump: keep the innermost frames


def dump_stacks(pids: list[int], timeout_s: float = 10.0) -> dict[int, str]:
    """Stacks of all ``pids`` in parallel (a 4-rank job costs one py-spy run's time, not four)."""
    if not pids:
        return {}
    tool = py_spy_path()
    with ThreadPoolExecutor(max_workers=min(8, len(pids))) as pool:
        results = pool.map(lambda p: dump_stack(p, timeout_s, tool), pids)
        return dict(zip(pids, results, strict=True))
