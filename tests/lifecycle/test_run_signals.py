"""SIGUSR1/SIGUSR2 sent to ``trainguard run`` (what ``srun --signal`` and ``scancel -s`` deliver
ahead of a step's end) reach the ranks, which go on running: without an agent (the ranks are
children of ``run``) and with one (the agent's ranks, through its API)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.waiting import wait_for
from trainguard.agent.api.client import ApiClientError

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow

# Each rank notes every SIGUSR1/2 it gets and runs until the file "finish" exists.
SCRIPT = """
import os, signal, sys, time
out = sys.argv[1]
rank = os.environ["RANK"]
def caught(signum, frame):
    with open(os.path.join(out, f"got-{rank}"), "a") as fh:
        fh.write(signal.Signals(signum).name + "\\n")
signal.signal(signal.SIGUSR1, caught)
signal.signal(signal.SIGUSR2, caught)
open(os.path.join(out, f"up-{rank}"), "w").close()
while not os.path.exists(os.path.join(out, "finish")):
    time.sleep(0.05)
"""


def got(out: Path, rank: int) -> list[str]:
    path = out / f"got-{rank}"
    return path.read_text().split() if path.exists() else []


def signal_both(cli: subprocess.Popen[str], out: Path) -> None:
    wait_for(lambda: all((out / f"up-{r}").exists() for r in range(2)), 120, "both ranks up")
    cli.send_signal(signal.SIGUSR1)
    wait_for(lambda: all(got(out, r) == ["SIGUSR1"] for r in range(2)), 30, "SIGUSR1 at both ranks")
    cli.send_signal(signal.SIGUSR2)
    wait_for(lambda: all(got(out, r) == ["SIGUSR1", "SIGUSR2"] for r in range(2)), 30, "SIGUSR2 at both ranks")
    assert cli.poll() is None  # run and its ranks go on
    (out / "finish").touch()


def launch(tmp_path: Path, *flags: str) -> tuple[subprocess.Popen[str], Path]:
    out = tmp_path / "out"
    out.mkdir()
    script = tmp_path / "ranks.py"
    script.write_text(SCRIPT)
    cli = subprocess.Popen([sys.executable, "-m", "trainguard", "run", *flags, "--nproc-per-node", "2", str(script),
                            str(out)], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env={**os.environ, "PYTHONPATH": str(REPO)})
    return cli, out


def test_without_an_agent_the_signals_reach_the_child_ranks(tmp_path: Path) -> None:
    cli, out = launch(tmp_path, "--no-agent")
    signal_both(cli, out)
    _, err = cli.communicate(timeout=60)
    assert cli.returncode == 0, err
    assert "SIGUSR1 forwarded to 2 rank(s)" in err and "SIGUSR2 forwarded to 2 rank(s)" in err


def test_with_an_agent_the_signals_reach_its_ranks_and_its_events_say_so(agent_factory: Any, tmp_path: Path) -> None:
    agent = agent_factory(config="[collectors]\ngpu = false\n")
    cli, out = launch(tmp_path, "--state-dir", str(agent.state_dir), "--job", "usr")
    signal_both(cli, out)
    _, err = cli.communicate(timeout=60)
    assert cli.returncode == 0, err
    assert "SIGUSR1 forwarded to 2 rank(s) of job usr" in err
    said = [e for e in agent.client().events(since=0, limit=1000)["events"] if e["kind"] == "job_signal"]
    assert [(e["fields"]["signal"], e["fields"]["ranks"]) for e in said] == [("SIGUSR1", 2), ("SIGUSR2", 2)]
    with pytest.raises(ApiClientError, match="SIGUSR1, SIGUSR2"):
        agent.client().signal_job("usr", "SIGKILL")  # only what a batch system sends ahead of the end
