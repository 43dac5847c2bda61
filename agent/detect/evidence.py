"""Per-rank evidence for the straggler detector, gathered once per agent tick.

Two kernel counters are read straight from /proc and /sys (roots passed in, so tests can fake them):

* the run delay of the rank's main thread (``/proc/PID/task/PID/schedstat``, field 2: time spent
  runnable but waiting for a CPU, including time its cgroup was throttled); the trainer's main
  thread is its compute thread on CPU;
* the CPU-quota throttled time of the rank's cgroup (``cpu.stat``: cgroup v2 ``throttled_usec``,
  cgroup v1 ``throttled_time`` in ns).

The eBPF collector's per-rank deltas (run-queue wait, uninterruptible off-CPU time, reclaim) and the GPU
collector's per-pid state come in as they are. Counters become per-step figures by dividing each
tick's increase by the steps the rank made in that tick, summed over the recent ticks that cover
the detector's window.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainguard.agent.detect.causes import Evidence

_V1_CPU_DIRS = ("cpu", "cpu,cpuacct", "cpuacct,cpu")


class ProcReader:
    def __init__(self, proc_root: Path = Path("/proc"), sys_root: Path = Path("/sys")) -> None:
        self.proc_root = Path(proc_root)
        self.sys_root = Path(sys_root)

    def run_delay_s(self, pid: int) -> float | None:
        try:
            fields = (self.proc_root / str(pid) / "task" / str(pid) / "schedstat").read_text().split()
            return int(fields[1]) * 1e-9
        except (OSError, ValueError, IndexError):
            return None

    def cpu_stat_path(self, pid: int) -> Path | None:
        """The cpu.stat of the cgroup that limits ``pid``'s CPU (v1 cpu controller first, then v2)."""
        try:
            lines = (self.proc_root / str(pid) / "cgroup").read_text().splitlines()
        except OSError:
            return None
        v2: str | None = None
        for line in lines:
            parts = line.split(":", 2)
            if len(parts) != 3:
                continue
            _, controllers, path = parts
            if "cpu" in controllers.split(","):
                for d in _V1_CPU_DIRS:
                    p = self.sys_root / "fs/cgroup" / d / path.lstrip("/") / "cpu.stat"
                    if p.exists():
                        return p
            elif controllers == "":
                v2 = path
        if v2 is not None:
            for base in ("fs/cgroup", "fs/cgroup/unified"):
                p = self.sys_root / base / v2.lstrip("/") / "cpu.stat"
                if p.exists():
                    return p
        return None

    def throttled_s(self, pid: int) -> float | None:
        path = self.cpu_stat_path(pid)
        if path is None:
            return None
        try:
            stat = dict(line.split() for line in path.read_text().splitlines() if len(line.split()) == 2)
        except (OSError, ValueError):
            return None
        if "throttled_usec" in stat:
            return int(stat["throttled_usec"]) * 1e-6
        if "throttled_time" in stat:
            return int(stat["throttled_time"]) * 1e-9
        return None


@dataclass
class _Tick:
    at: float
    steps: int
    first_step: int = 0
    """The rank's step when the tick began (ticks of the warm-up after a restart are left out)."""
    run_delay: float = math.nan
    throttled: float = math.nan
    ebpf_runq: float = math.nan
    ebpf_io: float = math.nan
    ebpf_reclaim: float = math.nan


@dataclass
class _Last:
    pid: int
    step: int
    run_delay: float | None
    throttled: float | None


def _delta(new: float | None, old: float | None) -> float:
    if new is None or old is None or new < old:
        return math.nan
    return new - old


class RankEvidence:
    """Counters per (job, rank) across ticks; ``observe`` once per tick, then read per-step figures."""

    def __init__(self, reader: ProcReader, keep_ticks: int = 64) -> None:
        self.reader = reader
        self.keep_ticks = keep_ticks
        self._last: dict[tuple[str, int], _Last] = {}
        self._ticks: dict[tuple[str, int], deque[_Tick]] = {}

    def keys(self) -> list[tuple[str, int]]:
        """(job, rank) of every rank observed."""
        return list(self._last)

    def forget_job(self, job: str) -> None:
        for key in [k for k in self._last if k[0] == job]:
            self._last.pop(key, None)
            self._ticks.pop(key, None)

    def observe(self, job: str, rank: int, pid: int, step: int, now: float, ebpf: Any | None = None) -> None:
        key = (job, rank)
        delay = self.reader.run_delay_s(pid)
        throttled = self.reader.throttled_s(pid)
        last = self._last.get(key)
        self._last[key] = _Last(pid, step, delay, throttled)
        if last is None or last.pid != pid or step < last.step:
            self._ticks.pop(key, None)  # a new process: its counters start again
            return
        tick = _Tick(at=now, steps=step - last.step, first_step=last.step, run_delay=_delta(delay, last.run_delay),
                     throttled=_delta(throttled, last.throttled))
        if ebpf is not None:
            tick.ebpf_runq = float(ebpf.runq_total_s)
            tick.ebpf_io = float(ebpf.offcpu_io_s)
            tick.ebpf_reclaim = float(ebpf.reclaim_s)
        ticks = self._ticks.setdefault(key, deque(maxlen=self.keep_ticks))
        ticks.append(tick)

    def _recent(self, job: str, rank: int, span_steps: int) -> list[_Tick]:
        ticks = self._ticks.get((job, rank))
        if not ticks:
            return []
        out: list[_Tick] = []
        steps = 0
        for t in reversed(ticks):
            out.append(t)
            steps += t.steps
            if steps >= span_steps:
                break
        return out

    @staticmethod
    def _per_step(ticks: list[_Tick], attr: str) -> float:
        vals = [(getattr(t, attr), t.steps) for t in ticks]
        vals = [(v, n) for v, n in vals if not math.isnan(v)]
        steps = sum(n for _, n in vals)
        if not vals or steps <= 0:
            return math.nan
        return sum(v for v, _ in vals) / steps

    def run_delay_per_step(self, job: str, rank: int, now: float, span_s: float, from_step: int = 0) -> float:
        """Median over the ticks of the last ``span_s`` seconds of the main thread's run delay per
        step (0 when unknown), counting only ticks that began at or after ``from_step``.

        A median over ticks rather than a sum: a short burst of load from elsewhere on the node
        moves one or two ticks, a rank that shares its core for good moves all of them. The step
        bound keeps a restart's start-up (imports, the restore, every rank starting at once) out:
        CI saw a healthy restarted rank flagged with 200 ms of run delay per step from it."""
        recent = [t for t in self._ticks.get((job, rank), ()) if t.at >= now - span_s and t.first_step >= from_step]
        values = sorted(t.run_delay / t.steps for t in recent if t.steps > 0 and not math.isnan(t.run_delay))
        if not values:
            return 0.0
        mid = len(values) // 2
        return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2

    def evidence(self, job: str, rank: int, span_steps: int, gpu: Any | None = None, gpu_errors: int = 0) -> Evidence:
        ticks = self._recent(job, rank, span_steps)
        runq = self._per_step(ticks, "ebpf_runq")
        source = "ebpf"
        if math.isnan(runq):
            runq, source = self._per_step(ticks, "run_delay"), "schedstat"
        return Evidence(
            run_delay_s=runq,
            run_delay_source=source if not math.isnan(runq) else "",
            throttled_s=self._per_step(ticks, "throttled"),
            io_wait_s=self._per_step(ticks, "ebpf_io"),
            reclaim_s=self._per_step(ticks, "ebpf_reclaim"),
            gpu_slowdown=tuple(gpu.slowdown_reasons) if gpu is not None else (),
            gpu_clock_ratio=float(gpu.clock_ratio) if gpu is not None else math.nan,
            gpu_errors=gpu_errors,
        )
