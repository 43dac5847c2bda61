"""Lightning and Hugging Face callbacks on real jobs under ``trainguard run`` (gloo, CPU, two
ranks): a rank SIGKILLed by the test, the whole job restarted by the agent, model, optimizer and
LR scheduler restored from the memory tier, the step count continued."""

from __future__ import annotations

import ast
import os
import re
import signal
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import job_events as events
from tests.helpers.jobs import rank_pid, run_cli
from tests.helpers.waiting import wait_for

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow

CONFIG = "[agent]\ninterval_s = 0.25\n[collectors]\ngpu = false\n[checkpoint]\nmemory_every = 50\n"


def _kill_after_checkpoint(agent: Any, job: str, min_step: int) -> int:
    wait_for(lambda: any(c.get("step", 0) >= min_step for c in agent.client().checkpoints(job)), 150,
             f"a memory checkpoint at step >= {min_step}")
    pid = wait_for(lambda: rank_pid(agent, job, 1), 30, "rank 1")
    os.kill(pid, signal.SIGKILL)
    return pid


def _restored(agent: Any, job: str) -> int:
    sel = events(agent, job, "restore_selected")
    # The snapshots' interval is chosen from their measured stall: the kill may land between two.
    assert sel and sel[0]["fields"]["tier"] in ("snapshot", "memory"), sel
    resumed = events(agent, job, "job_resumed")
    assert resumed, "no job_resumed event"
    # Where the ranks went on, by their own telemetry: the step after the restored one.
    assert resumed[0]["fields"]["first_step_after_restore"] == sel[0]["fields"]["step"] + 1, (sel, resumed)
    # The framework's data loader owns the batch: no plan with batch sizes, whatever the ranks' speeds.
    assert events(agent, job, "shard_migration") == [] and events(agent, job, "batch_sizes_applied") == []
    return int(sel[0]["fields"]["step"])


def test_lightning_callback_resumes_from_the_memory_tier(agent_factory: Any, tmp_path: Path) -> None:
    agent = agent_factory(config=CONFIG)
    cli = run_cli(agent, tmp_path, "--nproc", "2", "--job", "lit", "--", sys.executable,
                  str(REPO / "examples" / "lightning_train.py"), "--steps", "2500")
    _kill_after_checkpoint(agent, "lit", 200)
    out, err = cli.communicate(timeout=300)
    assert cli.returncode == 0, err[-3000:]
    step = _restored(agent, "lit")
    # Split by the attempt each line names: a kill just after a checkpoint and before the next
    # print resumes at a higher step than the last one printed, so step order alone cannot tell.
    lines = [(int(m.group(1)), float(m.group(2)), int(m.group(3)))
             for m in re.finditer(r"\[rank0\]:step (\d+) loss ([\d.]+) restart (\d+)", out)]
    before = [(s, loss) for s, loss, attempt in lines if attempt == 0]
    after = [(s, loss) for s, loss, attempt in lines if attempt == 1]
    printed = before + after
    assert before and after, out[-2000:]
    # The restarted attempt goes on from the restored step: it never starts over at step 0.
    assert after[0][0] >= step and step > 0 and [s for s, _ in printed].count(0) == 1
    assert after[-1][0] == 2480
    assert agent.client().job("lit")["restarts"] == 1
    # The loss curve continues: what it reports after the restore is no worse than before the kill.
    tail = sorted(loss for _, loss in before[-8:])[4]
    head = sorted(loss for _, loss in after[:8])[4]
    assert head <= 1.5 * tail, (before[-8:], after[:8])


def test_hf_callback_resumes_from_the_memory_tier(agent_factory: Any, tmp_path: Path) -> None:
    agent = agent_factory(config=CONFIG)
    cli = run_cli(agent, tmp_path, "--nproc", "2", "--job", "hft", "--", sys.executable,
                  str(REPO / "examples" / "hf_train.py"), "--steps", "3000", "--output-dir", str(tmp_path / "out"))
    _kill_after_checkpoint(agent, "hft", 300)
    out, err = cli.communicate(timeout=300)
    assert cli.returncode == 0, err[-3000:]
    step = _restored(agent, "hft")
    logs = [ast.literal_eval(m.group(1)) for m in re.finditer(r"\[rank0\]:(\{'loss'.*\})", out)]
    losses = [float(d["loss"]) for d in logs]
    # Logged every 20 steps: without the restore the second attempt would log from step 20 again,
    # 150 logs in all; resumed at `step`, it logs (3000 - step) / 20 more.
    first_attempt = len(losses) - (3000 - step) // 20
    assert 0 < first_attempt < len(losses), (len(losses), step)
    resumed_first = losses[first_attempt]
    # The curve continues: the first loss after the restore is far below the run's first one.
    assert resumed_first < 0.8 * losses[0], (losses[0], resumed_first)
    info = agent.client().job("hft")
    assert info["restarts"] == 1 and info["state"] == "succeeded"
