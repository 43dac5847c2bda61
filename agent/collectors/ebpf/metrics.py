"""Prometheus families from one kernel snapshot (built fresh at every scrape, nothing to clean up).

Series of one family share one label set; node-wide series carry ``scope="node"`` and empty
``job``/``rank``, per-rank series ``scope="rank"``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.metrics_core import Metric

from ..base import TrackedProcess
from .hist import Log2Hist, log2_buckets
from .programs.events import CountSnapshot
from .programs.io import BlockIoSnapshot
from .programs.mem import FaultSnapshot, ReclaimSnapshot
from .programs.net import TcpSnapshot
from .programs.sched import OffCpuSnapshot, RunqSnapshot

SCOPED = ("scope", "job", "rank")

# (name, type, unit, labels, help) of everything this collector exports.
METRICS: tuple[tuple[str, str, str, tuple[str, ...], str], ...] = (
    ("trainguard_runqueue_latency_seconds", "histogram", "seconds", SCOPED,
     "Time tasks waited runnable for a CPU (wakeup or preemption to switch-in), node-wide and per rank."),
    ("trainguard_offcpu_seconds_total", "counter", "seconds", ("job", "rank", "kind"),
     "Time rank threads spent off CPU; kind=runnable (preempted, wanted the CPU) or blocked (slept); "
     "kind=io is the part of blocked in uninterruptible sleep (disk I/O, page-in)."),
    ("trainguard_block_io_latency_seconds", "histogram", "seconds", ("device",),
     "Block I/O request latency, issue to completion, per device."),
    ("trainguard_tcp_retransmits_total", "counter", "", SCOPED,
     "TCP segments retransmitted, node-wide and per rank where the socket's owner is known."),
    ("trainguard_page_faults_total", "counter", "", SCOPED, "User-mode page faults."),
    ("trainguard_direct_reclaim_seconds_total", "counter", "seconds", SCOPED,
     "Time stalled reclaiming memory inside allocations: direct reclaim and memory-cgroup limit reclaim."),
    ("trainguard_process_exits_total", "counter", "", SCOPED,
     "Process (thread group) exits: every one on the node, and those of tracked ranks."),
    ("trainguard_oom_kills_total", "counter", "", SCOPED, "OOM-killer victims, node-wide and tracked ranks."),
    ("trainguard_ebpf_program_up", "gauge", "", ("program",),
     "1 if the eBPF program is loaded and attached, 0 if it was skipped (see the agent log for why)."),
    ("trainguard_ebpf_events_dropped_total", "counter", "", (),
     "Exit/OOM events lost because the ring buffer was full."),
    ("trainguard_ebpf_program_runs_total", "counter", "", ("function",),
     "Times each BPF function ran (counted by the kernel only while kernel.bpf_stats_enabled=1)."),
    ("trainguard_ebpf_program_run_seconds_total", "counter", "seconds", ("function",),
     "Kernel CPU time each BPF function used, the collector's in-kernel cost (kernel.bpf_stats_enabled=1)."),
)
_HELP = {m[0]: m[4] for m in METRICS}


@dataclass(frozen=True)
class KernelSnapshot:
    """Every loaded program's maps, read once; ``owners`` maps rank slot -> pid at read time."""

    taken_at: float
    owners: Mapping[int, int] = field(default_factory=dict)
    runq: RunqSnapshot | None = None
    offcpu: OffCpuSnapshot | None = None
    blockio: BlockIoSnapshot | None = None
    tcp: TcpSnapshot | None = None
    faults: FaultSnapshot | None = None
    reclaim: ReclaimSnapshot | None = None
    exits: CountSnapshot | None = None
    ooms: CountSnapshot | None = None
    events_dropped: int = 0
    # function -> (runs, run time ns), when the kernel counts them (kernel.bpf_stats_enabled)
    prog_runs: Mapping[str, tuple[int, int]] = field(default_factory=dict)


def _node() -> list[str]:
    return ["node", "", ""]


def _rank(p: TrackedProcess) -> list[str]:
    return ["rank", p.job, str(p.rank)]


def _hist(fam: HistogramMetricFamily, labels: list[str], h: Log2Hist) -> None:
    fam.add_metric(labels, log2_buckets(h.slots), h.sum_s)


def _scoped_counter(name: str, node: float, ranks: Mapping[int, float],
                    procs: Mapping[int, TrackedProcess]) -> CounterMetricFamily:
    fam = CounterMetricFamily(name, _HELP[name], labels=list(SCOPED))
    fam.add_metric(_node(), node)
    for slot, v in ranks.items():
        if slot in procs:
            fam.add_metric(_rank(procs[slot]), v)
    return fam


def families(snap: KernelSnapshot, procs: Mapping[int, TrackedProcess],
             device_name: Callable[[int], str], program_up: Mapping[str, bool]) -> Iterator[Metric]:
    """``procs``: the rank slots to export (currently tracked) and their processes."""
    if snap.runq is not None:
        fam = HistogramMetricFamily("trainguard_runqueue_latency_seconds",
                                    _HELP["trainguard_runqueue_latency_seconds"], labels=list(SCOPED))
        _hist(fam, _node(), snap.runq.node)
        for slot, h in snap.runq.ranks.items():
            if slot in procs:
                _hist(fam, _rank(procs[slot]), h)
        yield fam
    if snap.offcpu is not None:
        c = CounterMetricFamily("trainguard_offcpu_seconds_total", _HELP["trainguard_offcpu_seconds_total"],
                                labels=["job", "rank", "kind"])
        for slot, o in snap.offcpu.ranks.items():
            if slot in procs:
                p = procs[slot]
                c.add_metric([p.job, str(p.rank), "runnable"], o.runnable_ns * 1e-9)
                c.add_metric([p.job, str(p.rank), "blocked"], o.blocked_ns * 1e-9)
                c.add_metric([p.job, str(p.rank), "io"], o.io_ns * 1e-9)
        yield c
    if snap.blockio is not None:
        fam = HistogramMetricFamily("trainguard_block_io_latency_seconds",
                                    _HELP["trainguard_block_io_latency_seconds"], labels=["device"])
        for dev, h in sorted(snap.blockio.devices.items()):
            _hist(fam, [device_name(dev)], h)
        yield fam
    if snap.tcp is not None:
        yield _scoped_counter("trainguard_tcp_retransmits_total", snap.tcp.node, snap.tcp.ranks, procs)
    if snap.faults is not None:
        yield _scoped_counter("trainguard_page_faults_total", snap.faults.node, snap.faults.ranks, procs)
    if snap.reclaim is not None:
        yield _scoped_counter("trainguard_direct_reclaim_seconds_total", snap.reclaim.node.ns * 1e-9,
                              {s: r.ns * 1e-9 for s, r in snap.reclaim.ranks.items()}, procs)
    if snap.exits is not None:
        yield _scoped_counter("trainguard_process_exits_total", snap.exits.node, snap.exits.ranks, procs)
    if snap.ooms is not None:
        yield _scoped_counter("trainguard_oom_kills_total", snap.ooms.node, snap.ooms.ranks, procs)
    up = GaugeMetricFamily("trainguard_ebpf_program_up", _HELP["trainguard_ebpf_program_up"], labels=["program"])
    for name, ok in sorted(program_up.items()):
        up.add_metric([name], 1.0 if ok else 0.0)
    yield up
    dropped = CounterMetricFamily("trainguard_ebpf_events_dropped_total",
                                  _HELP["trainguard_ebpf_events_dropped_total"])
    dropped.add_metric([], snap.events_dropped)
    yield dropped
    if snap.prog_runs:
        runs = CounterMetricFamily("trainguard_ebpf_program_runs_total",
                                   _HELP["trainguard_ebpf_program_runs_total"], labels=["function"])
        secs = CounterMetricFamily("trainguard_ebpf_program_run_seconds_total",
                                   _HELP["trainguard_ebpf_program_run_seconds_total"], labels=["function"])
        for fn, (n, ns) in sorted(snap.prog_runs.items()):
            runs.add_metric([fn], n)
            secs.add_metric([fn], ns * 1e-9)
        yield runs
        yield secs


def metric_names() -> list[str]:
    return [m[0] for m in METRICS]


