"""bench/scale.py drives the real straggler service and controller through a fake leader; a
change in what those read from the agent once broke it silently. A few seconds at small scale
keep it running (its figures come from the full run in BENCHMARKS.md, not from here)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_scale_bench_runs_all_modes_and_ends_with_its_result_line() -> None:
    out = subprocess.run([sys.executable, "bench/scale.py", "--ranks", "64", "--seconds", "2.5", "--rate", "10"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    rows = [ln.split() for ln in lines]
    modes = [r[0] for r in rows if len(r) > 1 and r[0] in ("ingest", "leader", "forwarded") and r[1].replace(",", "").isdigit()]
    assert modes == ["ingest", "leader", "forwarded"], out.stdout
    result = dict(kv.split("=", 1) for kv in lines[-1].removeprefix("RESULT ").split())
    assert lines[-1].startswith("RESULT ") and float(result["leader_cpu_cores"]) > 0
    assert float(result["forwarded_cpu_cores"]) > 0 and "forwarded_ratio" in result
