"""`trainguard stop | logs | checkpoint | drain` against a real agent: each command reaches the
job through the API, prints one line, and a refusal is one line with exit code 1, no traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.helpers.waiting import wait_for

REPO = Path(__file__).resolve().parents[2]
SCRIPT = "import os, sys, time\nfor i in range(3): print(f'line {i} of rank {os.environ[\"RANK\"]}', flush=True)\ntime.sleep(120)\n"


def cli(agent: Any, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "trainguard", *args, "--state-dir", str(agent.state_dir)],
                          capture_output=True, text=True, timeout=timeout, env={**os.environ, "PYTHONPATH": str(REPO)})


def test_job_commands_reach_a_running_job(agent_factory: Any, tmp_path: Path) -> None:
    agent = agent_factory()
    script = tmp_path / "talk.py"
    script.write_text(SCRIPT)
    res = subprocess.run([sys.executable, "-m", "trainguard", "run", "--state-dir", str(agent.state_dir), "--nproc", "2",
                          "--job", "talk", "--detach", "--", sys.executable, str(script)],
                         capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert res.returncode == 0 and res.stdout.strip() == "talk", res.stderr

    def both_ranks_spoke() -> str | None:
        out = cli(agent, "logs", "talk").stdout
        return out if "line 2 of rank 0" in out and "line 2 of rank 1" in out else None

    out = wait_for(both_ranks_spoke, 60, "both ranks' lines in `trainguard logs`")
    assert "[rank 1] line 0 of rank 1\n" in out and "[rank 0] line 1 of rank 0\n" in out
    only = cli(agent, "logs", "talk", "--rank", "1").stdout
    assert only.splitlines() == ["line 0 of rank 1", "line 1 of rank 1", "line 2 of rank 1"]

    ck = cli(agent, "checkpoint", "talk")
    assert ck.returncode == 0 and "checkpoint requested" in ck.stdout, ck.stderr
    assert agent.client().get_plan("talk")["checkpoint_id"] >= 1

    drain = cli(agent, "drain", "talk", "--node", "elsewhere")
    assert drain.returncode == 1 and "Traceback" not in drain.stderr, drain.stderr
    assert len(drain.stderr.strip().splitlines()) == 1

    stop = cli(agent, "stop", "talk", "--reason", "done talking")
    assert stop.returncode == 0 and stop.stdout.startswith("talk: "), stop.stderr
    wait_for(lambda: agent.client().job("talk")["state"] == "stopped", 60, "the job stopped")
    follow = cli(agent, "logs", "talk", "-f", "--rank", "0")  # returns: the job has ended
    assert follow.returncode == 0 and "line 2 of rank 0" in follow.stdout
    kinds = [e["message"] for e in agent.client().events(since=0, limit=1000)["events"] if e.get("job") == "talk"]
    assert any("done talking" in m for m in kinds), kinds

    missing = cli(agent, "stop", "no-such-job")
    assert missing.returncode == 1 and "no-such-job" in missing.stderr and "Traceback" not in missing.stderr
