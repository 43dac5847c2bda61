"""The GPU collector: NVML readings per GPU, XID events, attribution of GPUs to training ranks.

``poll`` reads every GPU once (from the agent's loop); ``metrics`` turns the latest snapshot into
fresh Prometheus families at scrape time; XID/ECC events go out through ``emit`` from the event
thread as they arrive. A GPU that is lost mid-run is reported once (``gpu_lost``), exported as
``trainguard_gpu_up 0`` and skipped from then on; the other GPUs keep being read.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from trainguard.agent.collectors.base import CollectorUnavailable, EmitFn, TrackedProcess
from trainguard.agent.collectors.gpu.config import GpuCollectorConfig
from trainguard.agent.collectors.gpu.nvml import GpuLost, Nvml, NvmlUnavailable, is_na
from trainguard.agent.collectors.gpu.reading import (
    THROTTLE_REASONS,
    DeviceState,
    GpuReading,
    open_device,
    read_gpu,
)
from trainguard.agent.collectors.gpu.xid import FATAL_XIDS, GpuEvent, XidWatcher

log = logging.getLogger(__name__)

_G = ("gpu", "uuid", "job", "rank")  # gauges carry the rank using the GPU (empty when none)
_C = ("gpu", "uuid")  # counters do not: a label set that changes when a job starts would split them

# (name as exposed, type, unit, labels, help)
METRICS: tuple[tuple[str, str, str, tuple[str, ...], str], ...] = (
    ("trainguard_gpu_up", "gauge", "", _C, "1 while NVML answers for this GPU, 0 once it is lost."),
    ("trainguard_gpu_utilization_ratio", "gauge", "ratio", _G, "Fraction of time a kernel ran (NVML)."),
    (
        "trainguard_gpu_memory_utilization_ratio",
        "gauge",
        "ratio",
        _G,
        "Fraction of time memory was read or written.",
    ),
    (
        "trainguard_gpu_memory_used_bytes",
        "gauge",
        "bytes",
        _G,
        "GPU memory in use (without driver-reserved).",
    ),
    ("trainguard_gpu_memory_total_bytes", "gauge", "bytes", _G, "GPU memory size."),
    ("trainguard_gpu_temperature_celsius", "gauge", "celsius", _G, "GPU core temperature."),
    ("trainguard_gpu_power_watts", "gauge", "watts", _G, "Board power draw."),
    ("trainguard_gpu_power_limit_watts", "gauge", "watts", _G, "Enforced power limit."),
    ("trainguard_gpu_sm_clock_hertz", "gauge", "hertz", _G, "Current SM clock."),
    ("trainguard_gpu_sm_clock_max_hertz", "gauge", "hertz", _G, "Maximum SM clock."),
    (
        "trainguard_gpu_throttle_reasons",
        "gauge",
        "",
        _G + ("reason",),
        "1 while this clock event reason is active.",
    ),
    (
        "trainguard_gpu_ecc_errors_total",
        "counter",
        "",
        _C + ("type",),
        "Volatile ECC errors since driver load.",
    ),
    (
        "trainguard_gpu_remapped_rows",
        "gauge",
        "",
        _G + ("kind",),
        "Remapped memory rows (correctable, uncorrectable, pending, failure).",
    ),
    (
        "trainguard_gpu_pcie_bytes_per_second",
        "gauge",
        "bytes_per_second",
        _G + ("direction",),
        "PCIe throughput.",
    ),
    (
        "trainguard_gpu_nvlink_bytes_per_second",
        "gauge",
        "bytes_per_second",
        _G + ("direction",),
        "NVLink data throughput, all active links.",
    ),
    ("trainguard_gpu_xid_errors_total", "counter", "", _C + ("xid",), "XID errors seen by this agent."),
    (
        "trainguard_gpu_process_memory_used_bytes",
        "gauge",
        "bytes",
        _G + ("pid",),
        "GPU memory used by a tracked rank process.",
    ),
)


@dataclass(frozen=True)
class GpuPidStats:
    """The state of the GPU a rank runs on, for straggler cause attribution."""

    pid: int
    gpu: int
    uuid: str
    throttle_reasons: tuple[str, ...]
    slowdown_reasons: tuple[str, ...]  # the subset that slows a busy GPU (power/thermal/hw)
    sm_clock_hz: float
    sm_clock_max_hz: float
    clock_ratio: float  # current / max SM clock; NA when either is unknown
    temperature_c: float
    power_w: float
    power_limit_w: float
    utilization_ratio: float

    @property
    def throttled(self) -> bool:
        return bool(self.slowdown_reasons)


@dataclass
class _Snapshot:
    readings: dict[int, GpuReading] = field(default_factory=dict)
    pid_gpu: dict[int, int] = field(default_factory=dict)  # tracked pid -> gpu index


# Keys the agent's event log takes as its own arguments: event fields must not use them.
RESERVED_EVENT_KEYS = frozenset({"kind", "message", "severity", "cause", "job", "rank", "source"})


class GpuCollector:
    """NVML collector (see module doc). ``emit`` may be called from the event thread."""

    name = "gpu"

    def __init__(
        self,
        emit: EmitFn,
        nvml: Nvml | None = None,
        config: GpuCollectorConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._emit = emit
        self._nvml = nvml if nvml is not None else Nvml()
        self.config = config if config is not None else GpuCollectorConfig()
        self._clock = clock
        self._lock = threading.Lock()
        self._devices: dict[int, DeviceState] = {}
        self._snapshot = _Snapshot()
        self._tracked: dict[int, TrackedProcess] = {}
        self._xid_counts: Counter[tuple[int, int]] = Counter()
        self._watcher: XidWatcher | None = None
        self._failed_logged: set[int] = set()
        self.down_reason: str | None = None
        self.driver_version = ""

    # -- Collector protocol -----------------------------------------------------------------
    def start(self) -> None:
        try:
            self._nvml.init()
            count = self._nvml.device_count()
            self.driver_version = self._nvml.driver_version()
        except NvmlUnavailable as exc:
            self.down_reason = str(exc)
            raise CollectorUnavailable(self.down_reason) from None
        except Exception as exc:  # any other NVML refusal: still one line, never a traceback
            self.down_reason = f"ERROR NVML unavailable: {exc}. HINT check the driver with `nvidia-smi`"
            self._nvml.shutdown()
            raise CollectorUnavailable(self.down_reason) from None
        if count == 0:
            self.down_reason = "ERROR NVML unavailable: no GPU found. HINT check `nvidia-smi` and CUDA_VISIBLE_DEVICES/container GPU access"
            self._nvml.shutdown()
            raise CollectorUnavailable(self.down_reason)
        for index in range(count):
            try:
                self._devices[index] = open_device(self._nvml, index)
            except GpuLost as exc:
                self._devices[index] = DeviceState(index, None, f"GPU-index-{index}", "N/A", lost=True)
                self._emit("gpu_lost", {"gpu": index, "uuid": "", "detail": exc.detail})
        if all(d.lost for d in self._devices.values()):
            self.down_reason = f"ERROR NVML unavailable: all {count} GPU(s) lost. HINT check `nvidia-smi` and the kernel log for XID 79"
            self._nvml.shutdown()
            raise CollectorUnavailable(self.down_reason)
        if self.config.xid_events:
            handles = {i: d.handle for i, d in self._devices.items() if not d.lost}
            watcher = XidWatcher(
                self._nvml, handles, self._on_event, self._on_event_lost, self.config.event_wait_ms
            )
            if watcher.start():
                self._watcher = watcher
        log.info(
            "GPU collector: %d GPU(s), driver %s, XID events %s",
            count,
            self.driver_version,
            "on" if self._watcher else "off",
        )

    def poll(self, now: float) -> None:
        readings: dict[int, GpuReading] = {}
        lost_now: list[DeviceState] = []
        for index, dev in self._devices.items():
            if dev.lost:
                continue
            try:
                readings[index] = read_gpu(self._nvml, dev, now, self.config.pcie_sampling_fallback)
            except GpuLost as exc:
                dev.lost = True
                lost_now.append(dev)
                log.error("GPU %d (%s) lost: %s", index, dev.uuid, exc.detail)
            except Exception as exc:  # one bad GPU must not blank the others
                if index not in self._failed_logged:
                    self._failed_logged.add(index)
                    log.exception("GPU %d: read failed: %s", index, exc)
        with self._lock:
            previous = self._snapshot
            self._snapshot = _Snapshot(readings, self._attribute(readings))
        for dev in lost_now:
            self._emit(
                "gpu_lost",
                self._event_fields(dev.index, previous, {"detail": f"{dev.uuid} stopped answering"}),
            )

    def track(self, processes: Mapping[int, TrackedProcess]) -> None:
        with self._lock:
            self._tracked = dict(processes)
            self._snapshot = _Snapshot(self._snapshot.readings, self._attribute(self._snapshot.readings))

    def metrics(self) -> Iterable[Metric]:
        with self._lock:
            snap = self._snapshot
            tracked = dict(self._tracked)
            xids = dict(self._xid_counts)
        fams: dict[str, Any] = {}
        for name, mtype, unit, labels, doc in METRICS:
            cls = CounterMetricFamily if mtype == "counter" else GaugeMetricFamily
            base = name[: -len("_total")] if mtype == "counter" else name
            fams[name] = cls(base, doc, labels=list(labels), unit=unit)

        def put(name: str, labels: list[str], value: float) -> None:
            if not is_na(value):  # N/A: leave the sample out rather than export NaN
                fams[name].add_metric(labels, value)

        ranks_by_gpu: dict[int, list[TrackedProcess]] = {}
        for pid, gpu in sorted(snap.pid_gpu.items()):
            if pid in tracked:
                ranks_by_gpu.setdefault(gpu, []).append(tracked[pid])
        for dev in self._devices.values():
            fams["trainguard_gpu_up"].add_metric([str(dev.index), dev.uuid], 0.0 if dev.lost else 1.0)
        for idx, r in sorted(snap.readings.items()):
            ranks = ranks_by_gpu.get(idx, [])
            # several ranks on one GPU (rare, e.g. tests) are joined: "0,1"
            job = ",".join(sorted({p.job for p in ranks}))
            rank = ",".join(str(p.rank) for p in sorted(ranks, key=lambda p: p.rank))
            g = [str(idx), r.uuid, job, rank]
            c = [str(idx), r.uuid]
            put("trainguard_gpu_utilization_ratio", g, r.utilization_gpu_pct / 100.0)
            put("trainguard_gpu_memory_utilization_ratio", g, r.utilization_mem_pct / 100.0)
            put("trainguard_gpu_memory_used_bytes", g, r.memory_used_bytes)
            put("trainguard_gpu_memory_total_bytes", g, r.memory_total_bytes)
            put("trainguard_gpu_temperature_celsius", g, r.temperature_c)
            put("trainguard_gpu_power_watts", g, r.power_w)
            put("trainguard_gpu_power_limit_watts", g, r.power_limit_w)
            put("trainguard_gpu_sm_clock_hertz", g, r.sm_clock_mhz * 1e6)
            put("trainguard_gpu_sm_clock_max_hertz", g, r.sm_clock_max_mhz * 1e6)
            if r.throttle_mask is not None:
                for bit, reason in THROTTLE_REASONS:
                    put(
                        "trainguard_gpu_throttle_reasons", g + [reason], 1.0 if r.throttle_mask & bit else 0.0
                    )
            put("trainguard_gpu_ecc_errors_total", c + ["corrected"], r.ecc_corrected)
            put("trainguard_gpu_ecc_errors_total", c + ["uncorrected"], r.ecc_uncorrected)
            for kind, v in (
                ("correctable", r.remapped_correctable),
                ("uncorrectable", r.remapped_uncorrectable),
                ("pending", r.remap_pending),
                ("failure", r.remap_failure),
            ):
                put("trainguard_gpu_remapped_rows", g + [kind], v)
            put("trainguard_gpu_pcie_bytes_per_second", g + ["tx"], r.pcie_tx_bytes_per_s)
            put("trainguard_gpu_pcie_bytes_per_second", g + ["rx"], r.pcie_rx_bytes_per_s)
            put("trainguard_gpu_nvlink_bytes_per_second", g + ["tx"], r.nvlink_tx_bytes_per_s)
            put("trainguard_gpu_nvlink_bytes_per_second", g + ["rx"], r.nvlink_rx_bytes_per_s)
            for p in ranks:
                put(
                    "trainguard_gpu_process_memory_used_bytes",
                    [str(idx), r.uuid, p.job, str(p.rank), str(p.pid)],
                    r.processes.get(p.pid, float("nan")),
                )
        uuids = {i: d.uuid for i, d in self._devices.items()}
        for (gpu, xid), n in sorted(xids.items()):
            fams["trainguard_gpu_xid_errors_total"].add_metric(
                [str(gpu), uuids.get(gpu, ""), str(xid)], float(n)
            )
        return list(fams.values())

    def stop(self) -> None:
        if self._watcher is not None:
            self._watcher.stop()
            self._watcher = None
        self._nvml.shutdown()

    # -- accessors for detectors ------------------------------------------------------------
    def readings(self) -> dict[int, GpuReading]:
        """Latest reading per GPU index (lost GPUs absent)."""
        with self._lock:
            return dict(self._snapshot.readings)

    def gpu_indices(self) -> list[int]:
        """Every GPU NVML listed at start, lost ones included."""
        return sorted(self._devices)

    def lost_gpus(self) -> list[int]:
        return sorted(i for i, d in self._devices.items() if d.lost)

    def xid_counts(self) -> dict[tuple[int, int], int]:
        with self._lock:
            return dict(self._xid_counts)

    def gpu_for_pid(self, pid: int) -> int | None:
        with self._lock:
            return self._snapshot.pid_gpu.get(pid)

    def gpu_stats_for_pid(self, pid: int) -> GpuPidStats | None:
        """Throttle state and clocks of the GPU a tracked rank ``pid`` runs on (None if unknown)."""
        with self._lock:
            gpu = self._snapshot.pid_gpu.get(pid)
            reading = self._snapshot.readings.get(gpu) if gpu is not None else None
        if gpu is None or reading is None:
            return None
        ratio = reading.sm_clock_mhz / reading.sm_clock_max_mhz if reading.sm_clock_max_mhz else float("nan")
        return GpuPidStats(
            pid=pid,
            gpu=gpu,
            uuid=reading.uuid,
            throttle_reasons=reading.throttle_reasons,
            slowdown_reasons=reading.slowdown_reasons,
            sm_clock_hz=reading.sm_clock_mhz * 1e6,
            sm_clock_max_hz=reading.sm_clock_max_mhz * 1e6,
            clock_ratio=ratio,
            temperature_c=reading.temperature_c,
            power_w=reading.power_w,
            power_limit_w=reading.power_limit_w,
            utilization_ratio=reading.utilization_gpu_pct / 100.0,
        )

    # -- internals --------------------------------------------------------------------------
    def _attribute(self, readings: Mapping[int, GpuReading]) -> dict[int, int]:
        """Tracked pid -> GPU index, from NVML's per-GPU process lists (caller holds the lock)."""
        pid_gpu: dict[int, int] = {}
        for idx, r in sorted(readings.items()):
            for pid in r.processes:
                if pid in self._tracked and pid not in pid_gpu:
                    pid_gpu[pid] = idx
        if self.config.local_rank_fallback:
            for pid, proc in self._tracked.items():
                gpu = proc.gpu if proc.gpu is not None else proc.local_rank
                if pid not in pid_gpu and gpu in readings:
                    pid_gpu[pid] = gpu
        return pid_gpu

    def _event_fields(self, gpu: int, snap: _Snapshot, extra: dict[str, Any]) -> dict[str, Any]:
        """gpu, uuid and who runs on it: the tracked rank(s) if any, else NVML's lone process."""
        dev = self._devices.get(gpu)
        fields: dict[str, Any] = {"gpu": gpu, "uuid": dev.uuid if dev else ""}
        fields.update(extra)
        with self._lock:
            tracked = dict(self._tracked)
        ranks = sorted(
            (tracked[p] for p, g in snap.pid_gpu.items() if g == gpu and p in tracked), key=lambda p: p.rank
        )
        reading = snap.readings.get(gpu)
        # No "job"/"rank" keys: the agent resolves them from "pid" and passes them to the event log
        # as its own keyword arguments (see RESERVED_EVENT_KEYS).
        if ranks:
            fields["pid"] = ranks[0].pid
            fields["pids"] = [p.pid for p in ranks]
            fields["ranks"] = [p.rank for p in ranks]
        elif reading is not None and len(reading.processes) == 1:
            fields["pid"] = next(iter(reading.processes))
        return fields

    def _on_event(self, event: GpuEvent) -> None:
        with self._lock:
            snap = self._snapshot
            if event.kind == "xid" and event.xid is not None:
                self._xid_counts[(event.gpu, event.xid)] += 1
        if event.kind == "xid":
            extra: dict[str, Any] = {"xid": event.xid, "fatal": event.fatal}
            if event.xid in FATAL_XIDS:
                extra["description"] = FATAL_XIDS[event.xid]
            self._emit("gpu_xid", self._event_fields(event.gpu, snap, extra))
        else:
            kind = "double_bit" if event.kind == "ecc_double_bit" else "single_bit"
            self._emit("gpu_ecc", self._event_fields(event.gpu, snap, {"type": kind, "fatal": event.fatal}))

    def _on_event_lost(self, gpu: int | None, detail: str) -> None:
        # The event thread cannot tell which GPU went; the next poll finds it and emits gpu_lost.
        log.warning("GPU event set reports a lost GPU: %s", detail)
