"""The no-daemon arm of bench/recovery.py: ``trainguard run`` where no node agent runs, so the
command hosts the agent itself (trainguard/launch/hosted_agent.py), with the same trainer, ranks and
kills as the other arms. Its failures are read as the agent arm's are: the rank's death from the
event log (the kernel's word where eBPF runs, else the supervisor's ``rank_exit``) to the first
step row after the restore the agent's ``job_resumed`` names.

Run by recovery.py; ``run_hosted`` alone is the smoke test's smallest configuration.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
NAME = "trainguard-nodaemon"


def _events(state_dir: Path) -> list[dict[str, Any]]:
    path = state_dir / "events" / "events.jsonl"
    out = []
    for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # a torn last line
    return out


def run_hosted(nproc: int, trainer: dict[str, Any], kills: list[int], work: Path, bench: Any) -> Any:
    """One ``trainguard run --nproc-per-node N -m trainguard.trainer.worker`` with no agent on the
    node (a private ``XDG_RUNTIME_DIR``, no ``TRAINGUARD_STATE_DIR``); ``bench``: recovery.py's
    module (its ``RunResult``, ``parse_rows``, ``failure_after`` and ``analyse``)."""
    # Short: the agent's sockets live below it (a long work path falls back to /tmp/trainguard-<uid>).
    runtime = Path(tempfile.mkdtemp(prefix="tg-nd-"))
    cfg = {**trainer, "faults": [f"kill:rank=1,step={k}" for k in kills]}
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    env.update(PYTHONPATH=str(REPO), XDG_RUNTIME_DIR=str(runtime), TRAINGUARD_JOB_SPEC=json.dumps(cfg),
               TRAINGUARD_JSON="1", TRAINGUARD_FAULT_MARKER_DIR=str(work / f"{NAME}-markers"), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "trainguard", "run", "--job", NAME, "--nproc-per-node", str(nproc),
           "--max-restarts", str(len(kills) + 2), "-m", "trainguard.trainer.worker"]
    out = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=3600)
    (work / f"{NAME}.log").write_text(out.stdout + "\n---stderr---\n" + out.stderr)
    rows = bench.parse_rows(out.stdout.splitlines())
    found = re.search(r"hosting one for this job \(pid \d+, state (\S+),", out.stderr)
    if found is None:
        shutil.rmtree(runtime, ignore_errors=True)
        return bench.RunResult(NAME, ok=False, note=f"no hosted agent (exit {out.returncode})")
    events = _events(Path(found.group(1)))
    shutil.copy(Path(found.group(1)) / "agent.log", work / f"{NAME}-agent.log")
    shutil.rmtree(runtime, ignore_errors=True)
    shutil.rmtree(found.group(1), ignore_errors=True)
    seen = [e for e in events if e["kind"] == "process_exit_seen" and e.get("fields", {}).get("signal") == 9]
    exits = [e for e in events if e["kind"] == "rank_exit" and e["severity"] == "error"]
    resumed = [e for e in events if e["kind"] == "job_resumed"]
    recovered = {}
    for ex, again in zip(exits, resumed, strict=False):
        kernel = next((s for s in seen if s["fields"].get("pid") == ex["fields"].get("pid")), None)
        death = kernel["ts"] - kernel["fields"].get("latency_ms", 0) / 1000 if kernel else ex["ts"]
        restored = (again["fields"].get("restored_from") or {}).get("step")
        hit = bench.failure_after(rows, death, None if restored is None else int(restored))
        if hit is not None:
            index, failure = hit
            failure.detect_s = max(0.0, ex["ts"] - death)
            failure.timeline = dict(again["fields"].get("timeline") or {})
            recovered[index] = failure
    res = bench.analyse(NAME, rows, 100, recovered)
    res.ok = out.returncode == 0
    if not res.ok:
        res.note = f"trainguard run exit {out.returncode}"
    return res
