"""dashboards/: alert and recording rules (structure, real promtool checks and unit tests), the
Grafana dashboard and the example scrape / Alertmanager configs.

Every query in the rules and the dashboard may only name metrics the agent exports (from
agent.metric_reference), recording rules defined here, or Prometheus' own ``up``.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from trainguard.agent.collectors.gpu import FATAL_XIDS
from trainguard.agent.metric_reference import exported_names

REPO = Path(__file__).resolve().parents[2]
PROM = REPO / "dashboards" / "prometheus"
ALERTS = PROM / "alerts.rules.yml"
RECORDING = PROM / "recording.rules.yml"
ALERT_TESTS = PROM / "tests" / "alerts_test.yml"
RECORDING_TESTS = PROM / "tests" / "recording_test.yml"
SCRAPE = PROM / "scrape-example.yml"
ALERTMANAGER = REPO / "dashboards" / "alertmanager-example.yml"
GRAFANA = REPO / "dashboards" / "grafana" / "trainguard.json"

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool not installed (Debian package prometheus); structural checks still run"
)

SEVERITIES = {"critical", "warning", "info"}
PROMETHEUS_OWN = {"up"}

# --- PromQL metric names ------------------------------------------------------------------------
_KEYWORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "offset", "bool", "and", "or", "unless",
    "inf", "nan", "atan2",
}
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENT = re.compile(r"(?<![\w.:$])([A-Za-z_:][\w:]*)")
_LABEL_VALUES = re.compile(r"^\s*label_values\((.*),\s*\w+\s*\)\s*$", re.S)


def metric_names(expr: str) -> set[str]:
    """Metric (and recording rule) names a PromQL expression selects.

    Strings, label matchers, range/subquery brackets and grouping label lists are removed first;
    what remains that is not a function call, an operator keyword or a number is a metric name.
    Grafana variables ($job, ${node}, $__rate_interval) only occur inside those removed parts.
    """
    m = _LABEL_VALUES.match(expr)
    if m:
        expr = m.group(1)
    elif expr.strip().startswith("label_values("):
        return set()  # label_values(label): no metric
    expr = _STRING.sub('""', expr)
    expr = re.sub(r"\{[^}]*\}", " ", expr)
    expr = re.sub(r"\[[^\]]*\]", " ", expr)
    expr = _GROUPING.sub(" ", expr)
    names: set[str] = set()
    for match in _IDENT.finditer(expr):
        word = match.group(1)
        rest = expr[match.end():].lstrip()
        if rest.startswith("(") or word.lower() in _KEYWORDS:
            continue
        names.add(word)
    return names


def test_metric_names_known_answers() -> None:
    assert metric_names('rate(trainguard_x_total{job=~"$job", a="b(c)"}[$__rate_interval])') == {"trainguard_x_total"}
    assert metric_names("sum by (instance, le) (rate(a_bucket[5m])) > 0.01") == {"a_bucket"}
    assert metric_names("sum(a) by (job) / on (job) group_left (rank) b offset 15m") == {"a", "b"}
    assert metric_names("x != x or abs(y) == +Inf and z > 1e-3") == {"x", "y", "z"}
    assert metric_names("histogram_quantile(0.99, sum without (pid) (rate(h_bucket[1m])))") == {"h_bucket"}
    assert metric_names("job:trainguard_rank_step_seconds:p50 * on (job) up") == {"job:trainguard_rank_step_seconds:p50", "up"}
    assert metric_names('label_values(trainguard_rank_step{job=~"$job"}, rank)') == {"trainguard_rank_step"}
    assert metric_names("label_values(instance)") == set()


# --- rule files ---------------------------------------------------------------------------------
def load_rules(path: Path) -> list[dict[str, Any]]:
    doc = yaml.safe_load(path.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def alerts() -> list[dict[str, Any]]:
    return [r for r in load_rules(ALERTS) if "alert" in r]


def recorded_names() -> set[str]:
    return {r["record"] for r in load_rules(RECORDING)}


def allowed_names() -> set[str]:
    return set(exported_names()) | recorded_names() | PROMETHEUS_OWN


REQUIRED_ALERTS = {
    "TrainguardAgentDown", "TrainguardRankDown", "TrainguardTrainingStalled", "TrainguardCrashLoop",
    "TrainguardStragglerPersisting", "TrainguardLossDiverged", "TrainguardCheckpointStale",
    "TrainguardCheckpointWriteFailures", "TrainguardGpuXidFatal", "TrainguardGpuEccUncorrected",
    "TrainguardGpuThermalThrottle", "TrainguardGpuPowerThrottle", "TrainguardHighRunQueueLatency",
    "TrainguardTelemetryDrops",
}


def test_alert_rules_are_complete_and_documented() -> None:
    rules = alerts()
    names = [r["alert"] for r in rules]
    assert len(names) == len(set(names)), "duplicate alert names"
    assert REQUIRED_ALERTS <= set(names), f"missing: {REQUIRED_ALERTS - set(names)}"
    for rule in rules:
        name = rule["alert"]
        assert name.startswith("Trainguard"), name
        assert "for" in rule and re.fullmatch(r"\d+[smh]", rule["for"]), f"{name}: needs an explicit for: duration"
        assert rule.get("labels", {}).get("severity") in SEVERITIES, f"{name}: severity"
        notes = rule.get("annotations", {})
        for key in ("summary", "description", "runbook"):
            assert len(notes.get(key, "").strip()) > 20, f"{name}: annotation {key} missing or empty"
        steps = re.findall(r"^\s*\d+\. ", notes["runbook"], re.M)
        assert len(steps) >= 2, f"{name}: the runbook should list numbered steps"


def test_recording_rules_follow_naming() -> None:
    for rule in load_rules(RECORDING):
        assert re.fullmatch(r"[a-z_]+:trainguard_[a-z0-9_]+:[a-z0-9_]+", rule["record"]), rule["record"]


def test_rules_name_only_exported_metrics() -> None:
    allowed = allowed_names()
    for rule in load_rules(ALERTS) + load_rules(RECORDING):
        unknown = metric_names(rule["expr"]) - allowed
        assert not unknown, f"{rule.get('alert') or rule.get('record')}: not exported by the agent: {unknown}"


def test_fatal_xid_class_matches_the_collector() -> None:
    by_name = {r["alert"]: r for r in alerts()}
    wanted = set(map(str, FATAL_XIDS))
    for name, op in (("TrainguardGpuXidFatal", "=~"), ("TrainguardGpuXid", "!~")):
        classes = re.findall(r'xid' + op + r'"([0-9|]+)"', by_name[name]["expr"])
        assert classes, f"{name}: no xid {op} matcher"
        for cls in classes:
            assert set(cls.split("|")) == wanted, f"{name}: fatal XIDs differ from agent.collectors.gpu.FATAL_XIDS"


def test_every_alert_has_a_firing_and_a_quiet_unit_test() -> None:
    doc = yaml.safe_load(ALERT_TESTS.read_text())
    fires: set[str] = set()
    quiet: set[str] = set()
    for test in doc["tests"]:
        for case in test.get("alert_rule_test", []):
            (fires if case.get("exp_alerts") else quiet).add(case["alertname"])
    names = {r["alert"] for r in alerts()}
    assert names - fires == set(), f"no test where these fire: {names - fires}"
    assert names - quiet == set(), f"no test where these stay quiet: {names - quiet}"
    assert (fires | quiet) <= names, f"tests for unknown alerts: {(fires | quiet) - names}"


def _promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run([PROMTOOL, *args], cwd=cwd, capture_output=True, text=True, timeout=60)


def _copy_with_rules(tmp_path: Path, rules_text: str) -> Path:
    """The alert tests, unchanged, next to a copy of the rules with ``rules_text``."""
    (tmp_path / "tests").mkdir()
    (tmp_path / ALERTS.name).write_text(rules_text)
    test_file = tmp_path / "tests" / ALERT_TESTS.name
    shutil.copy(ALERT_TESTS, test_file)
    return test_file


@needs_promtool
def test_promtool_check_rules() -> None:
    out = _promtool("check", "rules", str(RECORDING), str(ALERTS), cwd=PROM)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"{len(alerts())} rules found" in out.stdout


@needs_promtool
def test_promtool_alert_unit_tests_as_shipped() -> None:
    """`promtool test rules` on the shipped files, as a user runs it: labels and annotations."""
    tests = sorted(p.name for p in ALERT_TESTS.parent.glob("*.yml"))
    out = _promtool("test", "rules", *tests, cwd=ALERT_TESTS.parent)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("SUCCESS") == len(tests), out.stdout


def test_expected_annotations_are_rendered_for_every_alert() -> None:
    """Every alert has a firing case whose expected annotations are fully rendered text: promtool
    then proves the templates render to exactly that."""
    rendered: set[str] = set()
    for test in yaml.safe_load(ALERT_TESTS.read_text())["tests"]:
        for case in test.get("alert_rule_test", []):
            for alert in case.get("exp_alerts") or []:
                notes = alert.get("exp_annotations", {})
                assert set(notes) == {"summary", "description", "runbook"}, (case["alertname"], sorted(notes))
                for text in notes.values():
                    assert "{{" not in text and "<no value>" not in text, (case["alertname"], text)
                rendered.add(case["alertname"])
    assert rendered == {r["alert"] for r in alerts()}


@needs_promtool
def test_promtool_recording_unit_tests() -> None:
    out = _promtool("test", "rules", RECORDING_TESTS.name, cwd=RECORDING_TESTS.parent)
    assert out.returncode == 0, out.stdout + out.stderr


@needs_promtool
@pytest.mark.parametrize(
    ("original", "broken", "alert"),
    [
        # RankDown without its for: would page on every routine restart.
        ("        expr: trainguard_job_ranks_alive < trainguard_job_ranks\n        for: 2m\n",
         "        expr: trainguard_job_ranks_alive < trainguard_job_ranks\n        for: 0m\n", "TrainguardRankDown"),
        # CrashLoop without the guard would page for old crash loops whenever Prometheus starts.
        ("            and on (instance) (trainguard_agent_ticks_total offset 15m)\n", "", "TrainguardCrashLoop"),
    ],
    ids=["rank-down-without-for", "crash-loop-without-guard"],
)
def test_unit_tests_catch_a_broken_rule(tmp_path: Path, original: str, broken: str, alert: str) -> None:
    text = ALERTS.read_text()
    assert original in text, "the rule changed: update this mutation"
    test_file = _copy_with_rules(tmp_path, text.replace(original, broken))
    out = _promtool("test", "rules", test_file.name, cwd=test_file.parent)
    report = out.stdout + out.stderr
    assert out.returncode != 0 and f"alertname: {alert}" in report, report


# --- example configs ----------------------------------------------------------------------------
def test_scrape_example_structure() -> None:
    doc = yaml.safe_load(SCRAPE.read_text())
    assert set(doc["rule_files"]) == {RECORDING.name, ALERTS.name}
    (job,) = [j for j in doc["scrape_configs"] if j["job_name"] == "trainguard"]
    # The rules join on the training job in `job`: the agent's label must survive the scrape.
    assert job["honor_labels"] is True
    assert job["static_configs"][0]["targets"]
    patterns = [f for sd in job["file_sd_configs"] for f in sd["files"]]
    found = [p for pattern in patterns for p in SCRAPE.parent.glob(pattern)]
    assert found, "the file_sd pattern matches no example target file"
    for path in found:
        groups = json.loads(path.read_text()) if path.suffix == ".json" else yaml.safe_load(path.read_text())
        assert all(g["targets"] and all(t.endswith(":9478") for t in g["targets"]) for g in groups)


@needs_promtool
def test_promtool_check_scrape_example() -> None:
    out = _promtool("check", "config", SCRAPE.name, cwd=SCRAPE.parent)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "WARNING" not in out.stdout + out.stderr


def _matched_alerts(matchers: list[str], names: set[str]) -> set[str]:
    out = set(names)
    for matcher in matchers:
        m = re.fullmatch(r'\s*(\w+)\s*(=~|!~|!=|=)\s*"([^"]*)"\s*', matcher)
        assert m, f"cannot read matcher {matcher!r}"
        label, op, value = m.groups()
        if label != "alertname":
            continue
        if op == "=":
            out = {n for n in out if n == value}
        elif op == "!=":
            out = {n for n in out if n != value}
        elif op == "=~":
            out = {n for n in out if re.fullmatch(value, n)}
        else:
            out = {n for n in out if not re.fullmatch(value, n)}
    return out


def test_alertmanager_example_routes_every_alert() -> None:
    doc = yaml.safe_load(ALERTMANAGER.read_text())
    receivers = {r["name"] for r in doc["receivers"]}
    names = {r["alert"] for r in alerts()}
    by_severity = {r["alert"]: r["labels"]["severity"] for r in alerts()}
    route = doc["route"]
    assert route["receiver"] in receivers
    for sub in route["routes"]:
        assert sub["receiver"] in receivers
        assert _matched_alerts(sub["matchers"], names), f"route {sub['matchers']} matches no alert"
    # Each severity has a route that catches all its alerts.
    for severity in SEVERITIES:
        routes = [s for s in route["routes"] if f'severity = "{severity}"' in s["matchers"]]
        assert routes, f"no route for severity {severity}"
        caught = _matched_alerts([m for m in routes[0]["matchers"] if "alertname" in m], names)
        assert {n for n, s in by_severity.items() if s == severity} <= caught
    for rule in doc["inhibit_rules"]:
        assert _matched_alerts(rule["source_matchers"], names)
        assert _matched_alerts(rule["target_matchers"], names)


EXPECTED_RECEIVERS = {"critical": "ml-infra-pager", "warning": "ml-infra-chat", "info": "ml-infra-low-priority"}


def test_alertmanager_example_with_amtool() -> None:
    amtool = shutil.which("amtool")
    if amtool is None:
        pytest.skip("amtool not installed (Debian package prometheus-alertmanager); structure checked above")
    out = subprocess.run([amtool, "check-config", str(ALERTMANAGER)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    # Where each alert goes, by Alertmanager's own routing code.
    for rule in alerts():
        name, severity = rule["alert"], rule["labels"]["severity"]
        out = subprocess.run(
            [amtool, "config", "routes", "test", f"--config.file={ALERTMANAGER}", f"alertname={name}",
             f"severity={severity}", "instance=n1:9478", "job=j1"],
            capture_output=True, text=True, timeout=60,
        )
        assert out.returncode == 0, out.stdout + out.stderr
        receivers = set(out.stdout.strip().split(","))
        expected = {EXPECTED_RECEIVERS[severity]} | ({"datacenter-ops"} if name.startswith("TrainguardGpu") else set())
        assert receivers == expected, f"{name}: routed to {receivers}"


# --- Grafana ------------------------------------------------------------------------------------
def grafana() -> dict[str, Any]:
    return json.loads(GRAFANA.read_text())


def panel_queries(dash: dict[str, Any]) -> list[tuple[str, str]]:
    """(where, expression) for every query in panels, annotations and variables."""
    out: list[tuple[str, str]] = []
    for panel in dash["panels"]:
        for target in panel.get("targets", []):
            out.append((f"panel {panel['title']!r}", target["expr"]))
    for ann in dash["annotations"]["list"]:
        if "expr" in ann:
            out.append((f"annotation {ann['name']!r}", ann["expr"]))
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            out.append((f"variable {var['name']!r}", query))
    return out


def test_grafana_queries_name_only_exported_metrics() -> None:
    allowed = allowed_names()
    queries = panel_queries(grafana())
    assert len(queries) > 40
    for where, expr in queries:
        names = metric_names(expr)
        assert names, f"{where}: no metric in {expr!r}"
        assert not names - allowed, f"{where}: not exported by the agent: {names - allowed}"


GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__interval": "1m", "${datasource}": "x"}


def as_promql(expr: str) -> str:
    """A dashboard query as plain PromQL: variables filled in, label_values() reduced to its selector."""
    m = _LABEL_VALUES.match(expr)
    if m:
        expr = m.group(1)
    for var, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(var, value)
    return re.sub(r"\$\{?(\w+)\}?", ".*", expr)  # $job, $node, $rank: multi-value regex matchers


@needs_promtool
def test_grafana_queries_parse_as_promql(tmp_path: Path) -> None:
    # promtool has no expression parser of its own in 2.42; as recording rules it parses them all.
    rules = [
        {"record": f"grafana_check:query_{i}:parse", "expr": as_promql(expr)}
        for i, (_where, expr) in enumerate(panel_queries(grafana()))
    ]
    path = tmp_path / "grafana-queries.rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "grafana", "rules": rules}]}))
    out = _promtool("check", "rules", str(path), cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr


def test_grafana_dashboard_structure() -> None:
    dash = grafana()
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for name in ("node", "job", "rank"):
        assert variables[name]["type"] == "query" and variables[name]["datasource"]["uid"] == "${datasource}"
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    cells: dict[tuple[int, int], str] = {}
    for panel in dash["panels"]:
        g = panel["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, panel["title"]
        for cell in ((x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])):
            assert cell not in cells, f"{panel['title']!r} overlaps {cells[cell]!r}"
            cells[cell] = panel["title"]
    for panel in panels:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"], panel["title"]
    # Panels over rank metrics follow the variables.
    for panel in panels:
        for target in panel["targets"]:
            if "trainguard_rank_" in target["expr"] and "job:" not in target["expr"]:
                assert '$job' in target["expr"] and '$rank' in target["expr"], panel["title"]
    exprs = " ".join(t["expr"] for p in panels for t in p["targets"])
    for metric in (
        "trainguard_rank_step_seconds", "trainguard_rank_straggler_score", "job:trainguard_rank_samples:rate1m",
        "trainguard_rank_loss", "trainguard_rank_lr", "trainguard_rank_batch_size", "trainguard_checkpoint_age_seconds",
        "trainguard_gpu_utilization_ratio", "trainguard_gpu_temperature_celsius", "trainguard_runqueue_latency_seconds_bucket",
    ):
        assert metric in exprs, f"no panel shows {metric}"
    heatmaps = [p for p in panels if p["type"] == "heatmap"]
    assert len(heatmaps) >= 2 and all(t.get("format") == "heatmap" and "by (le)" in t["expr"] for p in heatmaps for t in p["targets"])
    heal = [a for a in dash["annotations"]["list"] if a.get("enable") and "expr" in a]
    assert any("trainguard_job_restarts_total" in a["expr"] for a in heal)
    assert any("trainguard_heal_actions_total" in a["expr"] for a in heal)
