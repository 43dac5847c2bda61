"""`trainguard train` through a running agent and --standalone: the command-line contract,
one JSON object per step with --json."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

TINY = ["--set", "model.layers=2", "--set", "model.d_model=32", "--set", "model.heads=4", "--set", "model.context=32",
        "--set", "data.max_bytes=2000000", "--set", "global_batch=8"]


def json_rows(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def test_train_through_the_agent_prints_a_row_per_step(agent_factory, tmp_path) -> None:
    agent = agent_factory()
    cache = ["--set", f"data.cache_dir={tmp_path / 'corpus'}"]
    res = subprocess.run(
        [sys.executable, "-m", "trainguard", "train", "--state-dir", str(agent.state_dir), "--nproc", "2", "--steps", "6",
         "--job", "cli-job", "--json", *TINY, *cache],
        capture_output=True, text=True, timeout=300,
    )
    assert res.returncode == 0, res.stderr
    rows = json_rows(res.stdout)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert all(r["loss"] > 0 and "time" in r for r in rows)
    assert agent.client().job("cli-job")["state"] == "succeeded"


def test_train_standalone_and_bad_layout(tmp_path) -> None:
    cache = ["--set", f"data.cache_dir={tmp_path / 'corpus'}"]
    res = subprocess.run(
        [sys.executable, "-m", "trainguard", "train", "--standalone", "--nproc", "2", "--steps", "3", "--json", *TINY, *cache],
        capture_output=True, text=True, timeout=300,
    )
    assert res.returncode == 0, res.stderr
    assert [r["step"] for r in json_rows(res.stdout)] == [1, 2, 3]
    bad = subprocess.run(
        [sys.executable, "-m", "trainguard", "train", "--standalone", "--nproc", "3", "--tp", "2", "--steps", "3"],
        capture_output=True, text=True, timeout=120,
    )
    assert bad.returncode == 2
    assert "Traceback" not in bad.stderr and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
