"""What the agent's parts report, written to its event log: its threads' health, the cluster,
checkpoints, collectors, the API's refusals, and OOM kills in job cgroups. Failures among these
events also start a recovery's clock. Each function takes the agent whose parts it reads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from trainguard.agent.health import ThreadHealth

if TYPE_CHECKING:  # types only: the daemon imports this module
    from trainguard.agent.daemon import Agent

_RESERVED = {"kind", "message", "severity", "cause", "job", "rank", "source"}


def safe_fields(fields: dict[str, Any]) -> dict[str, Any]:
    """Event fields that cannot collide with EventLog.emit's own parameters."""
    return {(f"{k}_" if k in _RESERVED else k): v for k, v in fields.items()}


def on_thread_health(agent: Agent, th: ThreadHealth) -> None:
    if th.healthy:
        agent.events.emit("thread_recovered", f"agent thread {th.name} beats again", thread=th.name)
        return
    agent.events.emit("thread_unhealthy", f"agent thread {th.name} is {th.reason} (no heartbeat for {th.age_s:.1f}s): "
                     "the systemd watchdog is no longer fed", severity="critical", cause=th.reason, thread=th.name,
                     heartbeat_age_s=round(th.age_s, 3), last_error=th.last_error)


def on_thread_errors(agent: Agent, name: str, count: int, last_error: str) -> None:
    agent.events.emit("thread_iteration_failed", f"agent thread {name}: {count} iteration(s) failed and were "
                     f"survived: {last_error}", severity="error", cause=last_error, thread=name, failures=count)


def on_cluster_event(agent: Agent, kind: str, message: str, fields: dict[str, Any]) -> None:
    fields = dict(fields)
    severity = str(fields.pop("severity", "info"))
    job = fields.pop("job", None)
    cause = str(fields.pop("cause_", ""))
    agent.events.emit(kind, message, severity=severity, job=job if isinstance(job, str) else None, cause=cause, **safe_fields(fields))


def on_checkpoint_event(agent: Agent, kind: str, fields: dict[str, Any]) -> None:
    severity = "error" if ("failed" in kind or "corrupt" in kind or kind == "agent_dir_refused") else (
        "warning" if kind in ("agent_dir_taken_over", "agent_dir_tightened") else "info")
    job = fields.pop("job", None)
    agent.events.emit(kind, f"{kind.replace('_', ' ')}: {fields}", severity=severity, job=job if isinstance(job, str) else None, **safe_fields(fields))
    gangs = agent.cluster.gangs
    if kind == "checkpoint_committed" and gangs is not None and isinstance(job, str):
        gangs.note_commit(job)  # a spanning job's part: its commit record is written at once


def on_collector_event(agent: Agent, kind: str, fields: dict[str, Any]) -> None:
    pid = fields.get("pid")
    found = agent.supervisor.find_rank(pid) if isinstance(pid, int) else None
    job = found[0].job if found else None
    rank = found[1].rank if found else None
    if kind == "rank_exit":
        if found is None or not isinstance(pid, int):
            return  # an untracked process: the kernel program filters, this is a late race
        # The kernel saw the exit first: wake the supervisor now. It writes the rank_exit event
        # itself (with the waitpid status), so this one is only the latency evidence.
        exited_at = fields.get("exited_at")
        if job is not None and (fields.get("signal") or fields.get("exit_code")) and isinstance(exited_at, float):
            agent.recovery.note_death(job, exited_at)  # before the supervisor, woken next, reports it
        agent.supervisor.on_exit_event(pid, fields)
        kind = "process_exit_seen"
    if kind in ("gpu_lost", "gpu_xid", "gpu_ecc"):
        agent.gpu_faults.on_event(kind, fields)
    severity = "error" if kind in ("oom_kill", "gpu_xid", "gpu_lost") else ("debug" if kind == "process_exit_seen" else "info")
    agent.events.emit(kind, f"{kind.replace('_', ' ')}: {fields}", severity=severity, job=job, rank=rank, source="collector", **safe_fields(fields))


def watch_failures(agent: Agent, event: Any) -> None:
    if event.job is None:
        return
    failed_exit = event.kind == "rank_exit" and event.severity == "error"
    if failed_exit or event.kind in ("oom_kill", "gpu_xid", "gpu_lost"):
        agent.recovery.note_failure(event.job, event.kind, event.ts)


def watch_cgroups(agent: Agent) -> None:
    """An OOM kill in a job's cgroup becomes an event of that job (also without eBPF)."""
    # Every tick: only the agent's own cgroups (file reads), not a systemctl call per unit job.
    for job, use in agent.supervisor.launcher.cgroup_usage(units=False).items():
        seen = agent._oom_seen.get(job, 0)
        if use.oom_kills > seen:
            agent.events.emit(
                "job_oom_kill", f"job {job}: the kernel's OOM killer ended {use.oom_kills - seen} of its "
                f"processes (peak {use.memory_peak_bytes / 2**20:.0f} MiB)", severity="error", job=job,
                cause="oom_kill", oom_kills=use.oom_kills, memory_peak_bytes=use.memory_peak_bytes,
                memory_limit_bytes=agent.supervisor.launcher.limits(job).get("memory_max", 0.0))
        agent._oom_seen[job] = use.oom_kills


def on_auth_failure(agent: Agent, remote: str, path: str) -> None:
    agent.events.emit("api_auth_failed", f"API request without a valid token from {remote}", severity="warning", remote=remote, path=path)


def on_node_refused(agent: Agent, remote: str, caller: str, node: str, path: str) -> None:
    agent.events.emit("api_node_refused", f"{remote} (certificate {caller}) may not act for node {node}",
                     severity="warning", remote=remote, caller=caller, node=node, path=path)
