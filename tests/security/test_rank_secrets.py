"""A job's secrets reach its ranks and nothing else: no command line, no event, none of the
agent's own environment in a rank; a config file holding a credential must be its owner's alone;
the agent says once when ranks run as root."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.waiting import wait_for
from trainguard.agent.config import ConfigError, load_config
from trainguard.agent.eventlog import EventLog

PROBE = """\
import os, time
print(f"hf={os.environ.get('HF_TOKEN') == os.environ.get('EXPECTED')} agent={'TG_AGENT_ONLY' in os.environ}", flush=True)
time.sleep(4)
"""


def _cmdlines_with(secret: str) -> list[int]:
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if secret.encode() in (proc / "cmdline").read_bytes():
                found.append(int(proc.name))
        except OSError:
            pass
    return found


def _wait_job(client: Any, job: str, states: set[str], timeout: float = 120) -> dict[str, Any]:
    return wait_for(lambda: (got := client.job(job))["state"] in states and got, timeout, f"job {job} in {states}",
                    interval=0.1, diagnose=lambda: str(client.job(job)))


@pytest.mark.parametrize("warm", [True, False])
def test_a_jobs_secret_reaches_its_rank_and_no_command_line_or_event(agent_factory: Any, tmp_path: Path,
                                                                     warm: bool) -> None:
    secret = f"hf_{uuid.uuid4().hex}"
    agent = agent_factory(config=f"[collectors]\nebpf = false\ngpu = false\n[recovery]\nwarm_launcher = {str(warm).lower()}\n",
                          env={"TG_AGENT_ONLY": "the agent's own credential"})
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    client = agent.client()
    client.submit_job({"job": "sec", "nproc": 1, "command": [sys.executable, str(script)],
                       "env": {"HF_TOKEN": secret, "EXPECTED": secret}})
    running = _wait_job(client, "sec", {"running", "succeeded", "failed"})
    log = Path(agent.state_dir / "jobs" / "sec" / "rank0.log")
    deadline = time.monotonic() + 60
    while "hf=" not in (log.read_text() if log.exists() else "") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _cmdlines_with(secret) == [], "a process shows the job's secret on its command line"
    assert running["state"] == "running", running
    assert _wait_job(client, "sec", {"succeeded", "failed"})["state"] == "succeeded", log.read_text()
    assert "hf=True agent=False" in log.read_text()
    events = client.events(since=0, limit=1000)["events"]
    assert secret not in json.dumps(events)
    assert all(secret.encode() not in p.read_bytes() for p in (agent.state_dir / "events").glob("events.jsonl*"))
    if os.geteuid() == 0:
        said = [e for e in events if e["kind"] == "ranks_run_as_root"]
        assert len(said) == 1 and said[0]["severity"] == "warning", said


@pytest.mark.skipif(os.geteuid() != 0, reason="ranks run as root only under a root agent")
def test_an_agent_with_launcher_user_does_not_say_ranks_run_as_root(agent_factory: Any) -> None:
    agent = agent_factory(config='[collectors]\nebpf = false\ngpu = false\n[launcher]\nuser = "nobody"\n')
    kinds = [e["kind"] for e in agent.client().events(since=0, limit=1000)["events"]]
    assert "agent_started" in kinds and "ranks_run_as_root" not in kinds


def test_job_env_values_are_redacted_in_events(tmp_path: Path) -> None:
    log = EventLog(str(tmp_path), "n1", fsync=False)
    secret = f"key-{uuid.uuid4().hex}"
    log.emit("job_placed", "placed", job="j", spec={"job": "j", "env": {"AWS_SECRET_ACCESS_KEY": secret}},
             env={"WANDB_API_KEY": secret}, specs=[{"env": {"X": secret}}])
    log.close()
    text = (tmp_path / "events.jsonl").read_text()
    assert secret not in text and "AWS_SECRET_ACCESS_KEY" in text and "WANDB_API_KEY" in text
    assert secret not in json.dumps(log.since(0))


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604])
def test_a_config_holding_a_secret_must_be_the_owners_alone(tmp_path: Path, mode: int) -> None:
    cfg = tmp_path / "agent.toml"
    cfg.write_text('[checkpoint.object]\nurl = "s3://b/p"\nkey = "AKIA"\nsecret = "TOPSECRET"\n')
    cfg.chmod(mode)
    with pytest.raises(ConfigError) as got:
        load_config(str(cfg), must_exist=True)
    assert got.value.key == "checkpoint.object.secret" and str(cfg) in str(got.value), got.value
    assert "TOPSECRET" not in str(got.value)
    out = subprocess.run([sys.executable, "-m", "trainguard", "agent", "--check-config", str(cfg)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "checkpoint.object.secret" in out.stderr and str(cfg) in out.stderr, out
    cfg.chmod(0o600)
    assert load_config(str(cfg), must_exist=True).checkpoint.object.secret == "TOPSECRET"


def test_a_config_without_secrets_may_be_readable(tmp_path: Path) -> None:
    cfg = tmp_path / "agent.toml"
    cfg.write_text('[checkpoint.object]\nurl = "s3://b/p"\nsecret = ""\n')
    cfg.chmod(0o644)
    assert load_config(str(cfg), must_exist=True).checkpoint.object.url == "s3://b/p"
