"""End to end: a real Prometheus server scrapes a real agent running jobs with injected faults and
the project's own alert rules fire through Prometheus' HTTP API (rank gone, job failed, crash
loop, then the agent itself down).

The rules are the real files with every duration in the alert rules scaled from minutes to quarter
seconds (``for: 2m`` -> ``500ms``, ``[15m]`` -> ``[3750ms]``), so the alerts keep their logic and
fire within seconds against a 1 s scrape and evaluation interval.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.helpers.waiting import wait_for
from trainguard.agent.lifecycle.launcher import free_port

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "dashboards" / "prometheus"
PROMETHEUS = shutil.which("prometheus")
# A script path, not `-m`: the agent's warm launcher forks `python -m` ranks from a zygote that
# imports torch first (seconds); these torch-free fake ranks start faster cold.
FAKE = [sys.executable, str(REPO / "tests" / "helpers" / "fake_rank.py")]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(PROMETHEUS is None, reason="prometheus server not installed (Debian package prometheus)"),
]

_DURATION = re.compile(r"(?<![\w.])(\d+)([mh])\b")


def _scale(text: str) -> str:
    return _DURATION.sub(lambda m: f"{int(m.group(1)) * (60 if m.group(2) == 'h' else 1) * 250}ms", text)


def scaled_alert_rules(text: str) -> str:
    """The alert rules with minutes turned into quarter seconds (hours into 15 s), in ``for:`` and in
    expressions."""
    doc = yaml.safe_load(text)
    for group in doc["groups"]:
        for rule in group["rules"]:
            rule["for"] = _scale(rule["for"])
            rule["expr"] = _scale(rule["expr"])
            assert not re.search(r"(?<![\w.])\d+[hd]\b", rule["expr"]), f"{rule['alert']}: unscaled duration"
    return yaml.safe_dump(doc, sort_keys=False)


def test_scaling_keeps_names_and_scales_durations() -> None:
    rule = "rate(x[5m]) > 0 and on (instance) (y offset 15m) and job:z:p99_5m > 1"
    assert _scale(rule) == "rate(x[1250ms]) > 0 and on (instance) (y offset 3750ms) and job:z:p99_5m > 1"
    assert _scale("0m") == "0ms"
    assert _scale("x[1h]") == "x[15000ms]"


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return json.loads(resp.read())


class Prometheus:
    def __init__(self, base: str, proc: subprocess.Popen[bytes], log: Path) -> None:
        self.base = base
        self.proc = proc
        self.log = log

    def query(self, expr: str) -> list[dict[str, Any]]:
        body = _get(f"{self.base}/api/v1/query?{urllib.parse.urlencode({'query': expr})}")
        assert body["status"] == "success", body
        return list(body["data"]["result"])

    def alerts(self) -> list[dict[str, Any]]:
        return list(_get(f"{self.base}/api/v1/alerts")["data"]["alerts"])


@pytest.fixture
def prometheus_for(tmp_path: Path) -> Iterator[Any]:
    started: list[subprocess.Popen[bytes]] = []

    def start(target: str) -> Prometheus:
        assert PROMETHEUS is not None
        cfg_dir = tmp_path / "prometheus"
        cfg_dir.mkdir()
        (cfg_dir / "alerts.rules.yml").write_text(scaled_alert_rules((RULES / "alerts.rules.yml").read_text()))
        shutil.copy(RULES / "recording.rules.yml", cfg_dir / "recording.rules.yml")
        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "rule_files": ["recording.rules.yml", "alerts.rules.yml"],
            "scrape_configs": [
                {"job_name": "trainguard", "honor_labels": True, "static_configs": [{"targets": [target]}]}
            ],
        }
        (cfg_dir / "prometheus.yml").write_text(yaml.safe_dump(config))
        log = cfg_dir / "prometheus.log"
        for _attempt in range(3):  # the free port may be taken between probe and bind
            port = free_port()
            with open(log, "ab") as fh:
                proc = subprocess.Popen(
                    [PROMETHEUS, f"--config.file={cfg_dir / 'prometheus.yml'}", f"--storage.tsdb.path={cfg_dir / 'data'}",
                     f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                    stdout=fh, stderr=subprocess.STDOUT,
                )
            started.append(proc)
            base = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and proc.poll() is None:
                try:
                    with urllib.request.urlopen(f"{base}/-/ready", timeout=1) as resp:
                        if resp.status == 200:
                            return Prometheus(base, proc, log)
                except OSError:
                    time.sleep(0.1)
            proc.kill()
            proc.wait()
        raise RuntimeError(f"prometheus did not start:\n{log.read_text()}")

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def test_alerts_fire_from_real_faults(agent_factory, prometheus_for) -> None:  # noqa: ANN001
    agent = agent_factory()
    target = urllib.parse.urlparse(agent.metrics_url()).netloc
    prom = prometheus_for(target)
    rules = _get(f"{prom.base}/api/v1/rules")["data"]["groups"]
    assert {g["name"] for g in rules} == {"trainguard.recording", "trainguard.alerts"}

    client = agent.client()
    # Fault 1: rank 1 leaves the job (exits 0 at step 3) while rank 0 trains on.
    client.submit_job({
        "job": "rank-gone", "nproc": 2, "command": FAKE,
        "env": {"FAKE_STEPS": "100000", "FAKE_STEP_S": "0.05", "FAKE_EXIT_AT": "1:3:0"},
    })
    # The crash-loop rule only trusts a new event counter once Prometheus watched the agent for
    # the whole window (here 3.75 s): wait for that, then crash a job.
    wait_for(lambda: prom.query(f'trainguard_agent_ticks_total{{instance="{target}"}} offset 3750ms'),
             30, "Prometheus to hold 3.75 s of the agent's samples", interval=0.2)
    # Fault 2: rank 0 dies with exit code 3 at step 2 on every attempt; no restarts allowed.
    client.submit_job({
        "job": "crashy", "nproc": 2, "command": FAKE, "max_restarts": 0,
        "env": {"FAKE_STEPS": "1000", "FAKE_STEP_S": "0.05", "FAKE_EXIT_AT": "0:2:3", "FAKE_EXIT_ALWAYS": "1"},
    })

    wanted = {
        ("TrainguardRankDown", "rank-gone"),
        ("TrainguardJobFailed", "crashy"),
        ("TrainguardCrashLoop", None),
    }
    seen: dict[tuple[str, str | None], dict[str, Any]] = {}

    def all_fired() -> bool:
        for alert in prom.alerts():
            labels = alert["labels"]
            key = (labels["alertname"], labels.get("job") if labels["alertname"] != "TrainguardCrashLoop" else None)
            # With the scaled for: (0.5 s) RankDown also fires while the job's ranks are still being
            # launched (0 alive); what counts is the state after rank 1 left: 1 of 2 alive.
            if key == ("TrainguardRankDown", "rank-gone") and float(alert["value"]) != 1.0:
                continue
            if key in wanted and alert["state"] == "firing":
                seen.setdefault(key, alert)
        return wanted <= set(seen)

    wait_for(all_fired, 40, "the alerts to fire", interval=0.2,
             diagnose=lambda: f"fired: {sorted(seen)}; alerts now: {prom.alerts()}\nagent log:\n{agent.log()[-3000:]}")

    rank_down = seen[("TrainguardRankDown", "rank-gone")]
    assert rank_down["labels"]["severity"] == "critical"
    assert rank_down["labels"]["instance"] == target
    assert "rank-gone" in rank_down["annotations"]["summary"]
    failed = seen[("TrainguardJobFailed", "crashy")]
    assert failed["labels"]["state"] == "failed" and "crashy" in failed["annotations"]["description"]
    crash = seen[("TrainguardCrashLoop", None)]
    assert crash["labels"]["instance"] == target
    for alert in seen.values():
        for text in alert["annotations"].values():
            assert "error expanding" not in text and "<no value>" not in text, text
        assert alert["annotations"]["runbook"].lstrip().startswith("1.")
    # The dashboard's queries run on the real server, and the core panels show the running job.
    dashboard = json.loads((REPO / "dashboards" / "grafana" / "trainguard.json").read_text())
    with_data: set[str] = set()
    for panel in dashboard["panels"]:
        for tgt in panel.get("targets", []):
            expr = tgt["expr"].replace("$__rate_interval", "5s")
            expr = re.sub(r"\$\{?\w+\}?", ".*", expr)
            if prom.query(expr):  # raises on a query the server refuses
                with_data.add(panel["title"])
    core = {"Step time per rank", "Loss", "Learning rate", "Batch size per rank", "Samples per second per rank",
            "Job state", "Training progress (step)", "Run-queue latency, node-wide", "CPU busy",
            # from the recording rules, evaluated by the server on the agent's data
            "Step time per job (p50 and worst rank)", "Samples per second per job"}
    assert core <= with_data, f"panels without data: {sorted(core - with_data)}"

    # The agent says the same about the crash loop in its own event log.
    kinds = [e["kind"] for e in client.events(since=0, limit=1000)["events"]]
    assert "crash_loop" in kinds

    # Fault 3: the agent itself goes away.
    assert agent.stop() == 0

    def agent_down() -> bool:
        return any(
            a["labels"]["alertname"] == "TrainguardAgentDown" and a["labels"]["instance"] == target and a["state"] == "firing"
            for a in prom.alerts()
        )

    wait_for(agent_down, 20, "TrainguardAgentDown to fire", interval=0.2)
