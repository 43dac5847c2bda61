"""The agent's own health: which of its long-lived threads the watchdog checks, and the status
line systemd shows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # types only: the daemon imports this module
    from trainguard.agent.daemon import Agent

REPLICATE_STALE_S = 1800.0
"""A checkpoint replicator busy with one copy longer than this is stuck (an upload that hangs)."""


def watch_threads(agent: Agent) -> None:
    """Put every long-lived thread that exists now under the watchdog's check (idempotent; the
    main loop calls it again for threads that start later, such as a gang's forwarder)."""
    watch = agent.health.watch
    watch(agent.supervisor, "rank-monitor")
    watch(agent.telemetry, "telemetry")
    for lst in agent.api._listeners:
        watch(lst, "api-unix" if lst.is_unix else "api-tcp")
    if agent.metrics_server is not None:
        watch(agent.metrics_server, "metrics-http")
    membership = agent.cluster.membership
    if membership is not None and membership._thread is not None:
        watch(membership, "cluster-membership")
    if agent.cluster._thread is not None:
        watch(agent.cluster, "cluster-jobs")
    gangs = agent.cluster.gangs
    if gangs is not None and gangs._forwarder is not None:
        watch(gangs, "gang-telemetry")
    if agent.ebpf is not None and agent.ebpf._thread is not None:
        watch(agent.ebpf, "ebpf-events")
    watcher = agent.gpu._watcher if agent.gpu is not None else None
    if watcher is not None and watcher._thread is not None:
        watch(watcher, "gpu-xid")
    for worker in agent.checkpoints.replicator._workers:
        if worker.thread.is_alive():
            # An upload of a large checkpoint is one long iteration: only a hang past this is stuck.
            watch(worker, worker.thread.name, stale_after_s=max(agent.cfg.agent.heartbeat_stale_s, REPLICATE_STALE_S))


def status_line(agent: Agent) -> str:
    running = sum(1 for j in agent.supervisor.jobs.values() if not j.state.finished)
    up = [k for k, v in agent.collector_state.items() if v[0]]
    line = f"{running} job(s) running; collectors up: {', '.join(up) or 'none'}"
    bad = [t for t in agent.health.check() if not t.healthy]
    if bad:
        line = "UNHEALTHY: " + ", ".join(f"{t.name} {t.reason} for {t.since_s:.0f}s" for t in bad) + "; " + line
    return line
