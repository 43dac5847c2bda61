"""The eBPF programs, one small class each (see base.Program)."""

from .base import MAX_TRACKED, PRELUDE, ProbeEnv, Program
from .events import OomKills, ProcessExits
from .io import BlockIoLatency
from .mem import DirectReclaim, PageFaults
from .net import TcpRetransmits
from .sched import OffCpuTime, RunqLatency

ALL_PROGRAMS: tuple[type[Program], ...] = (
    RunqLatency, OffCpuTime, BlockIoLatency, TcpRetransmits, PageFaults, DirectReclaim,
    ProcessExits, OomKills,
)

__all__ = ["ALL_PROGRAMS", "MAX_TRACKED", "PRELUDE", "ProbeEnv", "Program", "RunqLatency", "OffCpuTime",
           "BlockIoLatency", "TcpRetransmits", "PageFaults", "DirectReclaim", "ProcessExits", "OomKills"]
