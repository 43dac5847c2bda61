"""Metric families about the agent itself and its jobs (events, restarts, job state, uptime)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from agent.jobs import JobState

if TYPE_CHECKING:
    from agent.daemon import Agent

METRICS = (
    ("trainguard_events_total", "counter", "", ("kind", "severity"), "Events written to the event log, by kind."),
    ("trainguard_job_state", "gauge", "", ("job", "state"), "1 for the state each job is in."),
    ("trainguard_job_restarts_total", "counter", "", ("job",), "Restarts of a job's ranks by the agent."),
    ("trainguard_job_progress_step", "gauge", "", ("job",), "Highest step any rank of the job reported."),
    ("trainguard_job_ranks_alive", "gauge", "", ("job",), "Rank processes of the job that are running."),
    ("trainguard_agent_start_time_seconds", "gauge", "seconds", (), "Unix time the agent started."),
    ("trainguard_agent_ticks_total", "counter", "", (), "Main-loop iterations (collect, detect, act)."),
)


def agent_metrics(agent: Agent) -> Iterator[Metric]:
    events = CounterMetricFamily("trainguard_events", METRICS[0][4], labels=["kind", "severity"])
    for (kind, severity), n in sorted(agent.event_counts.items()):
        events.add_metric([kind, severity], n)
    yield events
    state = GaugeMetricFamily("trainguard_job_state", METRICS[1][4], labels=["job", "state"])
    restarts = CounterMetricFamily("trainguard_job_restarts", METRICS[2][4], labels=["job"])
    progress = GaugeMetricFamily("trainguard_job_progress_step", METRICS[3][4], labels=["job"])
    alive = GaugeMetricFamily("trainguard_job_ranks_alive", METRICS[4][4], labels=["job"])
    for rec in list(agent.supervisor.jobs.values()):
        for s in JobState:
            state.add_metric([rec.job, s.value], 1.0 if rec.state == s else 0.0)
        restarts.add_metric([rec.job], rec.restarts)
        progress.add_metric([rec.job], max(rec.progress_step, 0))
        alive.add_metric([rec.job], sum(1 for r in rec.ranks if r.alive))
    yield from (state, restarts, progress, alive)
    yield GaugeMetricFamily("trainguard_agent_start_time_seconds", METRICS[5][4], value=agent.started)
    yield CounterMetricFamily("trainguard_agent_ticks", METRICS[6][4], value=agent.ticks)


