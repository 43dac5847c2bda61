"""What a rank declares it applies decides what the agent does with a straggler, end to end: a real
agent, ``trainguard run`` with two gloo ranks of a script whose rank 1 computes each sample three
times as long. Ranks that take batch sizes get samples moved, and the event saying they run the new
split comes from their own telemetry; ranks that cannot take them (a framework's data loader) get
the straggler reported and no plan with batch sizes, no event claiming one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import CPU_ISOLATION
from tests.conftest import job_events as events
from tests.helpers.waiting import wait_for
from trainguard.agent.wire import applies_names

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group(CPU_ISOLATION)]

CONFIG = """\
[agent]
interval_s = 0.25
[collectors]
gpu = false
[detection]
window = 12
warmup_steps = 8
enter_windows = 2
leave_windows = 2
eval_every_steps = 3
settle_steps = 5
"""

SCRIPT = """\
import sys, time
import torch, torch.distributed as dist
import trainguard

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.set_num_threads(1)
run = trainguard.init(batch_size=16) if sys.argv[1] == "takes" else trainguard.init()
t = torch.zeros(1)
for step in range(1_000_000):
    n = run.plan.batch_size or 16
    with run.step(step, samples=n) as s:
        with s.phase("compute"):
            end = time.thread_time() + n * (0.0006 if rank == 1 else 0.0002)
            while time.thread_time() < end:
                pass
        with s.phase("comm"):
            dist.all_reduce(t)
    if run.plan.stop:
        break
run.close()
dist.destroy_process_group()
"""


def _start(agent: Any, tmp_path: Path, job: str, mode: str) -> None:
    script = tmp_path / "slow_rank.py"
    script.write_text(SCRIPT)
    res = subprocess.run([sys.executable, "-m", "trainguard", "run", "--state-dir", str(agent.state_dir), "--nproc", "2",
                          "--job", job, "--detach", "--", sys.executable, str(script), mode],
                         cwd=tmp_path, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)},
                         timeout=60)
    assert res.returncode == 0, res.stderr


def _telemetry(agent: Any, job: str) -> dict[int, dict[str, Any]]:
    """Each rank's latest telemetry as the agent's status shows it."""
    info = [j for j in agent.client().status()["jobs"] if j["job"] == job]
    return {r["rank"]: r.get("telemetry") or {} for r in info[0]["ranks"]} if info else {}


def test_ranks_that_take_batch_sizes_get_samples_moved_and_say_so(agent_factory: Any, tmp_path: Path) -> None:
    agent = agent_factory(config=CONFIG)
    _start(agent, tmp_path, "takes", "takes")
    try:
        detected = wait_for(lambda: [e for e in events(agent, "takes", "straggler_detected") if e["rank"] == 1], 90,
                            "rank 1 found slow")
        assert detected[0]["fields"]["action"] == "migrate", detected[0]
        applied = wait_for(lambda: events(agent, "takes", "batch_sizes_applied"), 60, "the ranks running the split")
        asked = events(agent, "takes", "shard_migration")
        first = applied[0]["fields"]
        assert asked and first["published_version"] == asked[0]["fields"]["plan_version"], (asked, applied)
        # The ranks' own word: rank 1 ran fewer samples than rank 0, 32 in all.
        assert first["batch_sizes"][1] < first["batch_sizes"][0] and sum(first["batch_sizes"]) == 32, first
    finally:
        agent.client().stop_job("takes")


def test_ranks_that_cannot_take_batch_sizes_get_the_straggler_reported_only(agent_factory: Any,
                                                                            tmp_path: Path) -> None:
    agent = agent_factory(config=CONFIG)
    _start(agent, tmp_path, "reports", "reports")
    try:
        detected = wait_for(lambda: [e for e in events(agent, "reports", "straggler_detected") if e["rank"] == 1], 90,
                            "rank 1 found slow")
        fields = detected[0]["fields"]
        assert fields["action"] == "report" and "batch sizes" in fields["note"], fields
        # Some more evaluations on: still no plan with batch sizes, no event claiming one.
        seen = fields["step"]
        wait_for(lambda: min(t.get("step", 0) for t in _telemetry(agent, "reports").values()) > seen + 40, 60,
                 "40 more steps")
        assert all(applies_names(t["applies"]) == ["lr", "stop"] for t in _telemetry(agent, "reports").values())
        assert events(agent, "reports", "shard_migration") == []
        assert events(agent, "reports", "batch_sizes_applied") == []
        assert agent.client().job("reports")["state"] == "running"
    finally:
        agent.client().stop_job("reports")
