"""GpuCollector against the fake NVML: readings, exported metrics, throttling, attribution, lost GPUs."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest

from tests.helpers.fakenvml import NVML_FI_DEV_PCIE_COUNT_TX_BYTES, FakeGpu, FakeNvml
from trainguard.agent.collectors.base import TrackedProcess
from trainguard.agent.collectors.gpu import METRICS, GpuCollector, GpuCollectorConfig, Nvml

REPO = Path(__file__).resolve().parents[2]


class Events:
    def __init__(self) -> None:
        self.items: list[tuple[str, dict[str, Any]]] = []

    def __call__(self, kind: str, fields: dict[str, Any]) -> None:
        self.items.append((kind, fields))

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [f for k, f in self.items if k == kind]


def _registry(col: GpuCollector) -> CollectorRegistry:
    reg = CollectorRegistry()

    class _Adapter:
        def collect(self) -> Any:
            return col.metrics()

    reg.register(_Adapter())  # type: ignore[arg-type]
    return reg


def _started(gpus: list[FakeGpu], **cfg: Any) -> tuple[GpuCollector, FakeNvml, Events]:
    fake = FakeNvml(gpus)
    events = Events()
    col = GpuCollector(events, Nvml(module=fake), GpuCollectorConfig(xid_events=False, **cfg))
    col.start()
    return col, fake, events


def test_readings_and_metrics_match_the_gpu() -> None:
    g0 = FakeGpu(index=0, util_gpu=87, mem_used=3 * 1024**3, temperature=61, power_mw=412_500, sm_clock=1755)
    g1 = FakeGpu(index=1, util_gpu=5, nvlinks=())
    col, _, _ = _started([g0, g1])
    col.poll(100.0)
    r = col.readings()[0]
    assert (r.uuid, r.utilization_gpu_pct, r.memory_used_bytes, r.temperature_c) == (
        "GPU-fake-0000",
        87,
        3 * 1024**3,
        61,
    )
    assert r.power_w == pytest.approx(412.5) and r.power_limit_w == pytest.approx(700.0)
    reg = _registry(col)

    def v(name: str, gpu: str = "0", **labels: str) -> float | None:
        base = {"gpu": gpu, "uuid": f"GPU-fake-{int(gpu):04d}"}
        if not name.endswith("_total") and name != "trainguard_gpu_up":
            base |= {"job": "", "rank": ""}
        return reg.get_sample_value(name, base | labels)

    assert v("trainguard_gpu_utilization_ratio") == pytest.approx(0.87)
    assert v("trainguard_gpu_utilization_ratio", "1") == pytest.approx(0.05)
    assert v("trainguard_gpu_memory_used_bytes") == 3 * 1024**3
    assert v("trainguard_gpu_memory_total_bytes") == 141 * 1024**3
    assert v("trainguard_gpu_temperature_celsius") == 61
    assert v("trainguard_gpu_power_watts") == pytest.approx(412.5)
    assert v("trainguard_gpu_sm_clock_hertz") == pytest.approx(1755e6)
    assert v("trainguard_gpu_sm_clock_max_hertz") == pytest.approx(1980e6)
    assert v("trainguard_gpu_up") == 1
    assert v("trainguard_gpu_ecc_errors_total", type="uncorrected") == 0
    assert v("trainguard_gpu_remapped_rows", kind="pending") == 0
    assert v("trainguard_gpu_throttle_reasons", reason="hw_thermal_slowdown") == 0
    # every sample carries exactly the labels METRICS declares for its family
    declared_labels = {m[0].removesuffix("_total"): set(m[3]) for m in METRICS}
    for fam in col.metrics():
        for sample in fam.samples:
            assert set(sample.labels) == declared_labels[fam.name], (fam.name, sample.labels)
    # every exported family is declared in METRICS, and nothing is NaN
    text = generate_latest(reg).decode()
    declared = {m[0] for m in METRICS}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name = re.match(r"[a-z_]+", line)
            assert name and (
                name.group(0) in declared
                or name.group(0).removesuffix("_created") in {d.removesuffix("_total") for d in declared}
            ), line
            assert "NaN" not in line, line
    col.stop()


def test_counter_rates_for_pcie_and_nvlink() -> None:
    g = FakeGpu(index=0, nvlinks=(0, 2))
    col, _, _ = _started([g])
    col.poll(10.0)
    assert math.isnan(col.readings()[0].pcie_tx_bytes_per_s)  # first read: no rate yet
    g.pcie_tx_bytes += 4_000_000
    g.pcie_rx_bytes += 1_000_000
    g.nvlink_tx_kib = {0: 1000, 2: 3000}  # 4000 KiB over 2 s
    g.nvlink_rx_kib = {0: 500, 2: 500}
    col.poll(12.0)
    r = col.readings()[0]
    assert r.pcie_tx_bytes_per_s == pytest.approx(2_000_000)
    assert r.pcie_rx_bytes_per_s == pytest.approx(500_000)
    assert r.nvlink_tx_bytes_per_s == pytest.approx(4000 * 1024 / 2)
    assert r.nvlink_rx_bytes_per_s == pytest.approx(1000 * 1024 / 2)
    reg = _registry(col)
    labels = {"gpu": "0", "uuid": g.uuid, "job": "", "rank": ""}
    assert reg.get_sample_value(
        "trainguard_gpu_nvlink_bytes_per_second", labels | {"direction": "tx"}
    ) == pytest.approx(2048000)


def test_pcie_falls_back_to_sampled_throughput_without_counters() -> None:
    g = FakeGpu(
        index=0, unsupported_fields={NVML_FI_DEV_PCIE_COUNT_TX_BYTES, NVML_FI_DEV_PCIE_COUNT_TX_BYTES + 1}
    )
    col, _, _ = _started([g])
    col.poll(1.0)
    assert col.readings()[0].pcie_tx_bytes_per_s == 1000 * 1024
    assert col.readings()[0].pcie_rx_bytes_per_s == 2000 * 1024


def test_unsupported_fields_are_left_out_not_nan() -> None:
    g = FakeGpu(
        index=0,
        nvlinks=(),
        unsupported={
            "nvmlDeviceGetPowerUsage",
            "nvmlDeviceGetTotalEccErrors",
            "nvmlDeviceGetRemappedRows",
            "nvmlDeviceGetCurrentClocksEventReasons",
            "nvmlDeviceGetCurrentClocksThrottleReasons",
            "nvmlDeviceGetPcieThroughput",
        },
        unsupported_fields={197, 198},
    )
    col, _, _ = _started([g])
    col.poll(1.0)
    col.poll(2.0)
    text = generate_latest(_registry(col)).decode()
    for gone in (
        "power_watts{",
        "ecc_errors_total{",
        "remapped_rows{",
        "throttle_reasons{",
        "pcie_bytes_per_second{",
        "nvlink_bytes_per_second{",
    ):
        assert f"trainguard_gpu_{gone}" not in text, gone
    assert "trainguard_gpu_temperature_celsius{" in text
    assert "NaN" not in text
    assert col.gpu_stats_for_pid(1) is None


def test_ecc_counts_exported_as_counters() -> None:
    g = FakeGpu(index=0)
    col, _, _ = _started([g])
    g.ecc_errors(corrected=7, uncorrected=2)
    g.remapped = (3, 1, 1, 0)
    col.poll(1.0)
    reg = _registry(col)
    c = {"gpu": "0", "uuid": g.uuid}
    assert reg.get_sample_value("trainguard_gpu_ecc_errors_total", c | {"type": "corrected"}) == 7
    assert reg.get_sample_value("trainguard_gpu_ecc_errors_total", c | {"type": "uncorrected"}) == 2
    gl = c | {"job": "", "rank": ""}
    assert reg.get_sample_value("trainguard_gpu_remapped_rows", gl | {"kind": "correctable"}) == 3
    assert reg.get_sample_value("trainguard_gpu_remapped_rows", gl | {"kind": "uncorrectable"}) == 1


def test_throttling_shows_in_metrics_and_gpu_stats_for_pid() -> None:
    g0 = FakeGpu(index=0, processes={4242: 2 * 1024**3})
    g1 = FakeGpu(index=1, processes={4343: 1024**3})
    col, _, _ = _started([g0, g1])
    col.track({4242: TrackedProcess(4242, "jobA", 0, 0), 4343: TrackedProcess(4343, "jobA", 1, 1)})
    col.poll(1.0)
    healthy = col.gpu_stats_for_pid(4343)
    assert healthy is not None and not healthy.throttled and healthy.clock_ratio == pytest.approx(1.0)

    g0.throttle_thermal(temperature=93, clock=990)
    g1.throttle_power(clock=1485)
    col.poll(2.0)
    s0 = col.gpu_stats_for_pid(4242)
    s1 = col.gpu_stats_for_pid(4343)
    assert s0 is not None and s1 is not None
    assert s0.gpu == 0 and s0.throttled and s0.temperature_c == 93
    assert set(s0.slowdown_reasons) == {"hw_thermal_slowdown", "sw_thermal_slowdown"}
    assert s0.clock_ratio == pytest.approx(0.5) and s0.sm_clock_hz == pytest.approx(990e6)
    assert s1.gpu == 1 and s1.slowdown_reasons == ("sw_power_cap",)
    assert s1.power_w == pytest.approx(s1.power_limit_w)

    reg = _registry(col)
    l0 = {"gpu": "0", "uuid": g0.uuid, "job": "jobA", "rank": "0"}
    assert (
        reg.get_sample_value("trainguard_gpu_throttle_reasons", l0 | {"reason": "hw_thermal_slowdown"}) == 1
    )
    assert reg.get_sample_value("trainguard_gpu_throttle_reasons", l0 | {"reason": "sw_power_cap"}) == 0
    l1 = {"gpu": "1", "uuid": g1.uuid, "job": "jobA", "rank": "1"}
    assert reg.get_sample_value("trainguard_gpu_throttle_reasons", l1 | {"reason": "sw_power_cap"}) == 1

    g0.unthrottle()
    col.poll(3.0)
    again = col.gpu_stats_for_pid(4242)
    assert again is not None and not again.throttled


def test_pid_to_rank_attribution() -> None:
    g0 = FakeGpu(index=0, processes={100: 5 * 1024**3, 999: 1024})  # 999: not a rank
    g1 = FakeGpu(index=1, processes={101: None})  # memory hidden by the driver
    g2 = FakeGpu(index=2)
    col, _, _ = _started([g0, g1, g2])
    col.track(
        {
            100: TrackedProcess(100, "j", 3, 0),
            101: TrackedProcess(101, "j", 4, 1),
            102: TrackedProcess(102, "j", 5, 2),
        }
    )
    col.poll(1.0)
    assert (col.gpu_for_pid(100), col.gpu_for_pid(101), col.gpu_for_pid(102), col.gpu_for_pid(999)) == (
        0,
        1,
        None,
        None,
    )
    reg = _registry(col)
    assert (
        reg.get_sample_value(
            "trainguard_gpu_memory_used_bytes", {"gpu": "0", "uuid": g0.uuid, "job": "j", "rank": "3"}
        )
        is not None
    )
    assert (
        reg.get_sample_value(
            "trainguard_gpu_memory_used_bytes", {"gpu": "2", "uuid": g2.uuid, "job": "", "rank": ""}
        )
        is not None
    )
    assert (
        reg.get_sample_value(
            "trainguard_gpu_process_memory_used_bytes",
            {"gpu": "0", "uuid": g0.uuid, "job": "j", "rank": "3", "pid": "100"},
        )
        == 5 * 1024**3
    )
    text = generate_latest(reg).decode()
    assert 'pid="101"' not in text  # hidden memory is N/A: left out
    assert 'pid="999"' not in text  # untracked processes are not exported

    # the rank stops: the labels go with it on the next scrape (no stale series)
    col.track({101: TrackedProcess(101, "j", 4, 1)})
    assert col.gpu_for_pid(100) is None
    assert 'rank="3"' not in generate_latest(_registry(col)).decode()


def test_old_driver_process_list_falls_back_to_v2() -> None:
    g = FakeGpu(index=0, processes={100: 1024}, old_driver={"nvmlDeviceGetComputeRunningProcesses"})
    col, fake, _ = _started([g])
    col.track({100: TrackedProcess(100, "j", 0, 0)})
    col.poll(1.0)
    assert col.gpu_for_pid(100) == 0
    assert fake.calls["nvmlDeviceGetComputeRunningProcesses_v2"] == 1


def test_local_rank_fallback_when_nvml_hides_pids() -> None:
    col, _, _ = _started([FakeGpu(index=0), FakeGpu(index=1)], local_rank_fallback=True)
    col.track({555: TrackedProcess(555, "j", 7, 1)})
    col.poll(1.0)
    assert col.gpu_for_pid(555) == 1


def test_gpu_lost_mid_run_reports_once_and_keeps_the_others() -> None:
    g0, g1 = FakeGpu(index=0, processes={77: 1024}), FakeGpu(index=1)
    col, _, events = _started([g0, g1])
    col.track({77: TrackedProcess(77, "jobL", 2, 0)})
    col.poll(1.0)
    g0.lose()
    g1.util_gpu = 99
    col.poll(2.0)
    col.poll(3.0)
    lost = events.of("gpu_lost")
    assert len(lost) == 1
    assert (
        lost[0]["gpu"] == 0
        and lost[0]["uuid"] == g0.uuid
        and lost[0]["ranks"] == [2]
        and lost[0]["pid"] == 77
    )
    assert not {"job", "rank", "kind", "message", "severity", "cause", "source"} & set(lost[0])
    assert set(col.readings()) == {1} and col.lost_gpus() == [0]
    reg = _registry(col)
    assert reg.get_sample_value("trainguard_gpu_up", {"gpu": "0", "uuid": g0.uuid}) == 0
    assert reg.get_sample_value("trainguard_gpu_up", {"gpu": "1", "uuid": g1.uuid}) == 1
    assert reg.get_sample_value(
        "trainguard_gpu_utilization_ratio", {"gpu": "1", "uuid": g1.uuid, "job": "", "rank": ""}
    ) == pytest.approx(0.99)
    assert (
        reg.get_sample_value(
            "trainguard_gpu_temperature_celsius", {"gpu": "0", "uuid": g0.uuid, "job": "jobL", "rank": "2"}
        )
        is None
    )
    col.stop()


def test_gpu_lost_before_start_is_reported_and_all_lost_is_unavailable() -> None:
    from trainguard.agent.collectors.base import CollectorUnavailable

    g0, g1 = FakeGpu(index=0), FakeGpu(index=1)
    g0.lose()
    col, _, events = _started([g0, g1])
    assert [f["gpu"] for f in events.of("gpu_lost")] == [0]
    col.poll(1.0)
    assert set(col.readings()) == {1}
    g1.lose()
    fake = FakeNvml([g0, g1])
    col2 = GpuCollector(Events(), Nvml(module=fake), GpuCollectorConfig(xid_events=False))
    with pytest.raises(CollectorUnavailable, match="all 2 GPU"):
        col2.start()
    assert fake.shutdown_calls == fake.init_calls


def test_stop_shuts_nvml_down_and_is_idempotent() -> None:
    col, fake, _ = _started([FakeGpu()])
    col.stop()
    col.stop()
    assert fake.init_calls == 1 and fake.shutdown_calls == 1


def test_config_validation_names_the_key() -> None:
    with pytest.raises(ValueError, match="gpu.event_wait_ms"):
        GpuCollectorConfig(event_wait_ms=0)
    with pytest.raises(ValueError, match="gpu.local_rank_fallback"):
        GpuCollectorConfig(local_rank_fallback="yes")  # type: ignore[arg-type]


def test_metrics_table_is_well_formed() -> None:
    names = [m[0] for m in METRICS]
    assert len(names) == len(set(names))
    for name, mtype, unit, labels, doc in METRICS:
        assert name.startswith("trainguard_gpu_") and mtype in ("gauge", "counter") and doc
        assert (mtype == "counter") == name.endswith("_total"), name
        assert not unit or name.endswith("_" + unit), name
        assert labels[:2] == ("gpu", "uuid"), name


def test_pynvml_is_imported_in_exactly_one_module() -> None:
    pattern = re.compile(r"^\s*(import pynvml|from pynvml|.*import_module\(\"pynvml\"\))", re.M)
    users = sorted(
        str(p.relative_to(REPO)) for p in (REPO / "agent").rglob("*.py") if pattern.search(p.read_text())
    )
    assert users == ["agent/collectors/gpu/nvml.py"]
