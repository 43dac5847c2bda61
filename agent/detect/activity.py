"""Hang judgement for jobs that do not report steps: CPU activity of the ranks' process trees.

A script that sends no telemetry gives no step count to watch, and silence itself means nothing
(it may log nothing for hours). What a healthy rank still does is use the CPU: it computes, or
feeds a device, or loads data. A rank stopped by a signal, deadlocked, or waiting in a collective
for a peer that is stuck does not: gloo's and NCCL's blocking waits sleep. So a job is *idle* when
the CPU time of all its ranks (each with its child processes, e.g. data-loader workers) grew by
less than ``min_cores`` cores' worth over the span, and hung when it stayed idle for the
``--hang-timeout`` the user chose. A rank spinning in a busy loop is not idle; that hang is found
only through step telemetry (``trainguard.init()``), which the recovery service also uses.

CPU times come from ``/proc/<pid>/stat`` (utime + stime, clock ticks), under a ``proc_root`` that
tests point elsewhere. A job whose steps moved on since the last look is active without reading
them: the scan reads every process's stat file, a few milliseconds of the agent's CPU each tick
on a node whose cores the ranks need.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

_TICK_S = 1.0 / (os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100)


def _read_stat(proc_root: Path, pid: int) -> tuple[int, float] | None:
    """(parent pid, CPU seconds) of one process, None when it is gone."""
    try:
        raw = (proc_root / str(pid) / "stat").read_text()
    except OSError:
        return None
    # The command name may hold spaces and parentheses: split after its closing one.
    fields = raw[raw.rfind(")") + 2:].split()
    try:
        return int(fields[1]), (int(fields[11]) + int(fields[12])) * _TICK_S
    except (IndexError, ValueError):
        return None


def descends_from(pid: int, roots: set[int] | frozenset[int], proc_root: Path = Path("/proc")) -> bool:
    """Whether ``pid`` is one of ``roots`` or a descendant (a rank started through a wrapper such as
    ``bash -c`` or ``uv run`` reports from a child of the process the agent started)."""
    p, hops = pid, 0
    while p > 1 and hops < 32:
        if p in roots:
            return True
        got = _read_stat(proc_root, p)
        if got is None:
            return False
        p, hops = got[0], hops + 1
    return False


def tree_cpu_seconds(pids: Iterable[int], proc_root: Path = Path("/proc")) -> float:
    """CPU seconds used so far by ``pids`` and all their descendants."""
    roots = set(pids)
    parents: dict[int, int] = {}
    cpu: dict[int, float] = {}
    try:
        names = os.listdir(proc_root)
    except OSError:
        return 0.0
    for name in names:
        if not name.isdigit():
            continue
        got = _read_stat(proc_root, int(name))
        if got is not None:
            parents[int(name)], cpu[int(name)] = got
    total = 0.0
    for pid, seconds in cpu.items():
        p, hops = pid, 0
        while p not in roots and p in parents and hops < 64:
            p, hops = parents[p], hops + 1
        if p in roots:
            total += seconds
    return total


@dataclass
class _JobActivity:
    cpu_s: float
    """CPU seconds at ``sampled_at`` (NaN: not read since the job last made progress)."""
    active_at: float
    sampled_at: float
    pids: frozenset[int] = field(default_factory=frozenset)
    progress: int = -1


class ActivityProbe:
    """When each job's ranks last used the CPU; ``idle_for`` is what a hang verdict reads."""

    def __init__(self, min_cores: float = 0.02, proc_root: Path = Path("/proc"),
                 cpu_of: Callable[[Iterable[int]], float] | None = None) -> None:
        self.min_cores = min_cores
        self.proc_root = proc_root
        self._cpu_of = cpu_of or (lambda pids: tree_cpu_seconds(pids, self.proc_root))
        self._jobs: dict[str, _JobActivity] = {}

    def observe(self, job: str, pids: Iterable[int], now: float, progress: int = -1) -> float:
        """Sample ``job``'s ranks now; returns how long they have been idle (0 when active).
        ``progress``: the job's step count where it reports one; a count that moved on since the
        last look is activity enough, and the ranks' CPU time is then not read."""
        ranks = frozenset(pids)
        last = self._jobs.get(job)
        if last is not None and last.pids == ranks and progress >= 0 and progress > last.progress:
            last.active_at = last.sampled_at = now
            last.cpu_s, last.progress = math.nan, progress
            return 0.0
        cpu = self._cpu_of(ranks)
        if last is None or last.pids != ranks:
            # A new attempt (other pids): its clock starts now.
            self._jobs[job] = _JobActivity(cpu, now, now, ranks, progress)
            return 0.0
        if math.isnan(last.cpu_s):
            # The first read since the steps stopped: the span of idleness starts at the last step.
            last.cpu_s, last.sampled_at = cpu, now
            return now - last.active_at
        span = max(now - last.sampled_at, 1e-9)
        if cpu - last.cpu_s > self.min_cores * span:
            last.active_at = now
        last.cpu_s, last.sampled_at = cpu, now
        return now - last.active_at

    def idle_for(self, job: str, now: float) -> float:
        last = self._jobs.get(job)
        return 0.0 if last is None else now - last.active_at

    def forget(self, job: str) -> None:
        self._jobs.pop(job, None)
