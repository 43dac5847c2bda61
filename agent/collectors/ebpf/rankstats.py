"""Per-rank kernel figures over the last interval, from two snapshots: what the straggler detector
reads to attach a cause (run-queue waits, off-CPU time, reclaim, faults, retransmits)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .hist import Log2Hist, log2_quantile
from .metrics import KernelSnapshot
from .programs.mem import Reclaim
from .programs.sched import OffCpu


@dataclass(frozen=True)
class RankKernelStats:
    """What the kernel saw of one rank over the last interval (deltas; NaN where not measured)."""

    interval_s: float
    runq_p50_s: float
    runq_p99_s: float
    runq_total_s: float  # summed run-queue wait of the rank's threads
    runq_count: int
    offcpu_runnable_s: float
    offcpu_blocked_s: float
    offcpu_io_s: float  # the uninterruptible part of offcpu_blocked_s: disk I/O, page-in
    reclaim_s: float
    faults: float
    tcp_retransmits: float


def _counters(s: KernelSnapshot, slot: int) -> dict[str, float]:
    """A rank slot's cumulative counters in one snapshot; NaN for programs not loaded."""
    nan = math.nan
    o = s.offcpu.ranks.get(slot, OffCpu()) if s.offcpu else None
    r = s.reclaim.ranks.get(slot, Reclaim()) if s.reclaim else None
    return {
        "offcpu_runnable_s": o.runnable_ns * 1e-9 if o else nan,
        "offcpu_blocked_s": o.blocked_ns * 1e-9 if o else nan,
        "offcpu_io_s": o.io_ns * 1e-9 if o else nan,
        "reclaim_s": r.ns * 1e-9 if r else nan,
        "faults": float(s.faults.ranks.get(slot, 0)) if s.faults else nan,
        "tcp_retransmits": float(s.tcp.ranks.get(slot, 0)) if s.tcp else nan,
    }


def rank_delta(prev: KernelSnapshot | None, cur: KernelSnapshot, slot: int) -> RankKernelStats:
    """One rank slot's change from ``prev`` (None: from zero) to ``cur``; a counter that went
    backwards was reset, so its whole current value counts."""
    nan = math.nan
    c = _counters(cur, slot)
    p = _counters(prev, slot) if prev is not None else dict.fromkeys(c, 0.0)
    d = {k: (c[k] - p[k] if c[k] >= p[k] else c[k]) for k in c}
    runq: Log2Hist | None = None
    if cur.runq is not None:
        before = prev.runq.ranks.get(slot, Log2Hist()) if prev is not None and prev.runq else Log2Hist()
        runq = cur.runq.ranks.get(slot, Log2Hist()).since(before)
    return RankKernelStats(
        interval_s=cur.taken_at - prev.taken_at if prev is not None else nan,
        runq_p50_s=log2_quantile(runq.slots, 0.5) if runq else nan,
        runq_p99_s=log2_quantile(runq.slots, 0.99) if runq else nan,
        runq_total_s=runq.sum_s if runq else nan,
        runq_count=runq.count if runq else 0,
        **d,
    )
