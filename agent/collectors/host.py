"""Host collector: CPU, memory and reclaim, pressure, disks, network, and the rank processes,
read from a /proc tree once per interval.

The /proc root is passed in so tests point it at a fake tree. Each file is read on its own: an
OSError (or a file that does not parse) leaves out the metrics from that file and nothing else.
Those are exactly the figures straggler causes are attributed from: run-queue pressure
(procs_running, PSI cpu), reclaim (pgscan/allocstall, PSI memory), I/O waits (io_time, PSI io).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from prometheus_client.metrics_core import Metric

from trainguard.agent.collectors.base import CollectorUnavailable, TrackedProcess
from trainguard.agent.metricspec import MetricSpec, index

_PROC = ("job", "rank")
HOST_METRICS: tuple[MetricSpec, ...] = (
    MetricSpec("trainguard_host_cpu_seconds_total", "counter", "seconds", ("mode",),
               "CPU time of all CPUs together, by mode (from /proc/stat)."),
    MetricSpec("trainguard_host_cpus", "gauge", "", (), "Online CPUs counted in /proc/stat."),
    MetricSpec("trainguard_host_load1", "gauge", "", (), "1-minute load average."),
    MetricSpec("trainguard_host_load5", "gauge", "", (), "5-minute load average."),
    MetricSpec("trainguard_host_load15", "gauge", "", (), "15-minute load average."),
    MetricSpec("trainguard_host_procs_running", "gauge", "", (), "Runnable tasks now (run-queue length)."),
    MetricSpec("trainguard_host_procs_blocked", "gauge", "", (), "Tasks blocked on I/O now."),
    MetricSpec("trainguard_host_memory_total_bytes", "gauge", "bytes", (), "MemTotal from /proc/meminfo."),
    MetricSpec("trainguard_host_memory_available_bytes", "gauge", "bytes", (),
               "MemAvailable from /proc/meminfo: memory usable without swapping."),
    MetricSpec("trainguard_host_memory_dirty_bytes", "gauge", "bytes", (), "Dirty page cache waiting for writeback."),
    MetricSpec("trainguard_host_swap_used_bytes", "gauge", "bytes", (), "SwapTotal - SwapFree."),
    MetricSpec("trainguard_host_vmstat_total", "counter", "", ("field",),
               "Reclaim-related /proc/vmstat counters: pgscan_kswapd, pgscan_direct, pgsteal_kswapd, "
               "pgsteal_direct, allocstall (all zones), pgmajfault, oom_kill, pswpin, pswpout, "
               "compact_stall, workingset_refault."),
    MetricSpec("trainguard_host_pressure_stalled_seconds_total", "counter", "seconds", ("resource", "kind"),
               "Pressure stall time from /proc/pressure/{cpu,memory,io} (kind some or full)."),
    MetricSpec("trainguard_host_disk_read_bytes_total", "counter", "bytes", ("device",), "Bytes read."),
    MetricSpec("trainguard_host_disk_written_bytes_total", "counter", "bytes", ("device",), "Bytes written."),
    MetricSpec("trainguard_host_disk_reads_completed_total", "counter", "", ("device",), "Reads completed."),
    MetricSpec("trainguard_host_disk_writes_completed_total", "counter", "", ("device",), "Writes completed."),
    MetricSpec("trainguard_host_disk_io_time_seconds_total", "counter", "seconds", ("device",),
               "Time the device had I/O in flight."),
    MetricSpec("trainguard_host_disk_io_time_weighted_seconds_total", "counter", "seconds", ("device",),
               "I/O time weighted by the number of requests in flight."),
    MetricSpec("trainguard_host_network_receive_bytes_total", "counter", "bytes", ("device",), "Bytes received."),
    MetricSpec("trainguard_host_network_transmit_bytes_total", "counter", "bytes", ("device",), "Bytes sent."),
    MetricSpec("trainguard_host_network_receive_packets_total", "counter", "", ("device",), "Packets received."),
    MetricSpec("trainguard_host_network_transmit_packets_total", "counter", "", ("device",), "Packets sent."),
    MetricSpec("trainguard_host_network_receive_errors_total", "counter", "", ("device",), "Receive errors."),
    MetricSpec("trainguard_host_network_transmit_errors_total", "counter", "", ("device",), "Transmit errors."),
    MetricSpec("trainguard_host_network_receive_drop_total", "counter", "", ("device",), "Received packets dropped."),
    MetricSpec("trainguard_host_network_transmit_drop_total", "counter", "", ("device",), "Sent packets dropped."),
    MetricSpec("trainguard_process_cpu_seconds_total", "counter", "seconds", (*_PROC, "mode"),
               "CPU time of a tracked rank process, by mode (user, system)."),
    MetricSpec("trainguard_process_resident_memory_bytes", "gauge", "bytes", _PROC, "Resident set size (VmRSS)."),
    MetricSpec("trainguard_process_context_switches_total", "counter", "", (*_PROC, "kind"),
               "Context switches of a rank process: voluntary (it waited) or involuntary (preempted)."),
    MetricSpec("trainguard_process_major_faults_total", "counter", "", _PROC, "Page faults that needed I/O."),
    MetricSpec("trainguard_process_threads", "gauge", "", _PROC, "Threads in the rank process."),
    MetricSpec("trainguard_process_state", "gauge", "", (*_PROC, "state"),
               "1 for the process's current scheduler state (R, S, D, T, Z, I, other), 0 for the others."),
)
_SPEC = index(HOST_METRICS)

_CPU_MODES = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
_VMSTAT_EXACT = ("pgscan_kswapd", "pgscan_direct", "pgsteal_kswapd", "pgsteal_direct", "pgmajfault",
                 "oom_kill", "pswpin", "pswpout", "compact_stall")
# Summed over zones / page types, which vary by kernel.
_VMSTAT_PREFIX = ("allocstall", "workingset_refault")
_STATES = ("R", "S", "D", "T", "Z", "I", "other")
_STATE_MAP = {"R": "R", "S": "S", "D": "D", "T": "T", "t": "T", "Z": "Z", "X": "Z", "x": "Z", "I": "I"}
# Partitions and memory/loop devices would count the same I/O twice or not at all.
DEFAULT_DISK_EXCLUDE = r"^(loop|ram|zram|fd|sr)\d+$|^([shv]|xv)d[a-z]+\d+$|^(nvme\d+n\d+|mmcblk\d+)p\d+$"
_SECTOR = 512


@dataclass(frozen=True)
class ProcessSample:
    job: str
    rank: int
    state: str
    utime_s: float
    stime_s: float
    majflt: int
    threads: int | None = None
    rss_bytes: int | None = None
    voluntary_ctxt: int | None = None
    involuntary_ctxt: int | None = None


@dataclass(frozen=True)
class HostSnapshot:
    """One read of /proc. A section is None when its file could not be read."""

    at: float = 0.0
    cpu_seconds: Mapping[str, float] | None = None
    cpus: int | None = None
    procs_running: int | None = None
    procs_blocked: int | None = None
    load: tuple[float, float, float] | None = None
    meminfo: Mapping[str, int] | None = None  # bytes, by /proc/meminfo key
    vmstat: Mapping[str, int] | None = None
    pressure: Mapping[tuple[str, str], float] | None = None  # (resource, kind) -> seconds
    disks: Mapping[str, tuple[int, ...]] | None = None  # device -> diskstats fields 1..
    nets: Mapping[str, tuple[int, ...]] | None = None  # device -> /proc/net/dev counters
    processes: Mapping[int, ProcessSample] = field(default_factory=lambda: MappingProxyType({}))


def _read(path: str) -> str:
    with open(path) as fh:
        return fh.read()


class HostCollector:
    """Collector protocol (agent/collectors/base.py) over a /proc tree."""

    name = "host"

    def __init__(self, proc_root: str = "/proc", clock_ticks: int | None = None,
                 disk_exclude: str = DEFAULT_DISK_EXCLUDE) -> None:
        self.proc_root = proc_root
        self.clock_ticks = clock_ticks or os.sysconf("SC_CLK_TCK")
        self._disk_exclude = re.compile(disk_exclude)
        self._tracked: Mapping[int, TrackedProcess] = MappingProxyType({})
        # Replaced whole by poll(), read by scrapes on other threads: no lock needed.
        self.snapshot = HostSnapshot()

    def start(self) -> None:
        try:
            _read(os.path.join(self.proc_root, "stat"))
        except OSError as exc:
            raise CollectorUnavailable(f"cannot read {self.proc_root}/stat: {exc}") from exc

    def stop(self) -> None:
        pass

    def track(self, processes: Mapping[int, TrackedProcess]) -> None:
        self._tracked = MappingProxyType(dict(processes))

    def poll(self, now: float) -> None:
        snap: dict[str, object] = {"at": now}
        for reader in (self._stat, self._loadavg, self._meminfo, self._vmstat, self._pressure,
                       self._diskstats, self._netdev):
            try:
                snap.update(reader())
            except (OSError, ValueError, IndexError):
                continue  # that file's metrics stay out of this snapshot
        procs: dict[int, ProcessSample] = {}
        for pid, proc in self._tracked.items():
            sample = self._process(pid, proc)
            if sample is not None:
                procs[pid] = sample
        snap["processes"] = MappingProxyType(procs)
        self.snapshot = HostSnapshot(**snap)  # type: ignore[arg-type]

    # -- readers: each returns HostSnapshot fields --------------------------------------------

    def _path(self, *parts: str) -> str:
        return os.path.join(self.proc_root, *parts)

    def _stat(self) -> dict[str, object]:
        out: dict[str, object] = {}
        cpus = 0
        for line in _read(self._path("stat")).splitlines():
            key, _, rest = line.partition(" ")
            if key == "cpu":
                values = rest.split()
                out["cpu_seconds"] = MappingProxyType(
                    {mode: int(v) / self.clock_ticks for mode, v in zip(_CPU_MODES, values, strict=False)})
            elif key.startswith("cpu") and key[3:].isdigit():
                cpus += 1
            elif key == "procs_running":
                out["procs_running"] = int(rest)
            elif key == "procs_blocked":
                out["procs_blocked"] = int(rest)
        if cpus:
            out["cpus"] = cpus
        return out

    def _loadavg(self) -> dict[str, object]:
        fields = _read(self._path("loadavg")).split()
        return {"load": (float(fields[0]), float(fields[1]), float(fields[2]))}

    def _meminfo(self) -> dict[str, object]:
        mem: dict[str, int] = {}
        for line in _read(self._path("meminfo")).splitlines():
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts:
                mem[key] = int(parts[0]) * (1024 if len(parts) > 1 and parts[1] == "kB" else 1)
        return {"meminfo": MappingProxyType(mem)}

    def _vmstat(self) -> dict[str, object]:
        out: dict[str, int] = {}
        for line in _read(self._path("vmstat")).splitlines():
            key, _, value = line.partition(" ")
            if key in _VMSTAT_EXACT:
                out[key] = int(value)
            else:
                for prefix in _VMSTAT_PREFIX:
                    if key.startswith(prefix):
                        out[prefix] = out.get(prefix, 0) + int(value)
        return {"vmstat": MappingProxyType(out)}

    def _pressure(self) -> dict[str, object]:
        out: dict[tuple[str, str], float] = {}
        for resource in ("cpu", "memory", "io"):
            try:
                text = _read(self._path("pressure", resource))
            except OSError:
                continue  # no PSI on this kernel, or this resource only
            for line in text.splitlines():
                kind, *pairs = line.split()
                for pair in pairs:
                    if pair.startswith("total="):
                        out[(resource, kind)] = int(pair[6:]) / 1e6  # microseconds
        return {"pressure": MappingProxyType(out)} if out else {}

    def _diskstats(self) -> dict[str, object]:
        disks: dict[str, tuple[int, ...]] = {}
        for line in _read(self._path("diskstats")).splitlines():
            parts = line.split()
            if len(parts) < 14 or self._disk_exclude.match(parts[2]):
                continue
            disks[parts[2]] = tuple(int(v) for v in parts[3:14])
        return {"disks": MappingProxyType(disks)}

    def _netdev(self) -> dict[str, object]:
        nets: dict[str, tuple[int, ...]] = {}
        for line in _read(self._path("net", "dev")).splitlines()[2:]:
            name, sep, rest = line.partition(":")
            values = rest.split()
            if sep and len(values) >= 16:
                nets[name.strip()] = tuple(int(v) for v in values[:16])
        return {"nets": MappingProxyType(nets)}

    def _process(self, pid: int, proc: TrackedProcess) -> ProcessSample | None:
        try:
            raw = _read(self._path(str(pid), "stat"))
            # comm may hold spaces and parentheses: the fields start after the last ')'.
            rest = raw[raw.rindex(")") + 2 :].split()
            state = _STATE_MAP.get(rest[0], "other")
            utime, stime = int(rest[11]) / self.clock_ticks, int(rest[12]) / self.clock_ticks
            majflt = int(rest[9])
        except (OSError, ValueError, IndexError):
            return None  # gone, or not readable: no metrics for it this interval
        status: dict[str, int] = {}
        try:
            for line in _read(self._path(str(pid), "status")).splitlines():
                key, _, value = line.partition(":")
                if key in ("VmRSS", "Threads", "voluntary_ctxt_switches", "nonvoluntary_ctxt_switches"):
                    status[key] = int(value.split()[0])
        except (OSError, ValueError, IndexError):
            status = {}
        rss = status.get("VmRSS")
        return ProcessSample(
            job=proc.job, rank=proc.rank, state=state, utime_s=utime, stime_s=stime, majflt=majflt,
            threads=status.get("Threads"), rss_bytes=rss * 1024 if rss is not None else None,
            voluntary_ctxt=status.get("voluntary_ctxt_switches"),
            involuntary_ctxt=status.get("nonvoluntary_ctxt_switches"),
        )

    # -- metrics ------------------------------------------------------------------------------

    def metrics(self) -> Iterator[Metric]:
        s = self.snapshot
        if s.cpu_seconds is not None:
            fam = _SPEC["trainguard_host_cpu_seconds_total"].counter()
            for mode, v in s.cpu_seconds.items():
                fam.add_metric([mode], v)
            yield fam
        for name, value in (("trainguard_host_cpus", s.cpus),
                            ("trainguard_host_procs_running", s.procs_running),
                            ("trainguard_host_procs_blocked", s.procs_blocked)):
            if value is not None:
                yield _gauge(name, value)
        if s.load is not None:
            for name, load in zip(("trainguard_host_load1", "trainguard_host_load5", "trainguard_host_load15"),
                                  s.load, strict=True):
                yield _gauge(name, load)
        if s.meminfo is not None:
            mem = s.meminfo
            for name, key in (("trainguard_host_memory_total_bytes", "MemTotal"),
                              ("trainguard_host_memory_available_bytes", "MemAvailable"),
                              ("trainguard_host_memory_dirty_bytes", "Dirty")):
                if key in mem:
                    yield _gauge(name, mem[key])
            if "SwapTotal" in mem and "SwapFree" in mem:
                yield _gauge("trainguard_host_swap_used_bytes", mem["SwapTotal"] - mem["SwapFree"])
        if s.vmstat is not None:
            fam = _SPEC["trainguard_host_vmstat_total"].counter()
            for key, v in sorted(s.vmstat.items()):
                fam.add_metric([key], v)
            yield fam
        if s.pressure is not None:
            fam = _SPEC["trainguard_host_pressure_stalled_seconds_total"].counter()
            for (resource, kind), v in sorted(s.pressure.items()):
                fam.add_metric([resource, kind], v)
            yield fam
        if s.disks is not None:
            yield from _per_device(s.disks, (
                ("trainguard_host_disk_reads_completed_total", lambda f: f[0]),
                ("trainguard_host_disk_read_bytes_total", lambda f: f[2] * _SECTOR),
                ("trainguard_host_disk_writes_completed_total", lambda f: f[4]),
                ("trainguard_host_disk_written_bytes_total", lambda f: f[6] * _SECTOR),
                ("trainguard_host_disk_io_time_seconds_total", lambda f: f[9] / 1000),
                ("trainguard_host_disk_io_time_weighted_seconds_total", lambda f: f[10] / 1000),
            ))
        if s.nets is not None:
            yield from _per_device(s.nets, (
                ("trainguard_host_network_receive_bytes_total", lambda f: f[0]),
                ("trainguard_host_network_receive_packets_total", lambda f: f[1]),
                ("trainguard_host_network_receive_errors_total", lambda f: f[2]),
                ("trainguard_host_network_receive_drop_total", lambda f: f[3]),
                ("trainguard_host_network_transmit_bytes_total", lambda f: f[8]),
                ("trainguard_host_network_transmit_packets_total", lambda f: f[9]),
                ("trainguard_host_network_transmit_errors_total", lambda f: f[10]),
                ("trainguard_host_network_transmit_drop_total", lambda f: f[11]),
            ))
        yield from self._process_metrics(s.processes)

    def _process_metrics(self, processes: Mapping[int, ProcessSample]) -> Iterator[Metric]:
        cpu = _SPEC["trainguard_process_cpu_seconds_total"].counter()
        rss = _SPEC["trainguard_process_resident_memory_bytes"].gauge()
        ctx = _SPEC["trainguard_process_context_switches_total"].counter()
        majflt = _SPEC["trainguard_process_major_faults_total"].counter()
        threads = _SPEC["trainguard_process_threads"].gauge()
        state = _SPEC["trainguard_process_state"].gauge()
        for p in processes.values():
            labels = [p.job, str(p.rank)]
            cpu.add_metric([*labels, "user"], p.utime_s)
            cpu.add_metric([*labels, "system"], p.stime_s)
            majflt.add_metric(labels, p.majflt)
            for st in _STATES:
                state.add_metric([*labels, st], 1 if st == p.state else 0)
            if p.rss_bytes is not None:
                rss.add_metric(labels, p.rss_bytes)
            if p.threads is not None:
                threads.add_metric(labels, p.threads)
            if p.voluntary_ctxt is not None:
                ctx.add_metric([*labels, "voluntary"], p.voluntary_ctxt)
            if p.involuntary_ctxt is not None:
                ctx.add_metric([*labels, "involuntary"], p.involuntary_ctxt)
        yield from (cpu, rss, ctx, majflt, threads, state)


def _gauge(name: str, value: float) -> Metric:
    fam = _SPEC[name].gauge()
    fam.add_metric([], value)
    return fam


def _per_device(devices: Mapping[str, tuple[int, ...]], columns: tuple) -> Iterator[Metric]:
    for name, pick in columns:
        spec = _SPEC[name]
        fam = spec.counter() if spec.type == "counter" else spec.gauge()
        for device, values in sorted(devices.items()):
            fam.add_metric([device], pick(values))
        yield fam
