"""Every metric the agent exports, collected from the modules that declare them, and the markdown
reference (METRICS.md) generated from that list.

The declarations in the modules are the one source of truth: the exporter builds its families from
them and this module only reads them, so the reference cannot drift from ``/metrics``. A module
declares ``METRICS`` either as :class:`~agent.metricspec.MetricSpec` objects or as plain
``(name, type, unit, labels, help)`` tuples (modules that predate MetricSpec); both are normalised
here, validated by MetricSpec's own rules, and a name claimed twice is refused.

Regenerate the reference with ``python -m trainguard.agent.metric_reference > METRICS.md``.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from trainguard.agent.metricspec import MetricSpec

MODULES: tuple[str, ...] = (
    "trainguard.agent.exporter",
    "trainguard.agent.agent_metrics",
    "trainguard.agent.collectors.gpu",
    "trainguard.agent.collectors.ebpf",
    "trainguard.agent.checkpoint",
    "trainguard.agent.detect.service",
    "trainguard.agent.recovery.service",
    "trainguard.agent.controller.controller",
    "trainguard.agent.cluster.service",
)
"""Modules whose ``METRICS`` the agent exports, in reference order. A module that adds metrics
appends its import path here (a test fails while a live agent exports a name missing from this
list), then regenerates METRICS.md (a test fails while it is stale)."""

REGENERATE = "python -m trainguard.agent.metric_reference > METRICS.md"

_TYPES = ("gauge", "counter", "histogram")


@dataclass(frozen=True)
class Entry:
    spec: MetricSpec
    module: str


def to_spec(item: Any, module: str) -> MetricSpec:
    """A MetricSpec from a MetricSpec or a ``(name, type, unit, labels, help)`` tuple."""
    if isinstance(item, MetricSpec):
        return item
    if not isinstance(item, tuple) or len(item) != 5:
        raise ValueError(f"{module}.METRICS: entry {item!r} is neither a MetricSpec nor a 5-tuple")
    name, mtype, unit, labels, doc = item
    if mtype not in _TYPES:
        raise ValueError(f"{module}.METRICS: metric {name}: type {mtype!r} is not one of {', '.join(_TYPES)}")
    if not isinstance(labels, tuple) or not all(isinstance(label, str) for label in labels):
        raise ValueError(f"{module}.METRICS: metric {name}: labels must be a tuple of strings")
    return MetricSpec(str(name), mtype, str(unit), labels, str(doc))


def collect(modules: Sequence[str] = MODULES) -> list[Entry]:
    """Every declared metric with the module that declares it; refuses a name declared twice."""
    entries: list[Entry] = []
    seen: dict[str, str] = {}
    for module in modules:
        declared: Iterable[Any] = importlib.import_module(module).METRICS
        for item in declared:
            spec = to_spec(item, module)
            if spec.name in seen:
                raise ValueError(f"metric {spec.name} declared twice: in {seen[spec.name]} and {module}")
            seen[spec.name] = module
            entries.append(Entry(spec, module))
    return entries


def all_specs(modules: Sequence[str] = MODULES) -> list[MetricSpec]:
    return [e.spec for e in collect(modules)]


def sample_names(spec: MetricSpec) -> tuple[str, ...]:
    """Series names a query can use for this metric (histograms expose three)."""
    if spec.type == "histogram":
        return (f"{spec.name}_bucket", f"{spec.name}_sum", f"{spec.name}_count")
    return (spec.name,)


def exported_names(modules: Sequence[str] = MODULES) -> frozenset[str]:
    """Every series name the agent can expose, for checking queries in rules and dashboards."""
    return frozenset(n for spec in all_specs(modules) for n in sample_names(spec))


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_markdown(modules: Sequence[str] = MODULES) -> str:
    entries = collect(modules)
    lines = [
        "# trainguard metric reference",
        "",
        f"Generated from the metric declarations in the agent's code by `{REGENERATE}`;",
        "a test fails when this file is out of date. Do not edit it by hand.",
        "",
        "Conventions: every name starts with `trainguard_`, values are in base units (seconds, bytes),",
        "counters end in `_total`, histograms expose `_bucket`, `_sum` and `_count` series.",
        "",
        "Rank metrics carry the training job in a `job` label. Prometheus also sets `job` (the scrape",
        "job) on every target, so scrape the agent with `honor_labels: true` (see",
        "`dashboards/prometheus/scrape-example.yml`); series without a training job (host, node-wide",
        "kernel figures, agent counters) then carry the scrape job's name in `job`.",
        "",
        f"{len(entries)} metrics from {len(modules)} modules.",
        "",
    ]
    for module in modules:
        mine = [e.spec for e in entries if e.module == module]
        lines += [f"## `{module}`", "", "| metric | type | unit | labels | meaning |", "|---|---|---|---|---|"]
        for spec in mine:
            labels = ", ".join(f"`{label}`" for label in spec.labels) or "-"
            lines.append(
                f"| `{spec.name}` | {spec.type} | {spec.unit or '-'} | {labels} | {_cell(spec.help)} |"
            )
        lines.append("")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args:
        print(f"usage: {REGENERATE}", file=sys.stderr)
        return 2
    sys.stdout.write(render_markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
