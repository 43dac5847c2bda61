"""Which processes are whose ranks: the pids the collectors follow (this agent's ranks and those
of jobs it did not start that report to it) and which senders may report for a job. Each function
takes the agent whose supervisor, collectors and pid maps it reads and replaces.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from trainguard.agent.collectors.base import TrackedProcess
from trainguard.agent.detect.activity import descends_from

if TYPE_CHECKING:  # types only: the daemon imports this module
    from trainguard.agent.daemon import Agent

log = logging.getLogger("trainguard.agent")

EXTERNAL_SILENCE_S = 60.0
"""A rank of a job this agent did not start stops being tracked after this long without a step."""


def track_external(agent: Agent, snapshot: Any, now: float) -> None:
    """Ranks of jobs this agent did not start but that report to it (torchrun jobs): their pids
    go to the collectors too (per-rank eBPF), while they keep reporting."""
    fresh = {}
    for job, ranks in snapshot.jobs.items():
        if job in agent.supervisor.jobs:
            continue
        for v in ranks.values():
            if now - v.last_seen < EXTERNAL_SILENCE_S and os.path.exists(f"/proc/{v.pid}"):
                fresh[v.pid] = TrackedProcess(v.pid, job, v.rank, v.local_rank)
    if set(fresh) != set(agent._external):
        agent._external = fresh
        ranks_changed(agent, agent.supervisor.tracked())


def sender_ok(agent: Agent, job: str, pid: int) -> bool:
    """On the telemetry thread: may process ``pid`` report for ``job``? A job this agent launched
    takes telemetry only from its rank processes or their descendants (a wrapper such as
    ``bash -c``); other jobs' senders are not checked (see telemetry.max_foreign_jobs)."""
    pids = agent._managed_pids.get(job)
    if pids is None:
        return True
    if pid in pids:
        return True
    if pid <= 0:
        return False
    known = agent._sender_cache.get(pid)
    if known is not None:
        return known == job
    ok = descends_from(pid, pids)
    if ok:
        if len(agent._sender_cache) > 4096:
            agent._sender_cache.clear()
        agent._sender_cache[pid] = job
    return ok


def ranks_changed(agent: Agent, processes: dict[int, TrackedProcess]) -> None:
    # Every rank of the current attempt, alive or not: a rank's last datagrams may still be
    # queued when it exits. Replaced whole: the telemetry thread reads it without a lock.
    agent._managed_pids = {j: frozenset(r.pid for r in rec.ranks)
                          for j, rec in list(agent.supervisor.jobs.items()) if not rec.state.finished}
    agent._sender_cache = {}
    processes = {**agent._external, **processes}
    for c in agent.collectors:
        try:
            c.track(processes)
        except Exception as exc:  # noqa: BLE001
            log.warning("collector %s could not track ranks: %s", c.name, exc)
