"""One GPU's figures at one instant, read through the :class:`~agent.collectors.gpu.nvml.Nvml` wrapper.

Every numeric field is a float in base-ish units straight from NVML (MHz, %, W, bytes) with ``NA``
(NaN) where the GPU or driver cannot give it; conversion to Prometheus base units happens at export.
Cumulative NVML counters (NVLink, PCIe byte counts) are turned into rates here, from the previous
read kept in :class:`DeviceState`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from trainguard.agent.collectors.gpu import nvml as N
from trainguard.agent.collectors.gpu.nvml import NA, Nvml, as_str, is_na

# Clock event ("throttle") reasons, bit -> label. Stable NVML ABI (nvmlClocksEventReason*).
THROTTLE_REASONS: tuple[tuple[int, str], ...] = (
    (0x001, "gpu_idle"),
    (0x002, "applications_clocks_setting"),
    (0x004, "sw_power_cap"),
    (0x008, "hw_slowdown"),
    (0x010, "sync_boost"),
    (0x020, "sw_thermal_slowdown"),
    (0x040, "hw_thermal_slowdown"),
    (0x080, "hw_power_brake_slowdown"),
    (0x100, "display_clock_setting"),
)
# The reasons that make a busy GPU slower than its peers (what straggler causes care about);
# idle, sync boost and application clocks are states, not slowdowns.
SLOWDOWN_REASONS = frozenset(
    {"sw_power_cap", "hw_slowdown", "sw_thermal_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown"}
)


def decode_throttle(mask: int | None) -> tuple[str, ...]:
    """Names of the active reasons in an NVML clock-event bitmask, in bit order.

    >>> decode_throttle(0x44)
    ('sw_power_cap', 'hw_thermal_slowdown')
    >>> decode_throttle(None)
    ()
    """
    if mask is None:
        return ()
    return tuple(name for bit, name in THROTTLE_REASONS if mask & bit)


@dataclass
class DeviceState:
    """What the collector keeps per GPU between reads: identity, links, previous counters."""

    index: int
    handle: Any
    uuid: str
    name: str
    nvlinks: tuple[int, ...] = ()
    lost: bool = False
    prev_time: float | None = None
    prev_counters: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class GpuReading:
    index: int
    uuid: str
    name: str
    utilization_gpu_pct: float = NA
    utilization_mem_pct: float = NA
    memory_used_bytes: float = NA
    memory_total_bytes: float = NA
    temperature_c: float = NA
    power_w: float = NA
    power_limit_w: float = NA
    sm_clock_mhz: float = NA
    sm_clock_max_mhz: float = NA
    throttle_mask: int | None = None
    ecc_corrected: float = NA  # volatile (since driver load) single-bit/corrected
    ecc_uncorrected: float = NA  # volatile double-bit/uncorrected
    remapped_correctable: float = NA
    remapped_uncorrectable: float = NA
    remap_pending: float = NA
    remap_failure: float = NA
    pcie_tx_bytes_per_s: float = NA
    pcie_rx_bytes_per_s: float = NA
    nvlink_tx_bytes_per_s: float = NA
    nvlink_rx_bytes_per_s: float = NA
    processes: dict[int, float] = field(default_factory=dict)  # pid -> used GPU memory bytes (NA if hidden)

    @property
    def throttle_reasons(self) -> tuple[str, ...]:
        return decode_throttle(self.throttle_mask)

    @property
    def slowdown_reasons(self) -> tuple[str, ...]:
        return tuple(r for r in self.throttle_reasons if r in SLOWDOWN_REASONS)


def open_device(nvml: Nvml, index: int) -> DeviceState:
    """Handle, identity and active NVLinks of GPU ``index`` (links are probed once, not per read)."""
    handle = nvml.handle(index)
    uuid = as_str(nvml.query("nvmlDeviceGetUUID", handle, default=f"GPU-index-{index}"))
    name = as_str(nvml.query("nvmlDeviceGetName", handle, default="N/A"))
    links = []
    for link in range(N.NVML_NVLINK_MAX_LINKS):
        state = nvml.query("nvmlDeviceGetNvLinkState", handle, link, default=None)
        if state is None:
            if link == 0:
                break  # no NVLink on this GPU at all: skip probing the rest
            continue
        if state:
            links.append(link)
    return DeviceState(index=index, handle=handle, uuid=uuid, name=name, nvlinks=tuple(links))


def _num(value: Any, scale: float = 1.0) -> float:
    if value is None or is_na(value):
        return NA
    return float(value) * scale


def _field_values(nvml: Nvml, handle: Any, ids: list[tuple[int, int]]) -> list[float]:
    """``nvmlDeviceGetFieldValues`` results as floats, NA per entry that failed."""
    if not ids:
        return []
    values = nvml.query("nvmlDeviceGetFieldValues", handle, ids, default=None)
    if values is None:
        return [NA] * len(ids)
    out = []
    for v in values:
        if getattr(v, "nvmlReturn", 1) != 0:
            out.append(NA)
        else:
            out.append(float(v.value.ullVal))
    return out


def _rate(state: DeviceState, key: str, total: float, now: float, scale: float) -> float:
    """Per-second rate of a cumulative counter since the previous read; NA on the first read or wrap."""
    prev = state.prev_counters.get(key)
    if is_na(total):
        state.prev_counters.pop(key, None)
        return NA
    state.prev_counters[key] = total
    if prev is None or state.prev_time is None or now <= state.prev_time or total < prev:
        return NA
    return (total - prev) * scale / (now - state.prev_time)


def read_gpu(nvml: Nvml, state: DeviceState, now: float, pcie_sampling_fallback: bool = True) -> GpuReading:
    """Read every field of one GPU. Raises :class:`~agent.collectors.gpu.nvml.GpuLost` only."""
    h = state.handle
    q = nvml.query
    util = q("nvmlDeviceGetUtilizationRates", h, default=None)
    mem = q("nvmlDeviceGetMemoryInfo", h, version=N.NVML_MEMORY_V2, default=None)
    if mem is None:
        mem = q("nvmlDeviceGetMemoryInfo", h, default=None)
    mask: Any = q("nvmlDeviceGetCurrentClocksEventReasons", h, default=None)
    if mask is None:
        mask = q("nvmlDeviceGetCurrentClocksThrottleReasons", h, default=None)
    remapped = q("nvmlDeviceGetRemappedRows", h, default=None)
    if remapped is None:
        remapped = (NA, NA, NA, NA)

    # One field-value call for all cumulative counters: cheaper than per-counter calls and, for
    # PCIe, free of the 20 ms sampling window nvmlDeviceGetPcieThroughput blocks for.
    ids = [(N.NVML_FI_DEV_PCIE_COUNT_TX_BYTES, 0), (N.NVML_FI_DEV_PCIE_COUNT_RX_BYTES, 0)]
    for link in state.nvlinks:
        ids += [
            (N.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, link),
            (N.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, link),
        ]
    fv = _field_values(nvml, h, ids)
    pcie_tx = _rate(state, "pcie_tx", fv[0], now, 1.0)
    pcie_rx = _rate(state, "pcie_rx", fv[1], now, 1.0)
    if is_na(fv[0]) and pcie_sampling_fallback:  # older drivers: sampled KB/s
        pcie_tx = _num(q("nvmlDeviceGetPcieThroughput", h, N.NVML_PCIE_UTIL_TX_BYTES), 1024.0)
        pcie_rx = _num(q("nvmlDeviceGetPcieThroughput", h, N.NVML_PCIE_UTIL_RX_BYTES), 1024.0)
    nv_tx = nv_rx = NA
    if state.nvlinks:
        link_vals = fv[2:]
        tx_total = math.fsum(link_vals[0::2])  # NaN if any link failed: better N/A than a dip
        rx_total = math.fsum(link_vals[1::2])
        nv_tx = _rate(state, "nvlink_tx", tx_total, now, 1024.0)
        nv_rx = _rate(state, "nvlink_rx", rx_total, now, 1024.0)
    state.prev_time = now

    return GpuReading(
        index=state.index,
        uuid=state.uuid,
        name=state.name,
        utilization_gpu_pct=_num(getattr(util, "gpu", None)),
        utilization_mem_pct=_num(getattr(util, "memory", None)),
        memory_used_bytes=_num(getattr(mem, "used", None)),
        memory_total_bytes=_num(getattr(mem, "total", None)),
        temperature_c=_num(q("nvmlDeviceGetTemperature", h, N.NVML_TEMPERATURE_GPU)),
        power_w=_num(q("nvmlDeviceGetPowerUsage", h), 1e-3),
        power_limit_w=_num(q("nvmlDeviceGetEnforcedPowerLimit", h), 1e-3),
        sm_clock_mhz=_num(q("nvmlDeviceGetClockInfo", h, N.NVML_CLOCK_SM)),
        sm_clock_max_mhz=_num(q("nvmlDeviceGetMaxClockInfo", h, N.NVML_CLOCK_SM)),
        throttle_mask=None if mask is None else int(mask),
        ecc_corrected=_num(
            q("nvmlDeviceGetTotalEccErrors", h, N.NVML_MEMORY_ERROR_TYPE_CORRECTED, N.NVML_VOLATILE_ECC)
        ),
        ecc_uncorrected=_num(
            q("nvmlDeviceGetTotalEccErrors", h, N.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, N.NVML_VOLATILE_ECC)
        ),
        remapped_correctable=_num(remapped[0]),
        remapped_uncorrectable=_num(remapped[1]),
        remap_pending=_num(remapped[2]),
        remap_failure=_num(remapped[3]),
        pcie_tx_bytes_per_s=pcie_tx,
        pcie_rx_bytes_per_s=pcie_rx,
        nvlink_tx_bytes_per_s=nv_tx,
        nvlink_rx_bytes_per_s=nv_rx,
        processes=read_processes(nvml, h),
    )


def read_processes(nvml: Nvml, handle: Any) -> dict[int, float]:
    """pid -> used GPU memory (bytes, NA where the driver hides it) of compute and graphics users."""
    procs: dict[int, float] = {}
    for fn in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
        found = nvml.query(fn, handle, default=None)
        if found is None:  # the unversioned (v3) binding needs driver >= 510: older ones take v2
            found = nvml.query(fn + "_v2", handle, default=None)
        for p in found or ():
            pid = int(p.pid)
            used = _num(getattr(p, "usedGpuMemory", None))
            if pid not in procs or is_na(procs[pid]):
                procs[pid] = used
    return procs
