"""A fake NVML module for tests: the pynvml functions, constants and exceptions the agent uses.

An instance of :class:`FakeNvml` stands in for the ``pynvml`` module (``Nvml(module=fake)``).
GPUs are :class:`FakeGpu` objects whose fields tests change between polls; helpers script the
situations the agent must handle: thermal/power throttling, ECC errors, XID events pushed into
registered event sets, unsupported fields, a missing library and a GPU lost mid-run.

Return shapes follow pynvml (objects with ``.gpu``/``.memory``, ``.used``/``.total``, ``.pid``/
``.usedGpuMemory``, field values with ``.nvmlReturn``/``.value.ullVal``, event data with
``.device``/``.eventType``/``.eventData``), and errors follow pynvml's class scheme: ``NVMLError(v)``
builds the subclass for code ``v``, and every instance has ``.value``.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

# -- constants (same values as pynvml; tests/collectors/test_gpu_nvml.py checks them against the real module) --
NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_UNKNOWN = 999

NVML_TEMPERATURE_GPU = 0
NVML_CLOCK_SM = 1
NVML_MEMORY_ERROR_TYPE_CORRECTED = 0
NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
NVML_VOLATILE_ECC = 0
NVML_PCIE_UTIL_TX_BYTES = 0
NVML_PCIE_UTIL_RX_BYTES = 1
NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX = 138
NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX = 139
NVML_FI_DEV_PCIE_COUNT_TX_BYTES = 197
NVML_FI_DEV_PCIE_COUNT_RX_BYTES = 198
nvmlMemory_v2 = 0x02000028

nvmlEventTypeSingleBitEccError = 0x1
nvmlEventTypeDoubleBitEccError = 0x2
nvmlEventTypeXidCriticalError = 0x8

nvmlClocksEventReasonGpuIdle = 0x001
nvmlClocksEventReasonSwPowerCap = 0x004
nvmlClocksEventReasonHwSlowdown = 0x008
nvmlClocksEventReasonSwThermalSlowdown = 0x020
nvmlClocksEventReasonHwThermalSlowdown = 0x040
nvmlClocksEventReasonHwPowerBrakeSlowdown = 0x080


# -- exceptions, built like pynvml's: NVMLError(code) returns the code's subclass ---------------
class NVMLError(Exception):
    _by_value: dict[int, type[NVMLError]] = {}
    value: int

    def __new__(cls, value: int) -> NVMLError:
        if cls is NVMLError:
            cls = NVMLError._by_value.get(value, NVMLError)
        obj = Exception.__new__(cls)
        obj.value = value
        return obj

    def __init__(self, value: int) -> None:
        super().__init__(value)

    def __str__(self) -> str:
        return _MESSAGES.get(self.value, f"NVML Error with code {self.value}")


_MESSAGES = {
    NVML_ERROR_UNINITIALIZED: "Uninitialized",
    NVML_ERROR_INVALID_ARGUMENT: "Invalid Argument",
    NVML_ERROR_NOT_SUPPORTED: "Not Supported",
    NVML_ERROR_NO_PERMISSION: "Insufficient Permissions",
    NVML_ERROR_NOT_FOUND: "Not Found",
    NVML_ERROR_DRIVER_NOT_LOADED: "Driver Not Loaded",
    NVML_ERROR_TIMEOUT: "Timeout",
    NVML_ERROR_LIBRARY_NOT_FOUND: "NVML Shared Library Not Found",
    NVML_ERROR_FUNCTION_NOT_FOUND: "Function Not Found",
    NVML_ERROR_GPU_IS_LOST: "GPU is lost",
    NVML_ERROR_UNKNOWN: "Unknown Error",
}


def _subclass(name: str, code: int) -> type[NVMLError]:
    def new(cls: type[NVMLError], *args: Any) -> NVMLError:
        return NVMLError.__new__(cls, code)

    def init(self: NVMLError, *args: Any) -> None:
        Exception.__init__(self, code)

    cls = type(name, (NVMLError,), {"__new__": new, "__init__": init})
    NVMLError._by_value[code] = cls
    return cls


NVMLError_Uninitialized = _subclass("NVMLError_Uninitialized", NVML_ERROR_UNINITIALIZED)
NVMLError_InvalidArgument = _subclass("NVMLError_InvalidArgument", NVML_ERROR_INVALID_ARGUMENT)
NVMLError_NotSupported = _subclass("NVMLError_NotSupported", NVML_ERROR_NOT_SUPPORTED)
NVMLError_NoPermission = _subclass("NVMLError_NoPermission", NVML_ERROR_NO_PERMISSION)
NVMLError_NotFound = _subclass("NVMLError_NotFound", NVML_ERROR_NOT_FOUND)
NVMLError_DriverNotLoaded = _subclass("NVMLError_DriverNotLoaded", NVML_ERROR_DRIVER_NOT_LOADED)
NVMLError_Timeout = _subclass("NVMLError_Timeout", NVML_ERROR_TIMEOUT)
NVMLError_LibraryNotFound = _subclass("NVMLError_LibraryNotFound", NVML_ERROR_LIBRARY_NOT_FOUND)
NVMLError_FunctionNotFound = _subclass("NVMLError_FunctionNotFound", NVML_ERROR_FUNCTION_NOT_FOUND)
NVMLError_GpuIsLost = _subclass("NVMLError_GpuIsLost", NVML_ERROR_GPU_IS_LOST)
NVMLError_Unknown = _subclass("NVMLError_Unknown", NVML_ERROR_UNKNOWN)


class NVMLLibraryMismatchError(Exception):
    """pynvml's error for an unversioned binding on a too-old driver (a plain Exception there too)."""


# Function names the agent calls; FakeGpu.unsupported takes these names.
FUNCTIONS = (
    "nvmlInit",
    "nvmlShutdown",
    "nvmlSystemGetDriverVersion",
    "nvmlDeviceGetCount",
    "nvmlDeviceGetHandleByIndex",
    "nvmlDeviceGetIndex",
    "nvmlDeviceGetUUID",
    "nvmlDeviceGetName",
    "nvmlDeviceGetUtilizationRates",
    "nvmlDeviceGetMemoryInfo",
    "nvmlDeviceGetTemperature",
    "nvmlDeviceGetPowerUsage",
    "nvmlDeviceGetEnforcedPowerLimit",
    "nvmlDeviceGetClockInfo",
    "nvmlDeviceGetMaxClockInfo",
    "nvmlDeviceGetCurrentClocksEventReasons",
    "nvmlDeviceGetCurrentClocksThrottleReasons",
    "nvmlDeviceGetTotalEccErrors",
    "nvmlDeviceGetRemappedRows",
    "nvmlDeviceGetPcieThroughput",
    "nvmlDeviceGetNvLinkState",
    "nvmlDeviceGetFieldValues",
    "nvmlDeviceGetComputeRunningProcesses",
    "nvmlDeviceGetComputeRunningProcesses_v2",
    "nvmlDeviceGetGraphicsRunningProcesses",
    "nvmlDeviceGetSupportedEventTypes",
    "nvmlDeviceRegisterEvents",
    "nvmlEventSetCreate",
    "nvmlEventSetWait_v2",
    "nvmlEventSetFree",
)


@dataclass
class FakeGpu:
    """One scripted GPU. Units as NVML gives them: %, bytes, C, mW, MHz, KB/s, KiB/bytes counters."""

    index: int = 0
    uuid: str = ""
    name: str = "NVIDIA H200"
    util_gpu: int = 50
    util_mem: int = 20
    mem_total: int = 141 * 1024**3
    mem_used: int = 10 * 1024**3
    temperature: int = 45
    power_mw: int = 300_000
    power_limit_mw: int = 700_000
    sm_clock: int = 1980
    sm_clock_max: int = 1980
    throttle_mask: int = 0
    ecc_corrected: int = 0
    ecc_uncorrected: int = 0
    remapped: tuple[int, int, int, int] = (0, 0, 0, 0)  # correctable, uncorrectable, pending, failure
    pcie_tx_bytes: int = 0  # cumulative counters (field values 197/198)
    pcie_rx_bytes: int = 0
    pcie_tx_kbs: int = 1000  # sampled KB/s (nvmlDeviceGetPcieThroughput)
    pcie_rx_kbs: int = 2000
    nvlinks: tuple[int, ...] = (0, 1)  # active link ids; () means no NVLink (NOT_SUPPORTED)
    nvlink_tx_kib: dict[int, int] = field(default_factory=dict)  # cumulative KiB per link
    nvlink_rx_kib: dict[int, int] = field(default_factory=dict)
    processes: dict[int, int | None] = field(default_factory=dict)  # pid -> used bytes (None: hidden)
    unsupported: set[str] = field(default_factory=set)  # function names raising NOT_SUPPORTED
    unsupported_fields: set[int] = field(default_factory=set)  # field ids failing in field values
    old_driver: set[str] = field(default_factory=set)  # functions raising NVMLLibraryMismatchError
    supported_events: int = 0xB  # XID + SBE + DBE
    lost: bool = False

    def __post_init__(self) -> None:
        if not self.uuid:
            self.uuid = f"GPU-fake-{self.index:04d}"

    # -- scripted situations ---------------------------------------------------------------
    def throttle_thermal(self, temperature: int = 92, clock: int = 1200) -> None:
        self.temperature = temperature
        self.sm_clock = clock
        self.throttle_mask = nvmlClocksEventReasonHwThermalSlowdown | nvmlClocksEventReasonSwThermalSlowdown

    def throttle_power(self, clock: int = 1400) -> None:
        self.power_mw = self.power_limit_mw
        self.sm_clock = clock
        self.throttle_mask = nvmlClocksEventReasonSwPowerCap

    def unthrottle(self) -> None:
        self.sm_clock = self.sm_clock_max
        self.throttle_mask = 0

    def ecc_errors(self, corrected: int = 0, uncorrected: int = 0) -> None:
        self.ecc_corrected += corrected
        self.ecc_uncorrected += uncorrected

    def lose(self) -> None:
        """Every later call on this GPU raises NVMLError_GpuIsLost (XID 79 style)."""
        self.lost = True


@dataclass
class _Handle:
    gpu: FakeGpu


class _EventSet:
    def __init__(self) -> None:
        self.queue: queue.Queue[Any] = queue.Queue()
        self.registered: dict[int, int] = {}  # gpu index -> mask
        self.freed = False


class FakeNvml:
    """Stands in for the ``pynvml`` module. ``init_error``: an NVML error code nvmlInit raises."""

    def __init__(
        self, gpus: list[FakeGpu] | None = None, init_error: int | None = None, driver: str = "999.99"
    ) -> None:
        self.gpus = gpus if gpus is not None else [FakeGpu(index=0)]
        self.init_error = init_error
        self.driver = driver
        self.init_calls = 0
        self.shutdown_calls = 0
        self.calls: dict[str, int] = {}
        self.event_sets: list[_EventSet] = []
        self._lock = threading.Lock()
        self._handles = [_Handle(g) for g in self.gpus]
        # the module's exception classes and constants, reachable as attributes like pynvml's
        for name, value in globals().items():
            if name.startswith(("NVML", "nvml")) and not callable(getattr(self, name, None)):
                setattr(self, name, value)

    # -- scripting helpers -----------------------------------------------------------------
    def push_xid(self, index: int, xid: int) -> bool:
        """Deliver XID ``xid`` on GPU ``index`` to every event set that registered for XIDs."""
        return self._push(index, nvmlEventTypeXidCriticalError, xid)

    def push_ecc(self, index: int, double_bit: bool) -> bool:
        etype = nvmlEventTypeDoubleBitEccError if double_bit else nvmlEventTypeSingleBitEccError
        if double_bit:
            self.gpus[index].ecc_uncorrected += 1
        else:
            self.gpus[index].ecc_corrected += 1
        return self._push(index, etype, 0)

    def _push(self, index: int, etype: int, data: int) -> bool:
        delivered = False
        for es in self.event_sets:
            if not es.freed and es.registered.get(index, 0) & etype:
                es.queue.put(
                    SimpleNamespace(
                        device=self._handles[index],
                        eventType=etype,
                        eventData=data,
                        gpuInstanceId=0,
                        computeInstanceId=0,
                    )
                )
                delivered = True
        return delivered

    # -- internals -------------------------------------------------------------------------
    def _enter(self, name: str, handle: _Handle | None = None) -> FakeGpu | None:
        with self._lock:
            self.calls[name] = self.calls.get(name, 0) + 1
        if name not in ("nvmlInit", "nvmlShutdown") and self.init_calls <= self.shutdown_calls:
            raise NVMLError(NVML_ERROR_UNINITIALIZED)
        if handle is None:
            return None
        gpu = handle.gpu
        if gpu.lost:
            raise NVMLError(NVML_ERROR_GPU_IS_LOST)
        if name in gpu.unsupported:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        if name in gpu.old_driver:
            raise NVMLLibraryMismatchError(f"Unversioned function called: {name}")
        return gpu

    # -- the pynvml API --------------------------------------------------------------------
    def nvmlInit(self) -> None:
        self._enter("nvmlInit")
        if self.init_error is not None:
            raise NVMLError(self.init_error)
        self.init_calls += 1

    def nvmlShutdown(self) -> None:
        self._enter("nvmlShutdown")
        if self.init_calls <= self.shutdown_calls:
            raise NVMLError(NVML_ERROR_UNINITIALIZED)
        self.shutdown_calls += 1

    def nvmlSystemGetDriverVersion(self) -> str:
        self._enter("nvmlSystemGetDriverVersion")
        return self.driver

    def nvmlDeviceGetCount(self) -> int:
        self._enter("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> _Handle:
        self._enter("nvmlDeviceGetHandleByIndex")
        if not 0 <= index < len(self._handles):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        self._enter("nvmlDeviceGetHandleByIndex", self._handles[index])
        return self._handles[index]

    def nvmlDeviceGetIndex(self, h: _Handle) -> int:
        return self._gpu("nvmlDeviceGetIndex", h).index

    def nvmlDeviceGetUUID(self, h: _Handle) -> str:
        return self._gpu("nvmlDeviceGetUUID", h).uuid

    def nvmlDeviceGetName(self, h: _Handle) -> str:
        return self._gpu("nvmlDeviceGetName", h).name

    def nvmlDeviceGetUtilizationRates(self, h: _Handle) -> SimpleNamespace:
        g = self._gpu("nvmlDeviceGetUtilizationRates", h)
        return SimpleNamespace(gpu=g.util_gpu, memory=g.util_mem)

    def nvmlDeviceGetMemoryInfo(self, h: _Handle, version: int | None = None) -> SimpleNamespace:
        g = self._gpu("nvmlDeviceGetMemoryInfo", h)
        if version is not None and version != nvmlMemory_v2:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return SimpleNamespace(total=g.mem_total, used=g.mem_used, free=g.mem_total - g.mem_used, reserved=0)

    def nvmlDeviceGetTemperature(self, h: _Handle, sensor: int) -> int:
        g = self._gpu("nvmlDeviceGetTemperature", h)
        if sensor != NVML_TEMPERATURE_GPU:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return g.temperature

    def nvmlDeviceGetPowerUsage(self, h: _Handle) -> int:
        return self._gpu("nvmlDeviceGetPowerUsage", h).power_mw

    def nvmlDeviceGetEnforcedPowerLimit(self, h: _Handle) -> int:
        return self._gpu("nvmlDeviceGetEnforcedPowerLimit", h).power_limit_mw

    def nvmlDeviceGetClockInfo(self, h: _Handle, clock: int) -> int:
        g = self._gpu("nvmlDeviceGetClockInfo", h)
        if clock != NVML_CLOCK_SM:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return g.sm_clock

    def nvmlDeviceGetMaxClockInfo(self, h: _Handle, clock: int) -> int:
        g = self._gpu("nvmlDeviceGetMaxClockInfo", h)
        if clock != NVML_CLOCK_SM:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return g.sm_clock_max

    def nvmlDeviceGetCurrentClocksEventReasons(self, h: _Handle) -> int:
        return self._gpu("nvmlDeviceGetCurrentClocksEventReasons", h).throttle_mask

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, h: _Handle) -> int:
        return self._gpu("nvmlDeviceGetCurrentClocksThrottleReasons", h).throttle_mask

    def nvmlDeviceGetTotalEccErrors(self, h: _Handle, error_type: int, counter_type: int) -> int:
        g = self._gpu("nvmlDeviceGetTotalEccErrors", h)
        if counter_type != NVML_VOLATILE_ECC:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return g.ecc_corrected if error_type == NVML_MEMORY_ERROR_TYPE_CORRECTED else g.ecc_uncorrected

    def nvmlDeviceGetRemappedRows(self, h: _Handle) -> tuple[int, int, int, int]:
        return self._gpu("nvmlDeviceGetRemappedRows", h).remapped

    def nvmlDeviceGetPcieThroughput(self, h: _Handle, counter: int) -> int:
        g = self._gpu("nvmlDeviceGetPcieThroughput", h)
        return g.pcie_tx_kbs if counter == NVML_PCIE_UTIL_TX_BYTES else g.pcie_rx_kbs

    def nvmlDeviceGetNvLinkState(self, h: _Handle, link: int) -> int:
        g = self._gpu("nvmlDeviceGetNvLinkState", h)
        if not g.nvlinks:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        if link > max(g.nvlinks):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return 1 if link in g.nvlinks else 0

    def nvmlDeviceGetFieldValues(self, h: _Handle, field_ids: list[Any]) -> list[SimpleNamespace]:
        g = self._gpu("nvmlDeviceGetFieldValues", h)
        out = []
        for fid in field_ids:
            fid, scope = fid if isinstance(fid, tuple) else (fid, 0)
            value: int | None
            if fid in g.unsupported_fields:
                value = None
            elif fid == NVML_FI_DEV_PCIE_COUNT_TX_BYTES:
                value = g.pcie_tx_bytes
            elif fid == NVML_FI_DEV_PCIE_COUNT_RX_BYTES:
                value = g.pcie_rx_bytes
            elif fid == NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX and scope in g.nvlinks:
                value = g.nvlink_tx_kib.get(scope, 0)
            elif fid == NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX and scope in g.nvlinks:
                value = g.nvlink_rx_kib.get(scope, 0)
            else:
                value = None
            ret = NVML_SUCCESS if value is not None else NVML_ERROR_NOT_SUPPORTED
            out.append(
                SimpleNamespace(
                    fieldId=fid, scopeId=scope, nvmlReturn=ret, value=SimpleNamespace(ullVal=value or 0)
                )
            )
        return out

    def nvmlDeviceGetComputeRunningProcesses(self, h: _Handle) -> list[SimpleNamespace]:
        g = self._gpu("nvmlDeviceGetComputeRunningProcesses", h)
        return [
            SimpleNamespace(
                pid=pid, usedGpuMemory=used, gpuInstanceId=0xFFFFFFFF, computeInstanceId=0xFFFFFFFF
            )
            for pid, used in g.processes.items()
        ]

    def nvmlDeviceGetComputeRunningProcesses_v2(self, h: _Handle) -> list[SimpleNamespace]:
        g = self._gpu("nvmlDeviceGetComputeRunningProcesses_v2", h)
        return [SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in g.processes.items()]

    def nvmlDeviceGetGraphicsRunningProcesses(self, h: _Handle) -> list[SimpleNamespace]:
        self._gpu("nvmlDeviceGetGraphicsRunningProcesses", h)
        return []

    def nvmlDeviceGetSupportedEventTypes(self, h: _Handle) -> int:
        return self._gpu("nvmlDeviceGetSupportedEventTypes", h).supported_events

    def nvmlEventSetCreate(self) -> _EventSet:
        self._enter("nvmlEventSetCreate")
        es = _EventSet()
        self.event_sets.append(es)
        return es

    def nvmlDeviceRegisterEvents(self, h: _Handle, event_types: int, event_set: _EventSet) -> None:
        g = self._gpu("nvmlDeviceRegisterEvents", h)
        if event_types & ~g.supported_events:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        event_set.registered[g.index] = event_set.registered.get(g.index, 0) | event_types

    def nvmlEventSetWait_v2(self, event_set: _EventSet, timeout_ms: int) -> Any:
        self._enter("nvmlEventSetWait_v2")
        try:
            return event_set.queue.get(timeout=timeout_ms / 1000.0)
        except queue.Empty:
            raise NVMLError(NVML_ERROR_TIMEOUT) from None

    def nvmlEventSetFree(self, event_set: _EventSet) -> None:
        self._enter("nvmlEventSetFree")
        event_set.freed = True

    def _gpu(self, name: str, h: _Handle) -> FakeGpu:
        gpu = self._enter(name, h)
        assert gpu is not None
        return gpu
