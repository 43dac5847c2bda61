"""The GPU collector's settings (the ``gpu`` section of the agent config)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class GpuCollectorConfig:
    xid_events: bool = True
    """Watch the NVML event set for XID/ECC events in a thread (instant delivery)."""
    event_wait_ms: int = 200
    """Event-set wait timeout: bounds how long ``stop`` takes."""
    pcie_sampling_fallback: bool = True
    """Where the PCIe byte counters are missing, sample nvmlDeviceGetPcieThroughput (blocks ~20 ms per direction)."""
    local_rank_fallback: bool = False
    """Attribute a tracked rank to its GPU (``local_rank``, or the GPU the agent gave it) when NVML
    lists no process for it (containers whose PID namespace hides the ranks from NVML). Off by
    default: CPU-only ranks would be misattributed."""
    exclude_failed: bool = True
    """A GPU that is lost, reports a fatal XID or a double-bit ECC error is left out of every later
    launch on this node (``CUDA_VISIBLE_DEVICES``) until the agent restarts, and a job with a rank on
    it restarts without that rank's replica: dp shrinks by one, the global batch stays."""

    def __post_init__(self) -> None:
        if not isinstance(self.event_wait_ms, int) or not 10 <= self.event_wait_ms <= 5000:
            raise ValueError(
                f"gpu.event_wait_ms: must be an integer in [10, 5000], got {self.event_wait_ms!r}"
            )
        for key in ("xid_events", "pcie_sampling_fallback", "local_rank_fallback", "exclude_failed"):
            if not isinstance(getattr(self, key), bool):
                raise ValueError(f"gpu.{key}: must be true or false, got {getattr(self, key)!r}")
