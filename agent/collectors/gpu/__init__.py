"""GPU collector over NVML (nvidia-ml-py). Only :mod:`agent.collectors.gpu.nvml` imports pynvml."""

from trainguard.agent.collectors.gpu.collector import METRICS, GpuCollector, GpuCollectorConfig, GpuPidStats
from trainguard.agent.collectors.gpu.nvml import NA, GpuLost, Nvml, NvmlError, NvmlUnavailable
from trainguard.agent.collectors.gpu.reading import (
    SLOWDOWN_REASONS,
    THROTTLE_REASONS,
    GpuReading,
    decode_throttle,
)
from trainguard.agent.collectors.gpu.xid import FATAL_XIDS, is_fatal_xid

__all__ = [
    "FATAL_XIDS",
    "METRICS",
    "NA",
    "SLOWDOWN_REASONS",
    "THROTTLE_REASONS",
    "GpuCollector",
    "GpuCollectorConfig",
    "GpuLost",
    "GpuPidStats",
    "GpuReading",
    "Nvml",
    "NvmlError",
    "NvmlUnavailable",
    "decode_throttle",
    "is_fatal_xid",
]
