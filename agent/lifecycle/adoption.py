"""A restarted agent takes over the jobs a previous agent on the same state directory left:
it reattaches to their ranks when every one is accounted for, else restarts the job.
"""

from __future__ import annotations

import functools
import os
import signal
import threading
from dataclasses import replace
from typing import TYPE_CHECKING

from trainguard.agent.lifecycle.jobrecord import JobRecord
from trainguard.agent.lifecycle.jobs import JobSpec, JobState
from trainguard.agent.lifecycle.ranks import RankProcess
from trainguard.agent.lifecycle.records import AdoptedProcess, SavedJob
from trainguard.agent.wire import process_start_ticks

if TYPE_CHECKING:  # types only: the supervisor imports this module
    from trainguard.agent.lifecycle.supervisor import Supervisor


def _status_text(status: int) -> str:
    """A Popen-convention status as the rank_exit event words it (-N: signal N)."""
    return f"signal {-status}" if status < 0 else f"code {status}"


def adopt(sup: Supervisor, saved: list[SavedJob]) -> None:
    """Take over the jobs a previous agent on this state directory left running: reattach to
    their ranks when every one is still alive, else stop what is left and start the job again
    (from its newest checkpoint, as any restart). Says which in an event per job."""
    for old in saved:
        if old.state in ("succeeded", "failed", "stopped") or old.spec.get("job") in sup.jobs:
            continue
        job = str(old.spec.get("job"))
        try:
            spec = JobSpec.from_dict(old.spec)
        except (ValueError, TypeError, KeyError) as exc:
            sup.events.emit("job_not_adopted", f"job {job}: its saved spec is unusable ({exc})",
                            severity="error", job=job, cause=str(exc))
            continue
        old = _prove_unnamed_ranks(sup, old, job)
        alive = [r for r in old.ranks if r.alive()]
        # Ranks that ended while no agent ran: their warm launcher outlives the agent, reaps them
        # and records how they ended; only a rank whose end nobody recorded is lost to us.
        ended = {r.rank: code for r in old.ranks if r not in alive and (code := r.recorded_status()) is not None}
        gone = [r.rank for r in old.ranks if r not in alive and r.rank not in ended]
        if old.spans_nodes:
            sup.events.emit("job_not_adopted", f"job {job} spans nodes: the cluster leader places it again",
                            severity="warning", job=job, pids=[r.pid for r in alive])
            continue
        record = JobRecord(spec, state=JobState.RUNNING, attempt=old.attempt, restarts=old.restarts,
                           progress_step=old.progress_step, submitted=old.submitted, restored_from=old.restored_from)
        record.step_at_last_restart = old.progress_step
        with sup._lock:
            sup.jobs[job] = record
        sup.plans.adopt(job)
        if sup.on_submit is not None:
            sup.on_submit(job)
        if old.state == "running" and old.ranks and not gone and len(old.ranks) == spec.nproc:
            # Every rank runs on or ended with a recorded status: the job goes on as if this agent
            # had watched it all along (an ended rank's status is judged at the monitor's next look).
            record.ranks = [RankProcess(r.rank, r.local_rank,
                                        AdoptedProcess(r, functools.partial(_adopted_status, record)),
                                        sup.launcher.clock(), r.log_path) for r in old.ranks]
            sup._index_ranks()
            reattach = getattr(sup.launcher, "reattach_cgroup", None)
            if reattach is not None:
                reattach(spec)  # its usage counts on, and it is cleaned up when the job ends
            sup._persist(record)
            meanwhile = (f"; {len(ended)} ended meanwhile ("
                         + ", ".join(f"rank {k} with {_status_text(v)}" for k, v in sorted(ended.items()))
                         + ")") if ended else ""
            sup.events.emit("job_adopted", f"job {job}: adopted its {len(alive)} running ranks "
                            f"(attempt {old.attempt}) from the previous agent{meanwhile}", severity="warning",
                            job=job, attempt=old.attempt, pids=[r.pid for r in alive], action="adopt",
                            ended={str(k): v for k, v in ended.items()})
            sup._ranks_changed()
            os.write(sup._wake_w, b"x")
            continue
        if old.state == "starting" and old.attempt == 0 and not old.ranks:
            # Accepted, but the previous agent stopped before any rank started: start it now.
            record.state = JobState.STARTING
            sup.events.emit("job_adopted", f"job {job}: submitted but not yet started when the previous "
                            "agent stopped; starting it now", severity="warning", job=job, attempt=0, pids=[],
                            action="start", ended={})
            threading.Thread(target=sup._launch_safely, args=(record,), name=f"launch-{job}", daemon=True).start()
            continue
        # Ranks ended while no agent watched (their exit status is lost), or the job was
        # between attempts: the survivors cannot go on without them.
        for r in alive:
            try:
                os.killpg(r.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        record.state = JobState.RESTARTING
        record.restarts += 1
        sup.restart_total += 1
        why = (f"ranks {gone} ended while no agent ran" if gone else f"it was {old.state} when the agent stopped")
        sup.events.emit("job_restart", f"job {job}: the agent restarted and {why}: restarting all ranks "
                        f"(attempt {old.attempt + 1}) from its newest checkpoint", severity="warning", job=job,
                        cause=f"agent restart: {why}", action="restart_after_agent_restart",
                        gone=gone, killed=[r.pid for r in alive])
        threading.Thread(target=sup._launch_safely, args=(record,), name=f"launch-{job}", daemon=True).start()


def _prove_unnamed_ranks(sup: Supervisor, old: SavedJob, job: str) -> SavedJob:
    """Ranks recorded without a start time are adopted (or killed) only when the launcher proves
    their pid is the job's; a running pid it cannot prove is someone else's, left alone."""
    owns = getattr(sup.launcher, "owns_pid", None)
    ranks = []
    for r in old.ranks:
        if r.start_ticks is None and process_start_ticks(r.pid) is not None:
            proven = r.proven(functools.partial(owns, job)) if owns is not None else None
            if proven is None:
                sup.events.emit("pid_not_adopted", f"job {job}: rank {r.rank}'s recorded pid {r.pid} runs, but "
                                "nothing proves it is the rank (no start time recorded, not in the job's cgroup): "
                                "left alone", severity="warning", job=job, rank=r.rank, pid=r.pid,
                                cause="unproven pid")
                ranks.append(replace(r, pid=-1))  # the rank counts as ended; the pid is never signalled
                continue
            r = proven
        ranks.append(r)
    return replace(old, ranks=ranks)


def _adopted_status(record: JobRecord) -> int:
    """The exit status of an adopted rank when no exit event brought it: 0 when the job's
    telemetry reached its last step (an embedded-trainer job says how many), else a failure."""
    steps = (record.spec.trainer or {}).get("steps") if not record.spec.is_command else None
    return 0 if isinstance(steps, int) and record.progress_step + 1 >= steps else 1
