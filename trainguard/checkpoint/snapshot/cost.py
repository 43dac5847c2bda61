"""Whether and how much a rank's snapshots cost its job, from the CPUs the node's ranks share: the
numbers ``Run`` chooses its snapshot cadence and the helper-thread copy by."""

from __future__ import annotations

import os

import torch

from trainguard.agent.lifecycle.cgroups import cpu_limit


def usable_cpus() -> float:
    """The CPUs this process may run on: its affinity mask, or its cgroup's CPU quota where that is
    lower (``cpu_limit``)."""
    cpus = float(len(os.sched_getaffinity(0)))
    limit = cpu_limit()
    return min(cpus, limit) if limit is not None else cpus


def overlap_pays(local_ranks: int, *, cpus: float | None = None, threads: int | None = None) -> bool:
    """Whether a rank's snapshots should copy in a helper thread while the next step runs: only
    where the cores it may use (``usable_cpus``) leave one for each rank's helper besides its
    ``threads`` compute threads. Where the ranks fill the cores the helper takes its CPU from
    training all the same, and the hand-off, the thread switches and the GIL between them cost
    more than the copy saves: on the recovery bench's 4 ranks on 2 cores a snapshot cost 0.35 ms
    overlapped against 0.26 ms copied in ``take``, and the job ran no faster for the overlap
    (BENCHMARKS.md)."""
    cpus = usable_cpus() if cpus is None else cpus
    threads = torch.get_num_threads() if threads is None else threads
    return cpus >= max(1, local_ranks) * (threads + 1)


def cost_scale(local_ranks: int, *, cpus: float | None = None) -> float:
    """How many times a rank's snapshot work costs the job its own length, where the node's ranks
    outnumber its cores: there every CPU second is taken from ranks that all wait for the slowest
    at the next collective, and the job's step grows by the ranks' snapshot work shared over the
    cores (``local_ranks / cpus`` times one rank's). 1 where each rank has a core: the snapshot
    holds up its own rank only. On the recovery bench's 4 ranks on 2 cores a snapshot measured
    0.23-0.25 ms in ``take`` (0.9-1 % of a 25-28 ms step) and the time between its steps grew by
    0.43 ms a step with snapshots on (bench/BENCHMARKS.md)."""
    cpus = usable_cpus() if cpus is None else cpus
    return max(1.0, local_ranks / max(1.0, cpus))
