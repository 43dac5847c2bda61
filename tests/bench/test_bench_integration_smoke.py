"""bench/integration.py in its quick form: both arms recover from every kill and the RESULT line
carries finite figures (the full run's figures live in BENCHMARKS.md, not here)."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_integration_bench_quick_runs_both_arms() -> None:
    out = subprocess.run([sys.executable, "bench/integration.py", "--quick"], cwd=REPO, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, (out.stdout[-3000:], out.stderr[-3000:])
    lines = out.stdout.strip().splitlines()
    assert lines[-1].startswith("RESULT ")
    result = {k: float(v) for k, v in (kv.split("=", 1) for kv in lines[-1].removeprefix("RESULT ").split())}
    for key in ("lost_time_ratio", "overhead_ratio", "api_only_ratio", "own_ckpt_ratio", "overhead_lo", "overhead_hi",
                "torchrun_lost_s", "trainguard_lost_s"):
        assert math.isfinite(result[key]) and result[key] > 0, (key, out.stdout)
    assert result["overhead_lo"] <= result["overhead_ratio"] <= result["overhead_hi"], out.stdout
    arms = {ln.split()[0]: ln.split() for ln in lines if ln.split() and ln.split()[0] in ("torchrun", "trainguard")}
    assert arms["torchrun"][1] == "0" and arms["trainguard"][1] == "0" and arms["trainguard"][2] == "2", out.stdout
