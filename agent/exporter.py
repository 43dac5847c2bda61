"""Prometheus ``/metrics`` for the agent: one custom Collector, fed by snapshots at scrape time.

Nothing here holds labelled gauges: every scrape builds fresh families from the latest snapshot
of each source, so a rank or process that went away simply stops appearing. A source that fails
costs its own metrics for that scrape (and a count in ``trainguard_exporter_errors_total``),
never the scrape.

Rank metrics carry the training job in a ``job`` label, like the other collectors. Prometheus
also sets ``job`` (the scrape job) on every target, so the scrape config must use
``honor_labels: true`` for the agent, or the label arrives as ``exported_job``.
"""

from __future__ import annotations

import logging
import platform
import ssl
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol

from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector as PromCollector
from prometheus_client.registry import CollectorRegistry

from trainguard.agent.collectors.host import HOST_METRICS
from trainguard.agent.health import Watch
from trainguard.agent.metrics_http import MetricsServerLimits, serve
from trainguard.agent.metricspec import MetricSpec, index
from trainguard.agent.ranktable import RankTable, RankView
from trainguard.agent.telemetry import TelemetryServer

log = logging.getLogger(__name__)

_RANK = ("job", "rank")

CORE_METRICS: tuple[MetricSpec, ...] = (
    MetricSpec("trainguard_build_info", "gauge", "", ("version", "python"),
               "Always 1; labels say which agent build is running (more labels may be added)."),
    MetricSpec("trainguard_collector_up", "gauge", "", ("collector",),
               "1 when the collector runs, 0 when it is off or failed (the control API says why)."),
    MetricSpec("trainguard_exporter_errors_total", "counter", "", ("source",),
               "Scrapes in which a metric source raised; its metrics were left out of that scrape."),
)

HEALTH_METRICS: tuple[MetricSpec, ...] = (
    MetricSpec("trainguard_agent_healthy", "gauge", "", (),
               "1 while every supervised agent thread beats; 0 when one died or is stuck (the systemd "
               "watchdog is then no longer fed and systemd restarts the agent)."),
    MetricSpec("trainguard_thread_healthy", "gauge", "", ("thread",),
               "1 while the agent thread beats recently, 0 when it died or is stuck."),
    MetricSpec("trainguard_thread_heartbeat_age_seconds", "gauge", "seconds", ("thread",),
               "Seconds since the agent thread last went round its loop."),
    MetricSpec("trainguard_thread_unhealthy_seconds", "gauge", "seconds", ("thread",),
               "Seconds the agent thread has been dead or stuck (0 while healthy)."),
    MetricSpec("trainguard_thread_errors_total", "counter", "", ("thread",),
               "Iterations of the agent thread's loop that raised; the thread reported them and went on."),
    MetricSpec("trainguard_metrics_connections_total", "counter", "", ("outcome",),
               "Connections to /metrics by outcome: served, rejected_busy (over metrics.max_connections), "
               "timed_out (closed at metrics.timeout_s), error."),
)

TELEMETRY_METRICS: tuple[MetricSpec, ...] = (
    MetricSpec("trainguard_telemetry_received_total", "counter", "", (),
               "Telemetry messages read from the agent's socket (a datagram may hold several)."),
    MetricSpec("trainguard_telemetry_messages_total", "counter", "", (),
               "Telemetry messages validated and stored."),
    MetricSpec("trainguard_telemetry_dropped_total", "counter", "", ("reason",),
               "Telemetry datagrams dropped by the agent, by reason (size, json, schema, version, type, "
               "range, forged, unknown_job, foreign_limit, rank_range (a rank at or past its job's nproc), "
               "table_full, table_bytes (telemetry.max_bytes spent), internal). Drops at a full socket "
               "queue are counted by the sender, not here."),
    MetricSpec("trainguard_telemetry_table_bytes", "gauge", "bytes", (),
               "Estimated memory the telemetry table holds; telemetry.max_bytes bounds it."),
    MetricSpec("trainguard_telemetry_foreign_evicted_total", "counter", "", (),
               "Jobs the agent did not launch evicted after telemetry.foreign_idle_s without a message."),
    MetricSpec("trainguard_telemetry_queue_limit", "gauge", "", (),
               "net.unix.max_dgram_qlen when the telemetry socket was created: datagrams that can wait "
               "before senders start dropping."),
    MetricSpec("trainguard_telemetry_ranks", "gauge", "", (),
               "(job, rank) pairs the agent holds telemetry for."),
    MetricSpec("trainguard_rank_info", "gauge", "", ("job", "rank", "local_rank", "pid"),
               "Always 1; the local rank and process id a rank last reported."),
    MetricSpec("trainguard_rank_step", "gauge", "", _RANK, "Latest training step a rank reported."),
    MetricSpec("trainguard_rank_step_seconds", "gauge", "seconds", _RANK,
               "Wall time of the rank's latest step."),
    MetricSpec("trainguard_rank_step_median_seconds", "gauge", "seconds", _RANK,
               "Median step wall time over the recent window."),
    MetricSpec("trainguard_rank_compute_seconds", "gauge", "seconds", _RANK,
               "Median compute time (forward+backward+optimizer) per step over the recent window; what "
               "straggler detection compares across ranks."),
    MetricSpec("trainguard_rank_comm_seconds", "gauge", "seconds", _RANK,
               "Median time per step waiting on collectives over the recent window."),
    MetricSpec("trainguard_rank_data_seconds", "gauge", "seconds", _RANK,
               "Median time per step loading data over the recent window."),
    MetricSpec("trainguard_rank_loss", "gauge", "", _RANK, "Training loss at the latest step (NaN kept)."),
    MetricSpec("trainguard_rank_grad_norm", "gauge", "", _RANK, "Gradient norm at the latest step."),
    MetricSpec("trainguard_rank_lr", "gauge", "", _RANK, "Learning rate at the latest step."),
    MetricSpec("trainguard_rank_batch_size", "gauge", "", _RANK, "Samples per step this rank processes."),
    MetricSpec("trainguard_rank_samples_total", "counter", "", _RANK,
               "Samples the rank reported since the agent first saw it."),
    MetricSpec("trainguard_rank_tokens_total", "counter", "", _RANK,
               "Tokens the rank reported since the agent first saw it."),
    MetricSpec("trainguard_rank_steps_per_second", "gauge", "", _RANK,
               "Steps per second over the recent window (absent until two steps arrived)."),
    MetricSpec("trainguard_rank_samples_per_second", "gauge", "", _RANK,
               "Samples per second over the recent window (absent until two steps arrived)."),
    MetricSpec("trainguard_rank_memory_bytes", "gauge", "bytes", _RANK,
               "Accelerator (or process) memory the rank reported."),
    MetricSpec("trainguard_rank_plan_version", "gauge", "", _RANK, "Plan version the rank runs."),
    MetricSpec("trainguard_rank_last_seen_timestamp_seconds", "gauge", "seconds", _RANK,
               "Unix time the agent last received telemetry from the rank."),
)

METRICS: tuple[MetricSpec, ...] = CORE_METRICS + HEALTH_METRICS + TELEMETRY_METRICS + HOST_METRICS
"""Every metric the agent's exporter and built-in sources produce (the reference is generated from it)."""

_SPEC = index(METRICS)

# metric name -> RankView attribute, for the plain per-rank gauges and counters.
_RANK_GAUGES: tuple[tuple[str, str], ...] = (
    ("trainguard_rank_step", "step"),
    ("trainguard_rank_step_seconds", "step_s"),
    ("trainguard_rank_step_median_seconds", "median_step_s"),
    ("trainguard_rank_compute_seconds", "median_compute_s"),
    ("trainguard_rank_comm_seconds", "median_comm_s"),
    ("trainguard_rank_data_seconds", "median_data_s"),
    ("trainguard_rank_loss", "loss"),
    ("trainguard_rank_grad_norm", "grad_norm"),
    ("trainguard_rank_lr", "lr"),
    ("trainguard_rank_batch_size", "batch_size"),
    ("trainguard_rank_steps_per_second", "steps_per_s"),
    ("trainguard_rank_samples_per_second", "samples_per_s"),
    ("trainguard_rank_memory_bytes", "mem_bytes"),
    ("trainguard_rank_plan_version", "plan_version"),
    ("trainguard_rank_last_seen_timestamp_seconds", "last_seen"),
)
_RANK_COUNTERS: tuple[tuple[str, str], ...] = (
    ("trainguard_rank_samples_total", "samples_total"),
    ("trainguard_rank_tokens_total", "tokens_total"),
)


class MetricSource(Protocol):
    """What the exporter reads: agent.collectors.base.Collector satisfies it."""

    def metrics(self) -> Iterable[Metric]: ...


class TelemetryMetrics:
    """Telemetry as a metric source: per-rank figures from the table, counters from the server."""

    name = "telemetry"

    def __init__(self, table: RankTable, server: TelemetryServer | None = None) -> None:
        self.table = table
        self.server = server

    def metrics(self) -> Iterator[Metric]:
        if self.server is not None:
            stats = self.server.stats()
            fam = _SPEC["trainguard_telemetry_received_total"].counter()
            fam.add_metric([], stats.received_total)
            yield fam
            fam = _SPEC["trainguard_telemetry_messages_total"].counter()
            fam.add_metric([], stats.messages_total)
            yield fam
            fam = _SPEC["trainguard_telemetry_dropped_total"].counter()
            for reason, n in sorted(stats.dropped_total.items()):
                fam.add_metric([reason], n)
            yield fam
            if stats.queue_limit is not None:
                gauge = _SPEC["trainguard_telemetry_queue_limit"].gauge()
                gauge.add_metric([], stats.queue_limit)
                yield gauge
        snap = self.table.snapshot()
        views: list[RankView] = list(snap.ranks())
        used = _SPEC["trainguard_telemetry_table_bytes"].gauge()
        used.add_metric([], self.table.bytes_used)
        yield used
        evicted = _SPEC["trainguard_telemetry_foreign_evicted_total"].counter()
        evicted.add_metric([], self.table.evicted_foreign_total)
        yield evicted
        gauge = _SPEC["trainguard_telemetry_ranks"].gauge()
        gauge.add_metric([], len(views))
        yield gauge
        info = _SPEC["trainguard_rank_info"].gauge()
        for v in views:
            info.add_metric([v.job, str(v.rank), str(v.local_rank), str(v.pid)], 1)
        yield info
        for name, attr in _RANK_GAUGES:
            gauge = _SPEC[name].gauge()
            for v in views:
                value = getattr(v, attr)
                if value is not None:
                    gauge.add_metric([v.job, str(v.rank)], value)
            yield gauge
        for name, attr in _RANK_COUNTERS:
            counter = _SPEC[name].counter()
            for v in views:
                counter.add_metric([v.job, str(v.rank)], getattr(v, attr))
            yield counter


class HealthMetrics:
    """The agent's thread health and the /metrics server's own connection counts as a source."""

    name = "health"

    def __init__(self, watch: Watch, server: Callable[[], Any] | None = None) -> None:
        self.watch = watch
        self.server = server
        """Returns the running metrics server (or None), read at scrape time."""

    def metrics(self) -> Iterator[Metric]:
        threads = self.watch.check()
        fam = _SPEC["trainguard_agent_healthy"].gauge()
        fam.add_metric([], 1 if all(t.healthy for t in threads) else 0)
        yield fam
        for name, attr in (("trainguard_thread_healthy", "healthy"), ("trainguard_thread_heartbeat_age_seconds", "age_s"),
                           ("trainguard_thread_unhealthy_seconds", "since_s")):
            fam = _SPEC[name].gauge()
            for t in threads:
                fam.add_metric([t.name], float(getattr(t, attr)))
            yield fam
        counter = _SPEC["trainguard_thread_errors_total"].counter()
        for t in threads:
            counter.add_metric([t.name], t.errors)
        yield counter
        server = self.server() if self.server is not None else None
        if server is not None:
            st = server.stats
            counter = _SPEC["trainguard_metrics_connections_total"].counter()
            for outcome, n in (("served", st.served), ("rejected_busy", st.rejected_busy),
                               ("timed_out", st.timed_out), ("error", st.errors)):
                counter.add_metric([outcome], n)
            yield counter


def _source_name(source: object) -> str:
    name = getattr(source, "name", None)
    return name if isinstance(name, str) and name else type(source).__name__


class AgentExporter(PromCollector):
    """The agent's one registered Collector.

    ``sources``: objects with ``metrics() -> Iterable[Metric]`` (collectors, TelemetryMetrics),
    read in order at each scrape. ``collector_status``: name -> (up, reason when down).
    """

    def __init__(
        self,
        sources: Sequence[MetricSource],
        build_info: dict[str, str],
        collector_status: Callable[[], dict[str, tuple[bool, str | None]]],
    ) -> None:
        self.sources = list(sources)
        self.build_info = {"python": platform.python_version(), **build_info}
        self.build_info.setdefault("version", "unknown")
        self.collector_status = collector_status
        self._errors: dict[str, int] = {}
        self._lock = threading.Lock()  # scrapes may run concurrently (threaded HTTP server)
        self._registry: CollectorRegistry | None = None

    @property
    def registry(self) -> CollectorRegistry:
        """A registry holding only this exporter (created on first use)."""
        if self._registry is None:
            self._registry = make_registry(self)
        return self._registry

    def _failed(self, source: str) -> None:
        with self._lock:
            first = source not in self._errors
            self._errors[source] = self._errors.get(source, 0) + 1
        if first:
            log.exception("metric source %s failed; its metrics are left out (logged once)", source)

    def collect(self) -> Iterator[Metric]:
        names = sorted(self.build_info)
        spec = _SPEC["trainguard_build_info"]
        # build_info's labels are whatever the daemon passes in, so the family is built per scrape.
        info = MetricSpec(spec.name, spec.type, spec.unit, tuple(names), spec.help).gauge()
        info.add_metric([self.build_info[k] for k in names], 1)
        yield info
        try:
            status = dict(self.collector_status())
        except Exception:
            self._failed("collector_status")
            status = None
        if status is not None:
            up = _SPEC["trainguard_collector_up"].gauge()
            for name, (is_up, _reason) in sorted(status.items()):
                up.add_metric([name], 1 if is_up else 0)
            yield up
        for source in self.sources:
            name = _source_name(source)
            try:
                # Materialise first: a source that fails half-way contributes nothing, not half.
                families = list(source.metrics())
            except Exception:
                self._failed(name)
                continue
            yield from families
        errors = _SPEC["trainguard_exporter_errors_total"].counter()
        with self._lock:
            counts = sorted(self._errors.items())
        for name, n in counts:
            errors.add_metric([name], n)
        yield errors

    def describe(self) -> list[Metric]:
        # Nothing to describe up front: names depend on the sources. Also keeps register() from
        # running a full collect.
        return []


def make_registry(exporter: AgentExporter) -> CollectorRegistry:
    """A registry holding only the agent's exporter (no process/platform defaults)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(exporter)
    return registry


def serve_metrics(registry: CollectorRegistry, host: str = "127.0.0.1", port: int = 0, *,
                  limits: MetricsServerLimits | None = None, tls: ssl.SSLContext | None = None) -> tuple[Any, int]:
    """Serve ``registry`` over HTTP(S) (``/metrics``, any path works) on a daemon thread, with a
    connection cap and a whole-connection deadline (agent.metrics_http).

    ``port`` 0 picks a free port. Returns (server, bound port); stop with ``stop_metrics(server)``.
    """
    server = serve(registry, host, port, limits=limits, tls=tls)
    return server, int(server.server_port)


def stop_metrics(server: Any) -> None:
    server.shutdown()
    server.server_close()
