"""Jobs run through a real agent started by the test: the ``trainguard run`` command line as a
user types it, the pid of a live rank, and a small embedded-trainer job spec."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]

CACHE = os.environ.get("TRAINGUARD_CACHE") or os.path.expanduser("~/.cache/trainguard")
"""Where the embedded trainer keeps its downloaded text, shared by every test job."""


def run_cli(agent: Any, cwd: Path, *args: str) -> subprocess.Popen[str]:
    """``trainguard run ARGS`` against ``agent``, in ``cwd``, its output piped."""
    return subprocess.Popen([sys.executable, "-m", "trainguard", "run", "--state-dir", str(agent.state_dir), *args],
                            cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})


def rank_pid(agent: Any, job: str, rank: int) -> int | None:
    """The pid of ``rank`` of ``job`` while it is alive, else None (also before the job exists)."""
    try:
        info = agent.client().job(job)
    except Exception:  # noqa: BLE001 - not submitted yet
        return None
    alive = [r["pid"] for r in info["ranks"] if r["rank"] == rank and r["alive"]]
    return alive[0] if alive else None


def trainer_spec(dp: int, steps: int, faults: list[str] | None = None, batch: int = 32) -> dict[str, Any]:
    """The embedded trainer at its smallest: a 2-layer model on the CPU, ``dp`` data-parallel ranks."""
    return {
        "model": {"layers": 2, "d_model": 32, "heads": 4, "context": 64},
        "data": {"cache_dir": CACHE, "max_bytes": 2_000_000, "val_samples": 16},
        "parallel": {"dp": dp, "dp_mode": "ddp"}, "steps": steps, "global_batch": batch, "device": "cpu",
        "optim": {"warmup": 2}, "faults": faults or [],
    }
