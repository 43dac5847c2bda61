"""XID and ECC events from an NVML event set, delivered as they happen.

A dedicated thread waits on the event set with a short timeout (so ``stop`` returns quickly) and
hands each event to a callback. Which XIDs are fatal follows NVIDIA's XID catalogue: the ones after
which the GPU (or the job on it) cannot be trusted without a reset or a restart.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from trainguard.agent import health
from trainguard.agent.collectors.gpu import nvml as N
from trainguard.agent.collectors.gpu.nvml import GpuLost, Nvml, NvmlError

log = logging.getLogger(__name__)

# XID -> short description, for the ones the healer must act on (drain/reset the GPU, restart ranks).
FATAL_XIDS: dict[int, str] = {
    48: "double-bit ECC error",
    61: "internal micro-controller breakpoint/warning",
    62: "internal micro-controller halt",
    63: "ECC page retirement or row remapping recording event",
    64: "ECC page retirement or row remapping recording failure",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    119: "GSP RPC timeout",
    120: "GSP error",
    140: "unrecovered ECC error",
}


def is_fatal_xid(xid: int) -> bool:
    """True for XIDs that mean the GPU needs attention beyond restarting the faulting process.

    >>> is_fatal_xid(79), is_fatal_xid(13)
    (True, False)
    """
    return xid in FATAL_XIDS


@dataclass(frozen=True)
class GpuEvent:
    """One event from the event set. ``kind`` is "xid", "ecc_double_bit" or "ecc_single_bit"."""

    gpu: int
    kind: str
    xid: int | None
    fatal: bool


WANTED_EVENTS = N.EVENT_XID_CRITICAL | N.EVENT_DOUBLE_BIT_ECC | N.EVENT_SINGLE_BIT_ECC


class XidWatcher:
    """Registers GPUs on one NVML event set and calls ``on_event`` from its own thread."""

    def __init__(
        self,
        nvml: Nvml,
        handles: dict[int, Any],
        on_event: Callable[[GpuEvent], None],
        on_lost: Callable[[int | None, str], None],
        wait_ms: int = 200,
    ) -> None:
        self._nvml = nvml
        self._handles = handles
        self._on_event = on_event
        self._on_lost = on_lost
        self._wait_ms = wait_ms
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._event_set: Any = None
        self.registered: dict[int, int] = {}  # gpu index -> registered event mask

    def start(self) -> bool:
        """Create the event set and register every GPU that supports XID events.

        Returns False (and logs why once) when no GPU could be registered: the collector still
        works, only without instant XID delivery.
        """
        try:
            self._event_set = self._nvml.call("nvmlEventSetCreate")
        except (NvmlError, self._nvml.module.NVMLError) as exc:
            log.warning("GPU XID events off: nvmlEventSetCreate failed: %s", exc)
            return False
        for index, handle in self._handles.items():
            supported = self._nvml.query("nvmlDeviceGetSupportedEventTypes", handle, default=None)
            mask = WANTED_EVENTS if supported is None else WANTED_EVENTS & int(supported)
            if not mask:
                continue
            try:
                self._nvml.call("nvmlDeviceRegisterEvents", handle, mask, self._event_set)
            except (NvmlError, self._nvml.module.NVMLError) as exc:
                # Some GPUs refuse the ECC bits but take XIDs alone: try that before giving up.
                try:
                    self._nvml.call("nvmlDeviceRegisterEvents", handle, N.EVENT_XID_CRITICAL, self._event_set)
                    mask = N.EVENT_XID_CRITICAL
                except (NvmlError, self._nvml.module.NVMLError):
                    log.warning("GPU %d: XID events off: %s", index, exc)
                    continue
            self.registered[index] = mask
        if not self.registered:
            self._free()
            return False
        self._thread = threading.Thread(target=self._run, name="trainguard-gpu-xid", daemon=True)
        self._thread.start()
        return True

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 + self._wait_ms / 1000)
            self._thread = None
        self._free()

    def _free(self) -> None:
        if self._event_set is not None:
            try:
                self._nvml.call("nvmlEventSetFree", self._event_set)
            except Exception as exc:
                log.debug("nvmlEventSetFree: %s", exc)
            self._event_set = None

    def _run(self) -> None:
        mod = self._nvml.module
        failures = 0
        while not self._stop.is_set():
            health.beat(self, "gpu-xid")
            try:
                data = self._nvml.call("nvmlEventSetWait_v2", self._event_set, self._wait_ms)
            except GpuLost as exc:
                self._on_lost(None, str(exc))
                self._stop.wait(1.0)  # the poll loop finds which GPU; do not spin on a dead device
                continue
            except mod.NVMLError as exc:
                if self._nvml.error_code(exc) == N.NVML_ERROR_TIMEOUT:
                    failures = 0
                    continue
                failures += 1
                if failures == 1:
                    log.warning("GPU event wait failed: %s (retrying)", exc)
                self._stop.wait(min(5.0, 0.1 * failures))
                continue
            except Exception as exc:  # a bug here must not kill XID delivery for good
                log.exception("GPU event thread: %s", exc)
                self._stop.wait(1.0)
                continue
            failures = 0
            try:
                event = self._decode(data)
                if event is not None:
                    self._on_event(event)
            except Exception:  # one bad event must not end delivery of the next ones
                log.exception("GPU event handling failed")

    def _decode(self, data: Any) -> GpuEvent | None:
        gpu = self._index_of(data.device)
        etype = int(data.eventType)
        if etype & N.EVENT_XID_CRITICAL:
            xid = int(data.eventData)
            return GpuEvent(gpu=gpu, kind="xid", xid=xid, fatal=is_fatal_xid(xid))
        if etype & N.EVENT_DOUBLE_BIT_ECC:
            return GpuEvent(gpu=gpu, kind="ecc_double_bit", xid=None, fatal=True)
        if etype & N.EVENT_SINGLE_BIT_ECC:
            return GpuEvent(gpu=gpu, kind="ecc_single_bit", xid=None, fatal=False)
        return None

    def _index_of(self, device: Any) -> int:
        key = _handle_key(device)
        for index, handle in self._handles.items():
            if handle is device or _handle_key(handle) == key:
                return index
        try:
            index = self._nvml.query("nvmlDeviceGetIndex", device, default=None)
        except NvmlError:  # the GPU is gone: the poll loop reports which one
            return -1
        return -1 if index is None else int(index)


def _handle_key(handle: Any) -> int:
    """The C pointer behind an NVML handle: ctypes hands out a new Python object per event."""
    try:
        value = ctypes.cast(handle, ctypes.c_void_p).value
    except (TypeError, ctypes.ArgumentError):
        return id(handle)  # not a ctypes pointer (the fake in tests)
    return value if value is not None else id(handle)
