"""A job that keeps torchrun: its ranks call ``trainguard.init()``, find the node agent through
its discovery file, report to it; the agent tracks their pids (per-rank eBPF), serves them plans,
keeps their memory checkpoints, and ``trainguard status`` says what it can and cannot do."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.waiting import wait_for

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _external(agent: Any) -> dict[str, Any] | None:
    jobs = [j for j in agent.client().status()["jobs"] if j["state"] == "external" and len(j["ranks"]) == 2]
    return jobs[0] if jobs else None


def test_torchrun_job_reports_to_the_agent_and_takes_plans(agent_factory: Any, tmp_path: Path) -> None:
    agent = agent_factory(config="[agent]\ninterval_s = 0.25\n[collectors]\ngpu = false\n[checkpoint]\nmemory_every = 50\n")
    env = {**os.environ, "PYTHONPATH": str(REPO), "TRAINGUARD_STATE_DIR": str(agent.state_dir)}
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             str(REPO / "examples" / "ddp_api.py"), "--steps", "100000", "--step-sleep", "0.005"],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        job = wait_for(lambda: _external(agent), 120, "the torchrun job's telemetry")
        name = job["job"]
        assert name.startswith("torchrun-") and job["managed"] is False and "cannot restart" in job["note"]
        st = subprocess.run([sys.executable, "-m", "trainguard", "status", "--state-dir", str(agent.state_dir)],
                            capture_output=True, text=True, env=env, timeout=60)
        assert f"job {name}  external" in st.stdout and "cannot restart its ranks" in st.stdout
        # Plans reach ranks the agent did not start (the API answered 404 for such jobs before).
        client = agent.client()
        plan = client.put_plan(name, {"lr_scale": 0.5, "reason": "test"})
        wait_for(lambda: all(r["telemetry"]["plan_version"] >= plan["version"] for r in _external(agent)["ranks"]),
                 30, "the plan applied by both ranks")
        # Their pids are tracked by the eBPF collector (per-rank series), when eBPF runs here.
        if agent.client().status()["collectors"]["ebpf"]["up"]:
            def series() -> bool:
                text = urllib.request.urlopen(agent.metrics_url(), timeout=10).read().decode()
                return f'trainguard_offcpu_seconds_total{{job="{name}",kind="blocked",rank="1"}}' in text
            wait_for(series, 30, "per-rank eBPF series of the torchrun ranks")
        # Memory checkpoints of the job go to the agent's tier, which replicates them as its own.
        wait_for(lambda: client.checkpoints(name), 60, "a memory checkpoint of the torchrun job")
        assert client.checkpoint_now(name)["job"] == name
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    time.sleep(0.1)
