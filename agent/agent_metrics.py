"""Metric families about the agent itself and its jobs (events, restarts, job state, uptime)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.metrics_core import Metric

from trainguard.agent.lifecycle.jobs import JobState
from trainguard.agent.metricspec import MetricSpec

if TYPE_CHECKING:
    from trainguard.agent.daemon import Agent

EVENTS = MetricSpec("trainguard_events_total", "counter", "", ("kind", "severity"), "Events written to the event log, by kind and severity.")
JOB_STATE = MetricSpec("trainguard_job_state", "gauge", "", ("job", "state"), "1 for the state each job is in, 0 for the others.")
JOB_RESTARTS = MetricSpec("trainguard_job_restarts_total", "counter", "", ("job",), "Restarts of a job's ranks by the agent.")
JOB_PROGRESS = MetricSpec("trainguard_job_progress_step", "gauge", "", ("job",), "Highest step any rank of the job reported.")
JOB_ALIVE = MetricSpec("trainguard_job_ranks_alive", "gauge", "", ("job",), "Rank processes of the job that are running.")
JOB_RANKS = MetricSpec("trainguard_job_ranks", "gauge", "", ("job",), "Rank processes the job should have on this node.")
JOB_CPU = MetricSpec("trainguard_job_cpu_seconds_total", "counter", "seconds", ("job",),
                     "CPU time of every process in the job's cgroup (ranks, their workers, the warm launcher).")
JOB_MEMORY = MetricSpec("trainguard_job_memory_bytes", "gauge", "bytes", ("job",), "Memory charged to the job's cgroup now.")
JOB_MEMORY_PEAK = MetricSpec("trainguard_job_memory_peak_bytes", "gauge", "bytes", ("job",),
                             "Most memory the job's cgroup was charged since it was made.")
JOB_MEMORY_LIMIT = MetricSpec("trainguard_job_memory_limit_bytes", "gauge", "bytes", ("job",),
                              "Memory ceiling of the job's cgroup (0: none).")
JOB_OOM_KILLS = MetricSpec("trainguard_job_oom_kills_total", "counter", "", ("job",),
                           "Processes of the job the kernel's OOM killer ended (its cgroup's count).")
START_TIME = MetricSpec("trainguard_agent_start_time_seconds", "gauge", "seconds", (), "Unix time the agent started.")
TICKS = MetricSpec("trainguard_agent_ticks_total", "counter", "", (), "Main-loop iterations (collect, detect, act).")

METRICS: tuple[MetricSpec, ...] = (EVENTS, JOB_STATE, JOB_RESTARTS, JOB_PROGRESS, JOB_ALIVE, JOB_RANKS, JOB_CPU,
                                   JOB_MEMORY, JOB_MEMORY_PEAK, JOB_MEMORY_LIMIT, JOB_OOM_KILLS, START_TIME, TICKS)


# Kinds that alerts take increase() of: exported from 0 so the first one is an increase.
ALERTED_EVENT_KINDS = (("crash_loop", "critical"), ("job_failed", "error"), ("loss_diverged", "error"), ("hang_detected", "error"))


def _cgroup_metrics(agent: Agent) -> Iterator[Metric]:
    """Per-job resource use from the jobs' cgroups (families without samples when there are none)."""
    cpu, mem, peak, limit, ooms = (JOB_CPU.counter(), JOB_MEMORY.gauge(), JOB_MEMORY_PEAK.gauge(),
                                   JOB_MEMORY_LIMIT.gauge(), JOB_OOM_KILLS.counter())
    launcher = agent.supervisor.launcher
    for job, use in sorted(launcher.cgroup_usage().items()):
        for family, value in ((cpu, use.cpu_s), (mem, use.memory_bytes), (peak, use.memory_peak_bytes)):
            if math.isfinite(value):
                family.add_metric([job], value)
        limit.add_metric([job], launcher.limits(job).get("memory_max", 0.0))
        ooms.add_metric([job], use.oom_kills)
    yield from (cpu, mem, peak, limit, ooms)


def agent_metrics(agent: Agent) -> Iterator[Metric]:
    events = EVENTS.counter()
    counts = dict.fromkeys(ALERTED_EVENT_KINDS, 0)
    counts.update(agent.event_counts)
    for (kind, severity), n in sorted(counts.items()):
        events.add_metric([kind, severity], n)
    yield events
    state, restarts, progress = JOB_STATE.gauge(), JOB_RESTARTS.counter(), JOB_PROGRESS.gauge()
    alive, ranks = JOB_ALIVE.gauge(), JOB_RANKS.gauge()
    for rec in list(agent.supervisor.jobs.values()):
        for s in JobState:
            state.add_metric([rec.job, s.value], 1.0 if rec.state == s else 0.0)
        restarts.add_metric([rec.job], rec.restarts)
        progress.add_metric([rec.job], max(rec.progress_step, 0))
        alive.add_metric([rec.job], sum(1 for r in rec.ranks if r.alive))
        ranks.add_metric([rec.job], 0 if rec.state.finished else rec.spec.nproc)
    yield from (state, restarts, progress, alive, ranks)
    yield from _cgroup_metrics(agent)
    start = START_TIME.gauge()
    start.add_metric([], agent.started)
    ticks = TICKS.counter()
    ticks.add_metric([], agent.ticks)
    yield from (start, ticks)
