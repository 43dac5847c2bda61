"""EbpfCollector: the facade the agent runs (Collector protocol in agent/collectors/base.py).

start() checks privileges, bcc, kernel headers and tracefs, probes every program, compiles the
ones that can run into one BPF object and attaches them; anything missing is a one-line
CollectorUnavailable (the agent then exports trainguard_collector_up{collector="ebpf"} 0), and a
single program that cannot load is skipped with its reason. poll() reads every program's maps once;
a dedicated thread polls the ring buffer every ~10 ms and emits "rank_exit" / "oom_kill" events
as they happen (so ``emit`` is called from that thread too).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, TextIO

from prometheus_client.metrics_core import Metric

from trainguard.agent import health

from ..base import CollectorUnavailable, EmitFn, TrackedProcess
from . import bpfstats, btf
from .loader import AttachError, BccLoader, CompileError, LoadedModule
from .metrics import KernelSnapshot, families
from .probes import headers_problem, privilege_problem
from .programs import (
    ALL_PROGRAMS,
    MAX_TRACKED,
    PRELUDE,
    BlockIoLatency,
    DirectReclaim,
    OffCpuTime,
    OomKills,
    PageFaults,
    ProbeEnv,
    ProcessExits,
    Program,
    RunqLatency,
    TcpRetransmits,
)
from .programs.events import KIND_EXIT, KIND_OOM, decode_exit, decode_oom
from .programs.io import dev_major_minor
from .rankstats import RankKernelStats, rank_delta
from .tracefs import CANDIDATE_ROOTS, find_tracefs, mount_tracefs

log = logging.getLogger(__name__)


class EbpfCollector:
    name = "ebpf"

    def __init__(self, emit: EmitFn, interval: float = 1.0, loader: BccLoader | None = None,
                 print_bpf: bool = False, *, programs: Iterable[type[Program]] = ALL_PROGRAMS,
                 proc_root: Path = Path("/proc"), sys_root: Path = Path("/sys"),
                 tracefs_roots: tuple[Path, ...] = CANDIDATE_ROOTS, event_poll_ms: int = 200,
                 out: TextIO = sys.stdout, monotonic_ns: Callable[[], int] = time.monotonic_ns,
                 wall_clock: Callable[[], float] = time.time) -> None:
        if interval <= 0:
            raise ValueError(f"interval: must be > 0, got {interval}")
        if event_poll_ms <= 0:
            raise ValueError(f"event_poll_ms: must be > 0, got {event_poll_ms}")
        self.emit = emit
        self.interval = interval
        self.loader = loader or BccLoader()
        self.print_bpf = print_bpf
        self.program_types = tuple(programs)
        self.proc_root, self.sys_root, self.tracefs_roots = proc_root, sys_root, tracefs_roots
        self.event_poll_ms = event_poll_ms
        self.out = out
        self.monotonic_ns = monotonic_ns
        self.wall_clock = wall_clock
        self.down_reason: str | None = None
        self.skipped: dict[str, str] = {}  # program name -> why it is not running
        self.programs: list[Program] = []
        self._module: LoadedModule | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._free: deque[int] = deque(range(MAX_TRACKED))
        self._slot_of: dict[int, int] = {}  # pid -> rank slot
        self._proc_at: dict[int, TrackedProcess] = {}  # slot -> process (kept after untrack until reuse)
        self._wanted: dict[int, TrackedProcess] = {}
        self._snap: KernelSnapshot | None = None
        self._prev: KernelSnapshot | None = None
        self._devnames: dict[int, str] = {}

    # --- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        if self._module is not None:
            return
        try:
            self._start()
        except CollectorUnavailable as exc:
            self.down_reason = str(exc)
            raise
        self.down_reason = None

    def _start(self) -> None:
        self.skipped = {}
        try:
            status = (self.proc_root / "self/status").read_text()
        except OSError:
            status = ""
        reason = privilege_problem(os.geteuid(), status)
        if reason is None:
            reason = self.loader.available()
        if reason is None:
            reason = headers_problem(Path("/lib/modules") / os.uname().release)
        if reason:
            raise CollectorUnavailable(f"eBPF off: {reason}")
        tf = find_tracefs(self.tracefs_roots)
        if tf is None:
            err = mount_tracefs(self.tracefs_roots[0])
            tf = find_tracefs(self.tracefs_roots)
            if tf is None:
                raise CollectorUnavailable(f"eBPF off: tracefs not mounted ({err or 'mount had no effect'})")
            log.info("mounted tracefs at %s", tf.root)
        env = ProbeEnv(tf, btf_loader=lambda: btf.load(self.sys_root / "kernel/btf/vmlinux"))
        candidates = []
        for ptype in self.program_types:
            prog = ptype(env)
            why = prog.probe()
            if why:
                self._skip(prog.name, why)
            else:
                candidates.append(prog)
        module, loaded = self._compile(candidates)
        for prog in loaded:
            try:
                prog.attach(module)
            except AttachError as exc:
                prog.detach(module)
                self._skip(prog.name, str(exc))
            else:
                self.programs.append(prog)
        if not self.programs:
            module.close()
            raise CollectorUnavailable("eBPF off: no program could attach (" + "; ".join(
                f"{k}: {v}" for k, v in self.skipped.items()) + ")")
        self._module = module
        if any(isinstance(p, ProcessExits | OomKills) for p in self.programs):
            module.open_ring_buffer("tg_events", self._on_event)
            self._stop.clear()
            self._thread = threading.Thread(target=self._event_loop, name="ebpf-events", daemon=True)
            self._thread.start()
        if self._wanted:
            self.track(self._wanted)
        log.info("eBPF collector up: %s", ", ".join(p.name for p in self.programs))

    def _skip(self, name: str, why: str) -> None:
        self.skipped[name] = why
        log.warning("eBPF program %s skipped: %s", name, why)

    def _compile(self, progs: list[Program]) -> tuple[LoadedModule, list[Program]]:
        """One object for all; if that fails, find the culprits one by one and drop them."""
        text = render_programs(progs)
        if self.print_bpf:
            print(text, file=self.out)
        if not progs:
            raise CollectorUnavailable("eBPF off: no program available (" + "; ".join(
                f"{k}: {v}" for k, v in self.skipped.items()) + ")")
        try:
            return self.loader.compile(text), progs
        except CompileError as exc:
            first = str(exc)
        good = []
        for prog in progs:
            try:
                self.loader.compile(render_programs([prog])).close()
            except CompileError as exc:
                self._skip(prog.name, f"compile failed: {exc}")
            else:
                good.append(prog)
        if not good:
            raise CollectorUnavailable(f"eBPF off: programs failed to compile ({first})")
        try:
            return self.loader.compile(render_programs(good)), good
        except CompileError as exc:
            raise CollectorUnavailable(f"eBPF off: programs failed to compile ({exc})") from exc

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
            self._thread = None
        module, self._module = self._module, None
        if module is not None:
            for prog in self.programs:
                prog.detach(module)
            module.close()
        self.programs = []
        with self._lock:  # a later start() re-tracks self._wanted into fresh maps
            self._slot_of.clear()
            self._free = deque(range(MAX_TRACKED))

    # --- events ---------------------------------------------------------------------------------
    def _event_loop(self) -> None:
        # An event ends the wait at once; the timeout only bounds how long ``stop`` waits for this
        # thread. At 10 ms it woke the agent 100 times a second for nothing (~0.4 % of a core).
        module = self._module
        while module is not None and not self._stop.is_set():
            health.beat(self, "ebpf-events")
            try:
                module.ring_buffer_poll(self.event_poll_ms)
            except Exception as exc:  # noqa: BLE001 - one bad poll must not end exit detection for good
                health.failed(self, "ebpf-events", exc)
                self._stop.wait(0.1)
        health.stopped(self, "ebpf-events")

    def _on_event(self, data: bytes) -> None:
        kind = int.from_bytes(data[:4], "little")
        now = self.monotonic_ns()
        if kind == KIND_EXIT:
            e = decode_exit(data)
            with self._lock:
                proc = self._proc_at.get(e.slot) if e.slot is not None else None
            fields: dict[str, Any] = {"pid": e.tgid, "thread": e.pid, "comm": e.comm,
                                      "exit_code": e.exit_code, "signal": e.signal,
                                      "core_dumped": e.core_dumped, "wait_status": e.wait_status,
                                      "latency_ms": round((now - e.ktime_ns) / 1e6, 3), "source": "ebpf",
                                      "exited_at": round(self.wall_clock() - (now - e.ktime_ns) / 1e9, 6)}
            if proc is not None and proc.pid == e.tgid:
                fields.update(job=proc.job, rank=proc.rank, local_rank=proc.local_rank)
            self.emit("rank_exit", fields)
        elif kind == KIND_OOM:
            o = decode_oom(data)
            with self._lock:
                proc = self._proc_at.get(o.slot) if o.slot is not None else None
            fields = {"pid": o.pid, "comm": o.comm, "tracked": proc is not None, "uid": o.uid,
                      "total_vm_kb": o.total_vm_kb, "anon_rss_kb": o.anon_rss_kb,
                      "file_rss_kb": o.file_rss_kb, "shmem_rss_kb": o.shmem_rss_kb,
                      "oom_score_adj": o.oom_score_adj, "latency_ms": round((now - o.ktime_ns) / 1e6, 3),
                      "source": "ebpf"}
            if proc is not None:
                fields.update(job=proc.job, rank=proc.rank, local_rank=proc.local_rank)
            self.emit("oom_kill", fields)

    # --- tracked set ----------------------------------------------------------------------------
    def track(self, processes: Mapping[int, TrackedProcess]) -> None:
        self._wanted = dict(processes)
        module = self._module
        if module is None:
            return
        with self._lock:
            for pid in [p for p in self._slot_of if p not in processes]:
                slot = self._slot_of.pop(pid)
                module.hash_delete("tg_tracked", pid)
                module.hash_delete_where("tg_tid_idx", _value_is(slot))
                self._free.append(slot)  # FIFO: late exit events still find the process
            for pid, proc in processes.items():
                if pid in self._slot_of:
                    self._proc_at[self._slot_of[pid]] = proc
                    continue
                if not self._free:
                    log.warning("eBPF: more than %d tracked processes; pid %d not traced", MAX_TRACKED, pid)
                    continue
                slot = self._free.popleft()
                for prog in self.programs:
                    prog.reset_slot(module, slot)
                self._proc_at[slot] = proc
                self._slot_of[pid] = slot
                for tid in self._threads(pid):
                    module.hash_set("tg_tid_idx", tid, slot)
                module.hash_set("tg_tracked", pid, slot)

    def _threads(self, pid: int) -> list[int]:
        try:
            return [int(t) for t in os.listdir(self.proc_root / str(pid) / "task")]
        except OSError:
            return []

    # --- reading --------------------------------------------------------------------------------
    def poll(self, now: float) -> None:
        module = self._module
        if module is None:
            return
        with self._lock:
            owners = {slot: pid for pid, slot in self._slot_of.items()}
        slots = sorted(owners)
        parts: dict[str, Any] = {}
        for prog in self.programs:
            try:
                parts[prog.name] = prog.read(module, slots)
            except (OSError, KeyError) as exc:  # a map read failing leaves those metrics out
                log.debug("eBPF read %s failed: %s", prog.name, exc)
        dropped = sum(int(v) for v in module.percpu_get("tg_event_drops", 0))
        runs = {}
        for fn, fd in module.prog_fds().items():
            try:
                runs[fn] = bpfstats.fd_stats(fd)
            except OSError:
                pass
        if not any(n for n, _ in runs.values()):
            runs = {}  # stats off: export nothing rather than zeros that look like idle programs
        snap = KernelSnapshot(
            taken_at=now, owners=owners, runq=parts.get(RunqLatency.name), offcpu=parts.get(OffCpuTime.name),
            blockio=parts.get(BlockIoLatency.name), tcp=parts.get(TcpRetransmits.name),
            faults=parts.get(PageFaults.name), reclaim=parts.get(DirectReclaim.name),
            exits=parts.get(ProcessExits.name), ooms=parts.get(OomKills.name), events_dropped=dropped,
            prog_runs=runs)
        self._prev, self._snap = self._snap, snap

    @property
    def snapshot(self) -> KernelSnapshot | None:
        """The latest read (cumulative since attach)."""
        return self._snap

    def metrics(self) -> Iterable[Metric]:
        snap = self._snap
        if snap is None:
            return []
        with self._lock:
            procs = {slot: self._proc_at[slot] for slot in snap.owners if slot in self._proc_at}
        up = {p.name: True for p in self.programs} | {name: False for name in self.skipped}
        return list(families(snap, procs, self.device_name, up))

    def device_name(self, dev: int) -> str:
        name = self._devnames.get(dev)
        if name is None:
            major, minor = dev_major_minor(dev)
            name = f"{major}:{minor}"
            try:
                for line in (self.sys_root / f"dev/block/{major}:{minor}/uevent").read_text().splitlines():
                    if line.startswith("DEVNAME="):
                        name = line.split("=", 1)[1]
            except OSError:
                pass
            self._devnames[dev] = name
        return name

    def slot_of(self, job: str, rank: int) -> int | None:
        with self._lock:
            for pid, slot in self._slot_of.items():
                p = self._proc_at.get(slot)
                if p is not None and p.job == job and p.rank == rank and p.pid == pid:
                    return slot
        return None

    def rank_stats(self, job: str, rank: int) -> RankKernelStats | None:
        """Deltas over the last poll interval for one tracked rank; None if not tracked or fewer
        than two polls have seen it."""
        cur, prev = self._snap, self._prev
        slot = self.slot_of(job, rank)
        if cur is None or prev is None or slot is None or slot not in cur.owners:
            return None
        same = prev.owners.get(slot) == cur.owners[slot]
        return rank_delta(prev if same else None, cur, slot)


def _value_is(slot: int) -> Callable[[Any, Any], bool]:
    def pred(_key: Any, value: Any) -> bool:
        return int(value.value) == slot

    return pred


def render_programs(progs: Iterable[Program]) -> str:
    return PRELUDE + "\n" + "\n".join(p.render() for p in progs)


def render_all(tracefs_roots: tuple[Path, ...] = CANDIDATE_ROOTS) -> str:
    """The C text the collector would compile here (``trainguard agent --print-bpf``).

    Programs are rendered against this kernel's tracepoint formats; ones that cannot load are
    listed with the reason instead."""
    tf = find_tracefs(tracefs_roots)
    if tf is None:
        return "/* tracefs is not mounted: tracepoint formats unknown, nothing to render */\n"
    env = ProbeEnv(tf)
    progs, notes = [], []
    for ptype in ALL_PROGRAMS:
        prog = ptype(env)
        why = prog.probe()
        if why:
            notes.append(f"/* {prog.name}: skipped ({why}) */")
        else:
            progs.append(prog)
    return "\n".join(notes) + ("\n" if notes else "") + render_programs(progs)
