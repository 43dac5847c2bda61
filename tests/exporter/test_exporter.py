"""/metrics: the custom Collector scraped over real HTTP on 127.0.0.1."""

from __future__ import annotations

import math
import os
import shutil
import socket
import tempfile
import time
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client import generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers.telemetry import make_msg
from tests.helpers.waiting import wait_for
from trainguard.agent.collectors.base import TrackedProcess
from trainguard.agent.collectors.host import HostCollector
from trainguard.agent.exporter import (
    METRICS,
    AgentExporter,
    TelemetryMetrics,
    make_registry,
    serve_metrics,
    stop_metrics,
)
from trainguard.agent.metricspec import MetricSpec
from trainguard.agent.ranktable import RankTable, RankTableConfig
from trainguard.agent.telemetry import TelemetryServer


class Raising:
    name = "gpu"

    def metrics(self) -> Iterator[Metric]:
        fam = GaugeMetricFamily("trainguard_gpu_half_done", "never exported: the source failed")
        fam.add_metric([], 1)
        yield fam
        raise RuntimeError("NVML went away")


class Fixed:
    name = "fixed"

    def metrics(self) -> list[Metric]:
        fam = GaugeMetricFamily("trainguard_fixed_value", "a value", labels=["k"])
        fam.add_metric(["a"], 42.5)
        return [fam]


def scrape(port: int) -> dict[str, Metric]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        assert resp.status == 200
        text = resp.read().decode()
    return {fam.name: fam for fam in text_string_to_metric_families(text)}


def sample(families: dict[str, Metric], name: str, **labels: str) -> float:
    for fam in families.values():
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    raise KeyError(f"{name}{labels}")


@pytest.fixture
def table() -> RankTable:
    t = RankTable(RankTableConfig(window=4), clock=lambda: 1700000000.0)
    for step in range(6):
        t.add(make_msg(rank=0, step=step, wall_time=100 + step, step_s=1.0, fwd_bwd_s=0.5 + step * 0.1,
                       opt_s=0.1, comm_s=0.2, data_s=0.05, samples=16, tokens=160, loss=3.0 - step * 0.1))
    t.add(make_msg(rank=1, step=5, loss=math.nan, mem_bytes=123456))
    return t


def test_scrape_over_http_with_raising_source(table: RankTable) -> None:
    status = {"host": (True, None), "ebpf": (False, "no root")}
    exporter = AgentExporter([TelemetryMetrics(table), Raising(), Fixed()], {"version": "1.2.3", "node": "n1"},
                             lambda: status)
    registry = make_registry(exporter)
    server, port = serve_metrics(registry, "127.0.0.1", 0)
    try:
        assert port > 0
        fams = scrape(port)
        assert sample(fams, "trainguard_build_info", version="1.2.3", node="n1") == 1
        assert "python" in fams["trainguard_build_info"].samples[0].labels
        assert sample(fams, "trainguard_collector_up", collector="host") == 1
        assert sample(fams, "trainguard_collector_up", collector="ebpf") == 0
        # The failing source left nothing behind and was counted; the others are all there.
        assert "trainguard_gpu_half_done" not in fams
        assert sample(fams, "trainguard_exporter_errors_total", source="gpu") == 1
        assert sample(fams, "trainguard_fixed_value", k="a") == 42.5
        assert sample(fams, "trainguard_rank_step", job="job-1", rank="0") == 5
        assert sample(fams, "trainguard_rank_compute_seconds", job="job-1", rank="0") == pytest.approx(0.95)
        assert sample(fams, "trainguard_rank_samples_total", job="job-1", rank="0") == 96
        assert sample(fams, "trainguard_rank_steps_per_second", job="job-1", rank="0") == pytest.approx(1.0)
        assert sample(fams, "trainguard_rank_last_seen_timestamp_seconds", job="job-1", rank="1") == 1700000000.0
        assert math.isnan(sample(fams, "trainguard_rank_loss", job="job-1", rank="1"))
        assert sample(fams, "trainguard_rank_memory_bytes", job="job-1", rank="1") == 123456
        assert sample(fams, "trainguard_rank_info", job="job-1", rank="1", local_rank="1", pid="1001") == 1
        with pytest.raises(KeyError):  # one step only: no rate yet, so no series
            sample(fams, "trainguard_rank_steps_per_second", job="job-1", rank="1")

        # Values follow the table at the next scrape; the error counter keeps counting.
        table.add(make_msg(rank=0, step=9))
        fams = scrape(port)
        assert sample(fams, "trainguard_rank_step", job="job-1", rank="0") == 9
        assert sample(fams, "trainguard_exporter_errors_total", source="gpu") == 2
        assert registry.get_sample_value("trainguard_rank_step", {"job": "job-1", "rank": "0"}) == 9
        # A job forgotten by the table disappears from the next scrape: no stale series.
        table.forget_job("job-1")
        with pytest.raises(KeyError):
            sample(scrape(port), "trainguard_rank_step", job="job-1")
    finally:
        stop_metrics(server)
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
        pass


def test_collector_status_failure_does_not_fail_scrape(table: RankTable) -> None:
    def broken() -> dict[str, tuple[bool, str | None]]:
        raise KeyError("state being rebuilt")

    exporter = AgentExporter([TelemetryMetrics(table)], {"version": "x"}, broken)
    registry = exporter.registry
    text = generate_latest(registry).decode()  # a whole scrape: must not raise
    assert 'trainguard_rank_step{job="job-1",rank="0"} 5.0' in text
    assert registry.get_sample_value("trainguard_build_info", {"version": "x", "python": exporter.build_info["python"]}) == 1
    assert registry.get_sample_value("trainguard_exporter_errors_total", {"source": "collector_status"}) == 2
    assert registry.get_sample_value("trainguard_collector_up", {"collector": "host"}) is None


def test_end_to_end_socket_to_scrape() -> None:
    d = tempfile.mkdtemp(prefix="tg-exp-")
    path = os.path.join(d, "t.sock")
    table = RankTable()
    telemetry = TelemetryServer(path, table)
    telemetry.start()
    exporter = AgentExporter([telemetry], {"version": "t"}, lambda: {"telemetry": (True, None)})
    server, port = serve_metrics(exporter.registry, "127.0.0.1", 0)
    try:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        for step in range(3):
            s.sendto(make_msg(job="e2e", rank=3, step=step).encode(), path)
        s.sendto(b'{"v": 1}', path)
        s.sendto(b"\xff" * 5000, path)
        s.close()
        wait_for(lambda: telemetry.received_total == 5)
        fams = scrape(port)
        assert sample(fams, "trainguard_telemetry_messages_total") == 3
        assert sample(fams, "trainguard_telemetry_received_total") == 5
        assert sample(fams, "trainguard_telemetry_dropped_total", reason="schema") == 1
        assert sample(fams, "trainguard_telemetry_dropped_total", reason="size") == 1
        assert sample(fams, "trainguard_rank_step", job="e2e", rank="3") == 2
        assert sample(fams, "trainguard_telemetry_ranks") == 1
    finally:
        stop_metrics(server)
        telemetry.stop()
        shutil.rmtree(d, ignore_errors=True)


def test_every_exported_family_is_declared(table: RankTable) -> None:
    """What a full scrape produces matches METRICS (name, type, labels): the reference can't drift."""
    host = HostCollector()
    host.track({os.getpid(): TrackedProcess(os.getpid(), "job-1", 0, 0)})
    host.poll(time.time())
    d = tempfile.mkdtemp(prefix="tg-exp-")
    telemetry = TelemetryServer(os.path.join(d, "t.sock"), table)
    telemetry.start()
    try:
        telemetry.dropped_total["json"] = 1
        exporter = AgentExporter([telemetry, host], {"version": "v"}, lambda: {"host": (True, None)})
        exporter._errors["whatever"] = 1
        declared = {m.name: m for m in METRICS}
        seen = set()
        for fam in exporter.collect():
            name = fam.name + ("_total" if fam.type == "counter" else "")
            assert name in declared, name
            spec = declared[name]
            assert spec.type == fam.type, name
            for s in fam.samples:
                extra = set(s.labels) - set(spec.labels)
                assert not extra or name == "trainguard_build_info", (name, extra)
                if name != "trainguard_build_info":
                    assert set(s.labels) == set(spec.labels), (name, s.labels)
            seen.add(name)
        assert {"trainguard_host_cpu_seconds_total", "trainguard_process_resident_memory_bytes",
                "trainguard_rank_step", "trainguard_telemetry_dropped_total"} <= seen
    finally:
        telemetry.stop()
        shutil.rmtree(d, ignore_errors=True)


def test_metric_specs_follow_conventions() -> None:
    assert len({m.name for m in METRICS}) == len(METRICS)
    for bad in [("x_seconds", "gauge", "seconds"), ("trainguard_a", "counter", ""),
                ("trainguard_a_total", "gauge", ""), ("trainguard_a_ms", "gauge", "seconds")]:
        with pytest.raises(ValueError):
            MetricSpec(bad[0], bad[1], bad[2], (), "h")  # type: ignore[arg-type]
