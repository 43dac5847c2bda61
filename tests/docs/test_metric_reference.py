"""The generated metric reference: complete (a live agent exports nothing it does not list), free of
duplicates, and METRICS.md is what the code generates now."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from trainguard.agent.metric_reference import (
    MODULES,
    REGENERATE,
    all_specs,
    collect,
    exported_names,
    render_markdown,
    sample_names,
    to_spec,
)
from trainguard.agent.metricspec import MetricSpec

REPO = Path(__file__).resolve().parents[2]


def test_metrics_md_is_up_to_date() -> None:
    current = (REPO / "METRICS.md").read_text()
    assert current == render_markdown(), f"METRICS.md is stale: regenerate it with `{REGENERATE}`"


def test_every_declared_metric_is_in_the_reference() -> None:
    specs = all_specs()
    names = [s.name for s in specs]
    expected = 0
    for module in MODULES:
        declared = importlib.import_module(module).METRICS
        expected += len(declared)
        for item in declared:
            name = item.name if isinstance(item, MetricSpec) else item[0]
            assert name in names, f"{name} from {module} missing"
    assert len(names) == expected == len(set(names))
    text = render_markdown()
    for spec in specs:
        assert f"| `{spec.name}` | {spec.type} |" in text


def test_every_module_declaring_metrics_is_listed() -> None:
    """A module with a top-level METRICS that MODULES forgot (directly or through its package)."""
    listed = [importlib.import_module(m).METRICS for m in MODULES]
    for path in sorted((REPO / "agent").rglob("*.py")):
        if not re.search(r"^METRICS\b", path.read_text(), re.M):
            continue
        module = ".".join(("trainguard", *path.relative_to(REPO).with_suffix("").parts))
        declared = importlib.import_module(module).METRICS
        assert any(declared is m for m in listed), f"{module}.METRICS is not in agent.metric_reference.MODULES"


def test_a_name_declared_twice_is_refused() -> None:
    with pytest.raises(ValueError, match="declared twice"):
        collect(["trainguard.agent.agent_metrics", "trainguard.agent.agent_metrics"])


def test_tuples_are_normalised_and_checked() -> None:
    spec = to_spec(("trainguard_x_seconds", "gauge", "seconds", ("job",), "Help."), "m")
    assert spec == MetricSpec("trainguard_x_seconds", "gauge", "seconds", ("job",), "Help.")
    with pytest.raises(ValueError, match="trainguard_y.*summary"):
        to_spec(("trainguard_y", "summary", "", (), "h"), "m")
    with pytest.raises(ValueError, match="5-tuple"):
        to_spec(("trainguard_y", "gauge", "", ()), "m")
    with pytest.raises(ValueError, match="labels"):
        to_spec(("trainguard_y", "gauge", "", ["job"], "h"), "m")
    # MetricSpec's own conventions apply to tuple declarations too.
    with pytest.raises(ValueError, match="_total"):
        to_spec(("trainguard_errors", "counter", "", (), "h"), "m")


def test_histograms_expose_three_series() -> None:
    spec = MetricSpec("trainguard_z_seconds", "histogram", "seconds", (), "h")
    assert sample_names(spec) == ("trainguard_z_seconds_bucket", "trainguard_z_seconds_sum", "trainguard_z_seconds_count")
    assert "trainguard_runqueue_latency_seconds_bucket" in exported_names()
    assert "trainguard_runqueue_latency_seconds" not in exported_names()


def test_command_line_prints_the_reference() -> None:
    out = subprocess.run([sys.executable, "-m", "trainguard.agent.metric_reference"], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout == render_markdown()
    bad = subprocess.run([sys.executable, "-m", "trainguard.agent.metric_reference", "extra"], cwd=REPO, capture_output=True, text=True)
    assert bad.returncode == 2 and "METRICS.md" in bad.stderr


def test_a_live_agent_exports_only_referenced_metrics(agent_factory) -> None:
    agent = agent_factory()
    # Collectors read once per main-loop tick: before the first tick their families are empty.
    deadline = time.monotonic() + 30
    while True:
        with urllib.request.urlopen(agent.metrics_url(), timeout=10) as resp:
            text = resp.read().decode()
        samples = [s for fam in text_string_to_metric_families(text) for s in fam.samples]
        ticks = [s.value for s in samples if s.name == "trainguard_agent_ticks_total"]
        if (ticks and ticks[0] >= 2) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    seen = {s.name for s in samples}
    assert len(seen) > 30, "the agent exported almost nothing"
    unknown = sorted(n for n in seen if n not in exported_names())
    assert not unknown, f"exported but missing from agent.metric_reference.MODULES: {unknown}"
