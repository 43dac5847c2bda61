"""One declaration per exported metric, used both to build families at scrape time and to
generate the metric reference, so the two cannot drift apart."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

MetricType = Literal["gauge", "counter", "histogram"]


@dataclass(frozen=True)
class MetricSpec:
    name: str
    """Full name as scraped (counters include ``_total``)."""
    type: MetricType
    unit: str
    """Base unit ("seconds", "bytes"), or "" for counts and ratios."""
    labels: tuple[str, ...]
    help: str

    def __post_init__(self) -> None:
        if not self.name.startswith("trainguard_"):
            raise ValueError(f"metric {self.name}: must start with trainguard_")
        if (self.type == "counter") != self.name.endswith("_total"):
            raise ValueError(f"metric {self.name}: counters, and only counters, end in _total")
        base = self.name.removesuffix("_total")
        if self.unit and not (base.endswith(f"_{self.unit}") or f"_{self.unit}_" in base):
            raise ValueError(f"metric {self.name}: name must carry its unit {self.unit}")

    def gauge(self) -> GaugeMetricFamily:
        assert self.type == "gauge", self.name
        return GaugeMetricFamily(self.name, self.help, labels=self.labels)

    def counter(self) -> CounterMetricFamily:
        assert self.type == "counter", self.name
        # prometheus_client strips and re-adds the _total suffix itself.
        return CounterMetricFamily(self.name, self.help, labels=self.labels)

    def histogram(self) -> HistogramMetricFamily:
        assert self.type == "histogram", self.name
        return HistogramMetricFamily(self.name, self.help, labels=self.labels)


def index(specs: Iterable[MetricSpec]) -> dict[str, MetricSpec]:
    """Name -> spec; refuses duplicates so two modules cannot claim one name."""
    out: dict[str, MetricSpec] = {}
    for spec in specs:
        if spec.name in out:
            raise ValueError(f"metric {spec.name} declared twice")
        out[spec.name] = spec
    return out
