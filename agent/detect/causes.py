"""Why is a rank slow? Attribution of a straggler to a cause from collector evidence.

Pure: evidence per rank comes in as per-step seconds (or flags) from evidence.py; the straggler's
figures are compared with the median of its peers, because what matters is what this rank suffers
*more* than the others (on a busy node every rank waits for a CPU a little).

Run delay is compared as a rate: on a busy node a rank that computes longer (a slow kernel, more
samples) also waits longer for a CPU in proportion, and that is a consequence, not contention. The
excess is the rank's run delay minus its compute time times the peers' median delay per second of
compute; a core shared with a hog or a throttled cgroup raises the rate itself.

A quantity explains the slowdown when its excess over the peers covers at least
``cause_min_frac`` of the rank's extra time per step (compute plus run delay). Order of precedence:
GPU errors (a failing device explains anything), CPU quota throttling (a throttled cgroup's tasks
also wait on the run queue, so quota is checked before plain contention), GPU throttling or a clock
drop, then the largest of CPU contention, memory reclaim and I/O waits; "unknown" otherwise.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

CAUSES = ("gpu_error", "cpu_quota", "gpu_throttle", "cpu_contention", "memory_reclaim", "io_wait", "unknown")


@dataclass(frozen=True)
class Evidence:
    """What the collectors saw of one rank, per training step over the recent ticks (NaN: unknown)."""

    run_delay_s: float = math.nan
    """Time the rank waited for a CPU (eBPF run-queue latency, or schedstat run delay)."""
    run_delay_source: str = ""
    throttled_s: float = math.nan
    """CPU-quota throttled time of the rank's cgroup (cgroup cpu.stat)."""
    io_wait_s: float = math.nan
    """Off-CPU time in uninterruptible sleep (disk I/O, page-in) from eBPF. Not every sleep: the
    fast ranks of a job sleep in each collective waiting for the slow one, and a rank's idle helper
    threads (rank 0 serves the TCPStore) sleep all the time; counted, those made a healthy rank 0
    an "io_wait" straggler in CI."""
    reclaim_s: float = math.nan
    """Direct / cgroup memory reclaim time from eBPF."""
    gpu_slowdown: tuple[str, ...] = ()
    """Active GPU slowdown reasons (power, thermal, hardware) from NVML."""
    gpu_clock_ratio: float = math.nan
    """Current / max SM clock of the rank's GPU."""
    gpu_errors: int = 0
    """New XID / ECC errors on the rank's GPU since the last look (or 1 when the GPU was lost)."""
    cpu_s: float = math.nan
    """The rank's own compute per step (what it ran, without waiting), to scale peers' run delay."""
    extra: dict[str, Any] = field(default_factory=dict)


_WIRE_FLOATS = ("run_delay_s", "throttled_s", "io_wait_s", "reclaim_s", "gpu_clock_ratio", "cpu_s")


def evidence_to_wire(ev: Evidence) -> dict[str, Any]:
    """JSON-safe fields of ``ev`` (NaN as null) for the node that judges a rank hosted here."""
    out: dict[str, Any] = {k: (None if math.isnan(v) else v) for k in _WIRE_FLOATS if (v := getattr(ev, k)) is not None}
    out.update(run_delay_source=ev.run_delay_source, gpu_slowdown=list(ev.gpu_slowdown), gpu_errors=ev.gpu_errors)
    return out


def evidence_from_wire(fields: Any) -> Evidence:
    """The inverse of evidence_to_wire; ValueError/TypeError on a malformed entry."""
    if not isinstance(fields, dict):
        raise TypeError("evidence must be an object")
    floats: dict[str, Any] = {k: math.nan if fields.get(k) is None else float(fields[k]) for k in _WIRE_FLOATS}
    slowdown = fields.get("gpu_slowdown") or []
    if not isinstance(slowdown, list):
        raise TypeError("gpu_slowdown must be a list")
    return Evidence(run_delay_source=str(fields.get("run_delay_source", ""))[:32],
                    gpu_slowdown=tuple(str(x)[:64] for x in slowdown[:16]),
                    gpu_errors=max(0, int(fields.get("gpu_errors", 0))), **floats)


@dataclass(frozen=True)
class Attribution:
    cause: str
    explained_frac: float
    """Share of the rank's extra time per step the chosen evidence covers (NaN for flag causes)."""
    details: dict[str, Any]


def _peer_median(values: Sequence[float]) -> float:
    vals = sorted(v for v in values if not math.isnan(v))
    if not vals:
        return math.nan
    mid = len(vals) // 2
    return vals[mid] if len(vals) % 2 else (vals[mid - 1] + vals[mid]) / 2


def _excess(rank_value: float, peers: Sequence[float]) -> float:
    if math.isnan(rank_value):
        return math.nan
    base = _peer_median(peers)
    return rank_value - (0.0 if math.isnan(base) else base)


def _delay_excess(rank: Evidence, peers: Sequence[Evidence]) -> float:
    rates = [p.run_delay_s / p.cpu_s for p in peers
             if not math.isnan(p.run_delay_s) and not math.isnan(p.cpu_s) and p.cpu_s > 0]
    if math.isnan(rank.run_delay_s) or math.isnan(rank.cpu_s) or not rates:
        return _excess(rank.run_delay_s, [p.run_delay_s for p in peers])
    return rank.run_delay_s - rank.cpu_s * _peer_median(rates)


def attribute(rank: Evidence, peers: Sequence[Evidence], extra_s: float, *, min_frac: float = 0.5,
              clock_drop: float = 0.85) -> Attribution:
    """The cause of a straggler whose compute takes ``extra_s`` more per step than the fastest peer."""
    extra_s = max(extra_s, 1e-9)
    amounts = {
        "cpu_quota": _excess(rank.throttled_s, [p.throttled_s for p in peers]),
        "cpu_contention": _delay_excess(rank, peers),
        "memory_reclaim": _excess(rank.reclaim_s, [p.reclaim_s for p in peers]),
        "io_wait": _excess(rank.io_wait_s, [p.io_wait_s for p in peers]),
    }
    details: dict[str, Any] = {"extra_s_per_step": round(extra_s, 6)}
    for name, value in amounts.items():
        if not math.isnan(value):
            details[f"{name}_s_per_step"] = round(value, 6)
    if rank.run_delay_source:
        details["run_delay_source"] = rank.run_delay_source
    if rank.gpu_errors > 0:
        details["gpu_errors"] = rank.gpu_errors
        return Attribution("gpu_error", math.nan, details)
    quota = amounts["cpu_quota"]
    if not math.isnan(quota) and quota >= min_frac * extra_s:
        return Attribution("cpu_quota", quota / extra_s, details)
    peer_clock = _peer_median([p.gpu_clock_ratio for p in peers])
    clock_low = (not math.isnan(rank.gpu_clock_ratio) and not math.isnan(peer_clock)
                 and rank.gpu_clock_ratio < clock_drop * peer_clock)
    peer_slowdowns = [p for p in peers if p.gpu_slowdown]
    if (rank.gpu_slowdown and len(peer_slowdowns) * 2 < max(1, len(peers))) or clock_low:
        details["gpu_slowdown"] = list(rank.gpu_slowdown)
        details["gpu_clock_ratio"] = rank.gpu_clock_ratio
        details["peer_gpu_clock_ratio"] = peer_clock
        return Attribution("gpu_throttle", math.nan, details)
    best, best_value = "unknown", 0.0
    for name in ("cpu_contention", "memory_reclaim", "io_wait"):
        value = amounts[name]
        if not math.isnan(value) and value > best_value:
            best, best_value = name, value
    if best != "unknown" and best_value >= min_frac * extra_s:
        return Attribution(best, best_value / extra_s, details)
    return Attribution("unknown", math.nan, details)
