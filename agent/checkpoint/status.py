"""Checkpoint status per tier for the control API and ``/metrics``.

Kept from the events the tiers and the replicator report (commit, failure, corrupt), never by
listing tiers at scrape time: listing an object store on every scrape would cost requests and
could hang the exporter. ``seed`` fills it from real listings once at start-up.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from trainguard.agent.checkpoint.tier import CheckpointInfo

# (name, type, unit, labels, help)
METRICS: tuple[tuple[str, str, str, tuple[str, ...], str], ...] = (
    ("trainguard_checkpoint_newest_step", "gauge", "", ("tier", "job"),
     "Training step of the newest committed checkpoint in this tier."),
    ("trainguard_checkpoint_age_seconds", "gauge", "seconds", ("tier", "job"),
     "Seconds since the newest committed checkpoint in this tier was created."),
    ("trainguard_checkpoint_size_bytes", "gauge", "bytes", ("tier", "job"),
     "Data bytes of the newest committed checkpoint in this tier."),
    ("trainguard_checkpoint_writes_total", "counter", "", ("tier",),
     "Checkpoints committed into this tier."),
    ("trainguard_checkpoint_write_failures_total", "counter", "", ("tier",),
     "Checkpoint writes into this tier that failed (nothing partial was committed)."),
    ("trainguard_checkpoint_corrupt_total", "counter", "", ("tier",),
     "Checkpoints in this tier that failed verification and were skipped."),
)


class CheckpointStatus:
    """Thread-safe per-tier, per-job checkpoint state."""

    def __init__(self, tiers: Iterable[str] = (), clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._tiers: list[str] = []
        self._newest: dict[tuple[str, str], CheckpointInfo] = {}
        self._last_write: dict[tuple[str, str], float] = {}
        self._last_error: dict[str, str] = {}
        self._writes: Counter[str] = Counter()
        self._failures: Counter[str] = Counter()
        self._corrupt: Counter[str] = Counter()
        for t in tiers:
            self.register(t)

    def register(self, tier: str) -> None:
        with self._lock:
            if tier not in self._tiers:
                self._tiers.append(tier)

    def seed(self, infos: Iterable[CheckpointInfo]) -> None:
        """Take the newest of existing checkpoints (from ``Tier.list``) without counting writes."""
        with self._lock:
            for info in infos:
                self._set_newest(info)

    def _set_newest(self, info: CheckpointInfo) -> None:
        if info.tier not in self._tiers:
            self._tiers.append(info.tier)
        key = (info.tier, info.job)
        cur = self._newest.get(key)
        if cur is None or info.step >= cur.step:
            self._newest[key] = info

    def observe_commit(self, info: CheckpointInfo) -> None:
        with self._lock:
            self._set_newest(info)
            self._writes[info.tier] += 1
            self._last_write[(info.tier, info.job)] = self._clock()

    def observe_removed(self, tier: str, job: str, steps: Iterable[int]) -> None:
        """Forget a newest checkpoint that was deleted (the next list/seed refills it)."""
        gone = set(steps)
        with self._lock:
            cur = self._newest.get((tier, job))
            if cur is not None and cur.step in gone:
                del self._newest[(tier, job)]

    def observe_failure(self, tier: str, error: str) -> None:
        with self._lock:
            if tier not in self._tiers:
                self._tiers.append(tier)
            self._failures[tier] += 1
            self._last_error[tier] = error

    def observe_corrupt(self, tier: str) -> None:
        with self._lock:
            if tier not in self._tiers:
                self._tiers.append(tier)
            self._corrupt[tier] += 1

    def snapshot(self) -> list[dict[str, Any]]:
        """JSON-able rows, one per tier (and job once it has a checkpoint there)."""
        now = self._clock()
        rows: list[dict[str, Any]] = []
        with self._lock:
            for tier in self._tiers:
                base = {
                    "tier": tier,
                    "writes": self._writes[tier],
                    "write_failures": self._failures[tier],
                    "corrupt": self._corrupt[tier],
                    "last_error": self._last_error.get(tier),
                }
                jobs = sorted(j for (t, j) in self._newest if t == tier)
                if not jobs:
                    rows.append(base | {"job": None, "newest_step": None, "age_seconds": None,
                                        "size_bytes": None, "last_write": None})
                for job in jobs:
                    info = self._newest[(tier, job)]
                    rows.append(base | {
                        "job": job,
                        "newest_step": info.step,
                        "age_seconds": max(0.0, now - info.created),
                        "size_bytes": info.size,
                        "last_write": self._last_write.get((tier, job)),
                        "location": info.location,
                    })
        return rows

    def metrics(self) -> Iterable[Metric]:
        now = self._clock()
        step = GaugeMetricFamily(METRICS[0][0], METRICS[0][4], labels=["tier", "job"])
        age = GaugeMetricFamily(METRICS[1][0], METRICS[1][4], labels=["tier", "job"], unit="seconds")
        size = GaugeMetricFamily(METRICS[2][0], METRICS[2][4], labels=["tier", "job"], unit="bytes")
        writes = CounterMetricFamily(METRICS[3][0], METRICS[3][4], labels=["tier"])
        fails = CounterMetricFamily(METRICS[4][0], METRICS[4][4], labels=["tier"])
        corrupt = CounterMetricFamily(METRICS[5][0], METRICS[5][4], labels=["tier"])
        with self._lock:
            for (tier, job), info in sorted(self._newest.items()):
                step.add_metric([tier, job], info.step)
                age.add_metric([tier, job], max(0.0, now - info.created))
                size.add_metric([tier, job], info.size)
            for tier in self._tiers:
                writes.add_metric([tier], self._writes[tier])
                fails.add_metric([tier], self._failures[tier])
                corrupt.add_metric([tier], self._corrupt[tier])
        yield from (step, age, size, writes, fails, corrupt)
