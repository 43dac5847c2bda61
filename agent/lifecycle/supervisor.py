"""Supervises the jobs this agent launched: start, watch every rank, restart, stop.

Rank exits are seen the instant they happen: a monitor thread waits on a pidfd per rank (the
eBPF exit event, where available, arrives through ``on_exit_event`` at the same moment), so a
dead rank never waits for the next main-loop tick. What to do about a failure (restart, restore,
shrink) is decided by the ``recovery`` policy hook, which later healing code replaces.
"""

from __future__ import annotations

import os
import select
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from trainguard.agent import health
from trainguard.agent.collectors.base import TrackedProcess
from trainguard.agent.detect.peerdiag import diagnose, read_tail
from trainguard.agent.eventlog import EventLog
from trainguard.agent.lifecycle import adoption
from trainguard.agent.lifecycle.jobrecord import JobRecord, launch_attempt
from trainguard.agent.lifecycle.jobs import JobSpec, JobState, check_transition
from trainguard.agent.lifecycle.launcher import Launcher
from trainguard.agent.lifecycle.plans import PlanStore
from trainguard.agent.lifecycle.ranks import LaunchContext, RankBlock, RankProcess
from trainguard.agent.lifecycle.records import AdoptedProcess, RecordStore, SavedJob
from trainguard.agent.lifecycle.zygote_client import ZygoteChild


def _set_logs_aside(log_dir: str) -> None:
    """Rename a previous run's ``*.log`` files to ``*.log.1`` (one generation is kept)."""
    try:
        names = os.listdir(log_dir)
    except OSError:
        return
    for name in names:
        if name.endswith(".log"):
            try:
                os.replace(os.path.join(log_dir, name), os.path.join(log_dir, name + ".1"))
            except OSError:
                pass  # a log that cannot be moved is appended to, as before


PEER_EXIT_GRACE_S = 0.5
"""How long a rank's exit 1 waits for a still-running peer to end on its own (see _judge_exits)."""
STATUS_POLL_MS = 5
"""How often the monitor looks for the status of a rank whose process has ended (its pidfd said so)
but whose warm launcher has not reported yet."""


def _close_pidfd(rank: RankProcess) -> None:
    fd = rank.pidfd
    if fd is not None and fd >= 0:
        os.close(fd)
        rank.pidfd = -1


MAX_DIAGNOSED_RANKS = 4
"""Dead ranks of one failure whose logs are read for an unreachable peer (bounded work)."""


class Supervisor:
    def __init__(
        self,
        events: EventLog,
        plans: PlanStore,
        launcher: Launcher,
        context_for: Callable[[JobSpec], LaunchContext],
        *,
        stop_grace_s: float = 10.0,
        on_ranks_changed: Callable[[dict[int, TrackedProcess]], None] | None = None,
        launch_env: Callable[[JobRecord], dict[str, str]] | None = None,
        on_submit: Callable[[str], None] | None = None,
        records: RecordStore | None = None,
    ) -> None:
        self.events = events
        self.plans = plans
        self.launcher = launcher
        self.context_for = context_for
        self.stop_grace_s = stop_grace_s
        self.on_ranks_changed = on_ranks_changed
        self.launch_env = launch_env
        self.before_survivors_stop: Callable[[JobRecord], None] | None = None
        """Called, when ranks of a job died, before the rest are killed for its restart."""
        self.on_submit = on_submit
        """Called with the job id before its ranks start (the telemetry table registers the job)."""
        self.records = records
        """Where every job's record is kept for a restarted agent (None: not kept)."""
        self.peer_node_of: Callable[[str], str | None] | None = None
        """The cluster node an address or host name belongs to (set by the daemon in a cluster):
        names the node a failed rank could not reach."""
        self.jobs: dict[str, JobRecord] = {}
        self._by_pid: dict[int, tuple[JobRecord, RankProcess]] = {}
        """Every job's ranks by pid (``find_rank``)."""
        self.restart_total = 0
        self._lock = threading.RLock()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._monitor, name="rank-monitor", daemon=True)
        self._thread.start()

    # --- jobs -------------------------------------------------------------------------------
    def submit(self, spec: JobSpec, *, block: RankBlock | None = None,
               on_failure: Callable[[str, str], None] | None = None) -> JobRecord:
        """Register the job and start its ranks in the background (a warm launcher's first start
        imports torch for seconds; an API call must not wait for it). ``block``/``on_failure``:
        this node's part of a job that spans nodes (see ``JobRecord``)."""
        with self._lock:
            old = self.jobs.get(spec.job)
            if old is not None and not old.state.finished:
                raise ValueError(f"job {spec.job} is already {old.state.value}")
            record = JobRecord(spec, block=block, on_failure=on_failure)
            self.jobs[spec.job] = record
            self._index_ranks()
            self.plans.reset(spec.job)
            # Kept from now on, not from its launch: a job accepted while its warm launcher still
            # imports torch (seconds) must outlive an agent killed in that time.
            self._persist(record)
        if block is None:
            # A job id used before (by this agent or an earlier one) keeps its logs in the same
            # folder: the new run must not start with the old one's output (``trainguard run``
            # would stream it as its own). A part of a spanning job is a restart, not a new run.
            _set_logs_aside(self.context_for(spec).log_dir)
        if self.on_submit is not None:
            self.on_submit(spec.job)
        self.events.emit("job_submitted", f"job {spec.job} submitted with {spec.nproc} ranks", job=spec.job, nproc=spec.nproc)
        threading.Thread(target=self._launch_safely, args=(record,), name=f"launch-{spec.job}", daemon=True).start()
        return record

    def _launch_safely(self, record: JobRecord) -> None:
        try:
            self._launch(record)
        except Exception as exc:  # noqa: BLE001 - a launch failure is a job failure, not an agent crash
            with self._lock:
                if not record.state.finished:
                    record.reason = f"could not start ranks: {exc}"
                    self._set_state(record, JobState.FAILED)  # kept: a later agent must not start it again
            self.events.emit("job_failed", f"job {record.job}: could not start ranks: {exc}", severity="error", job=record.job, cause=str(exc))

    def _launch(self, record: JobRecord) -> None:
        ctx = self.context_for(record.spec)
        attempt = launch_attempt(record)
        env = self.launch_env(record) if self.launch_env is not None else None
        ranks = self.launcher.start(record.spec, ctx, attempt, env, block=record.block)
        with self._lock:
            if record.state in (JobState.STOPPING, JobState.STOPPED):
                # Stopped while starting: these ranks must not outlive the request.
                self.launcher.stop(ranks, 0.5, hard=True)
                return
            record.attempt = attempt
            record.ranks = ranks
            self._index_ranks()
            if record.state == JobState.RESTARTING:
                self._set_state(record, JobState.STARTING)
            self._set_state(record, JobState.RUNNING)  # writes the record, new ranks included
        self.events.emit(
            "ranks_started",
            f"job {record.job} attempt {record.attempt}: started {len(record.ranks)} ranks",
            job=record.job,
            attempt=record.attempt,
            pids=[r.pid for r in record.ranks],
        )
        self._ranks_changed()
        os.write(self._wake_w, b"x")

    def _set_state(self, record: JobRecord, new: JobState) -> None:
        if record.state == new:
            return
        check_transition(record.state, new)
        record.state = new
        self._persist(record)
        if new.finished:
            record.finished_at = time.time()
            # The job's warm launcher holds torch in memory: let it go with the job.
            threading.Thread(target=self.launcher.close_job, args=(record.job,), daemon=True).start()

    def _persist(self, record: JobRecord) -> None:
        if self.records is not None:
            doc = record.to_dict()
            doc["restored_from"] = record.restored_from
            self.records.save(doc, [(r.rank, r.local_rank, r.pid, r.log_path) for r in record.ranks if r.alive])

    # --- a restarted agent ------------------------------------------------------------------
    def adopt(self, saved: list[SavedJob]) -> None:
        """Take over the jobs a previous agent on this state directory left running: reattach to
        their ranks when every one is still alive, else stop what is left and start the job again
        (``adoption.adopt``)."""
        adoption.adopt(self, saved)

    def signal(self, job: str, signum: int, sender: str) -> int:
        """Forward ``signum`` (what a batch system sends ahead of a step's end) to the job's running
        ranks; how many got it. ``KeyError`` for an unknown job."""
        with self._lock:
            record = self.jobs.get(job)
            if record is None:
                raise KeyError(job)
            ranks = [] if record.state.finished else list(record.ranks)
        sent = self.launcher.signal(ranks, signum)
        name = signal.Signals(signum).name
        self.events.emit("job_signal", f"job {job}: {name} from {sender} forwarded to {sent} rank(s)", job=job,
                         signal=name, ranks=sent, sender=sender)
        return sent

    def stop(self, job: str, reason: str = "requested", *, hard: bool = False) -> JobRecord:
        with self._lock:
            record = self.jobs.get(job)
            if record is None:
                raise KeyError(job)
            if record.state.finished:
                return record
            self._set_state(record, JobState.STOPPING)
            record.reason = reason
        self.events.emit("job_stopping", f"stopping job {job}: {reason}", job=job, cause=reason)
        self.launcher.stop(record.ranks, self.stop_grace_s, hard=hard)
        with self._lock:
            self._set_state(record, JobState.STOPPED)
        self.events.emit("job_stopped", f"job {job} stopped", job=job, cause=reason)
        self._ranks_changed()
        return record

    def stop_all(self, reason: str) -> None:
        for job in list(self.jobs):
            if not self.jobs[job].state.finished:
                self.stop(job, reason)

    def forget_finished(self, older_than_s: float, now: float | None = None,
                        before: Callable[[str], None] | None = None) -> list[str]:
        """Drop jobs that ended more than ``older_than_s`` ago; returns their ids. ``before(job)``
        runs first for each (outside the lock), so that whatever else tells of the job (its
        metrics) is gone by the time the job leaves the status."""
        now = time.time() if now is None else now
        with self._lock:
            due = {j: r.finished_at for j, r in self.jobs.items()
                   if r.state.finished and r.finished_at is not None and now - r.finished_at >= older_than_s}
        if before is not None:
            for job in due:
                before(job)
        gone = []
        with self._lock:
            for job, finished_at in due.items():
                record = self.jobs.get(job)
                if record is None or not record.state.finished or record.finished_at != finished_at:
                    continue  # submitted again meanwhile
                del self.jobs[job]
                if self.records is not None:
                    self.records.forget(job)
                gone.append(job)
            self._index_ranks()
        return gone

    def note_progress(self, job: str, step: int) -> None:
        record = self.jobs.get(job)
        if record is not None and step > record.progress_step:
            record.progress_step = step

    def tracked(self) -> dict[int, TrackedProcess]:
        with self._lock:
            return {
                r.pid: TrackedProcess(r.pid, rec.job, r.rank, r.local_rank, r.gpu)
                for rec in self.jobs.values()
                for r in rec.ranks
                if r.alive
            }

    def find_rank(self, pid: int) -> tuple[JobRecord, RankProcess] | None:
        """The job and rank of process ``pid`` (ranks of ended attempts included), without the
        lock: the eBPF exit events of a restart's survivors ask while the restart holds it."""
        return self._by_pid.get(pid)

    def _index_ranks(self) -> None:
        """Called with the lock held wherever a job's ranks change: a new index, swapped in whole."""
        self._by_pid = {r.pid: (rec, r) for rec in self.jobs.values() for r in rec.ranks}

    def _ranks_changed(self) -> None:
        if self.on_ranks_changed is not None:
            self.on_ranks_changed(self.tracked())

    # --- failure handling --------------------------------------------------------------------
    def on_exit_event(self, pid: int, fields: dict[str, Any]) -> None:
        """Fast path from the eBPF exit event: wake the monitor so it reaps now."""
        found = self.find_rank(pid)
        if found is not None:
            handle = found[1].popen
            # Ranks no waitpid of ours or their launcher's will report: adopted ones, and those
            # whose warm launcher died.
            if isinstance(handle, (AdoptedProcess, ZygoteChild)) and handle.status_hint is None:
                sig, code = fields.get("signal"), fields.get("exit_code")
                status = -int(sig) if sig else (int(code) if isinstance(code, int) else None)
                if isinstance(handle, ZygoteChild):
                    handle.exit_seen(status)
                else:
                    handle.status_hint = status
            os.write(self._wake_w, b"x")

    def relaunch(self, job: str, block: RankBlock, spec: JobSpec, cause: str) -> None:
        """Start this node's ranks of a spanning job for a new leader-decided attempt (stopping
        the previous attempt's ranks first)."""
        with self._lock:
            record = self.jobs.get(job)
            if record is None or record.state.finished or record.state == JobState.STOPPING:
                raise ValueError(f"job {job} is not active here")
            if record.state != JobState.RESTARTING:
                self._set_state(record, JobState.RESTARTING)
            self.launcher.stop(record.ranks, min(self.stop_grace_s, 2.0), hard=True)
            record.restarts += 1
            self.restart_total += 1
            record.spec, record.block = spec, block
            self.events.emit("job_restart", f"job {job}: restarting ranks {block.rank_offset}-"
                             f"{block.rank_offset + block.nproc - 1} of {block.world_size} (attempt {launch_attempt(record)})",
                             severity="warning", job=job, cause=cause, action="restart")
        self._launch(record)

    def hold(self, job: str) -> JobRecord | None:
        """Stop the ranks of a job whose next attempt someone else decides (``rdzvjobs``) and
        leave it restarting until that attempt is handed here; None for an unknown job."""
        with self._lock:
            record = self.jobs.get(job)
            if record is None or record.state.finished or record.state == JobState.STOPPING:
                return record
            if record.state != JobState.RESTARTING:
                self._set_state(record, JobState.RESTARTING)
            self.launcher.stop(record.ranks, min(self.stop_grace_s, 2.0), hard=True)
        return record

    def restart(self, job: str, cause: str, *, spec: JobSpec | None = None) -> None:
        """Stop what is left of the job and start every rank again (same world size, or the
        given ``spec``: a smaller world without an excluded rank)."""
        report: Callable[[str, str], None] | None = None
        with self._lock:
            record = self.jobs.get(job)
            if record is None or record.state.finished or record.state == JobState.STOPPING:
                return
            if record.on_failure is not None:
                # Part of a job spanning nodes: the other nodes' ranks must restart too, at the same
                # attempt and rendezvous; only the leader can order that.
                if record.state == JobState.RESTARTING:
                    return
                self._set_state(record, JobState.RESTARTING)
                self.launcher.stop(record.ranks, min(self.stop_grace_s, 2.0), hard=True)
                report = record.on_failure
        if report is not None:
            who = "trainguard run" if record.block is not None and record.block.rendezvous else "the cluster leader"
            self.events.emit("job_restart_requested", f"job {job}: {cause}; local ranks stopped, "
                             f"asking {who} to restart every node's ranks",
                             severity="warning", job=job, cause=cause, action="restart")
            report(job, cause)
            return
        with self._lock:
            no_progress = record.progress_step <= record.step_at_last_restart
            record.restarts_without_progress = record.restarts_without_progress + 1 if no_progress else 1
            if record.restarts_without_progress > record.spec.max_restarts:
                self._set_state(record, JobState.STOPPING)
                self.launcher.stop(record.ranks, self.stop_grace_s, hard=True)
                # Reason and event first: a reader that sees FAILED must also find why.
                record.reason = f"crash loop: {record.restarts_without_progress - 1} restarts without progress"
                self.events.emit(
                    "crash_loop",
                    f"job {job}: giving up after {record.restarts_without_progress - 1} restarts without progress",
                    severity="critical",
                    job=job,
                    cause=cause,
                )
                self._set_state(record, JobState.FAILED)
                self._ranks_changed()
                return
            self._set_state(record, JobState.RESTARTING)
            record.step_at_last_restart = record.progress_step
            if self.before_survivors_stop is not None and any(not r.alive for r in record.ranks):
                self.before_survivors_stop(record)
            self.launcher.stop(record.ranks, min(self.stop_grace_s, 2.0), hard=True)
            record.restarts += 1
            self.restart_total += 1
            if spec is not None:
                record.spec = spec
            self.events.emit(
                "job_restart",
                f"job {job}: restarting all ranks (attempt {record.attempt + 1})",
                severity="warning",
                job=job,
                cause=cause,
                action="restart",
            )
        try:
            self._launch(record)
        except Exception as exc:  # noqa: BLE001
            with self._lock:
                record.reason = f"could not restart ranks: {exc}"
                record.state = JobState.FAILED
            self.events.emit("job_failed", f"job {job}: could not restart ranks: {exc}", severity="error", job=job, cause=str(exc))

    def _reap_soon(self, record: JobRecord, within_s: float) -> list[RankProcess]:
        """Ranks of ``record`` that end within ``within_s`` (stops early once one ends with a
        status other than 1, or none is left)."""
        ended: list[RankProcess] = []
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline and any(r.alive for r in record.ranks):
            now_ended = self.launcher.reap(record.ranks)
            for r in now_ended:
                _close_pidfd(r)
            ended += now_ended
            if any(r.exit_code not in (0, 1) for r in now_ended):
                break
            time.sleep(0.02)
        return ended

    def _handle_exits(self, record: JobRecord, ended: list[RankProcess]) -> None:
        self._handle_exit_events(record, ended)
        self._judge_exits(record, ended)

    def _handle_exit_events(self, record: JobRecord, ended: list[RankProcess]) -> None:
        for r in ended:
            record.exit_codes[r.rank] = r.exit_code
            failed = r.exit_code != 0
            how = f"signal {r.exit_signal}" if r.exit_signal else f"code {r.exit_code}"
            source = getattr(r.popen, "status_source", "")
            if isinstance(r.popen, ZygoteChild) and r.popen.orphaned and source:
                how += f" (its warm launcher had died: status from {source})"
            elif source and source != "ebpf":  # an adopted rank's status that no exit event brought
                how += f" (adopted rank: status from {source})"
            self.events.emit(
                "rank_exit",
                f"job {record.job} rank {r.rank} (pid {r.pid}) exited with {how}",
                severity="error" if failed else "info",
                job=record.job,
                rank=r.rank,
                pid=r.pid,
                exit_code=r.exit_code,
                signal=r.exit_signal,
                cause="rank_crash" if failed else "",
            )

    def _judge_exits(self, record: JobRecord, ended: list[RankProcess]) -> None:
        if record.state in (JobState.STOPPING, JobState.RESTARTING):
            return
        if any(r.exit_code not in (0, None) for r in ended):
            dead = [r for r in ended if r.exit_code != 0]
            if all(r.exit_code == 1 for r in dead) and any(r.alive for r in record.ranks):
                # Exit 1 is how a rank dies of a peer's death (its collective raised). The peer
                # that failed first may still be in its interpreter's teardown: give it a moment to
                # end on its own, so its status, not the symptom's, becomes the job's.
                late = self._reap_soon(record, PEER_EXIT_GRACE_S)
                self._handle_exit_events(record, late)
                dead += [r for r in late if r.exit_code != 0]
            # Reaped together, the rank that failed first is the likelier one not to exit 1: its peers
            # die of the broken collective with a Python error (exit 1) right after it.
            first = next((r for r in dead if r.exit_code != 1), dead[0])
            record.failure_code = first.exit_code
            dead = [first, *[r for r in dead if r is not first]]
            self._diagnose_unreachable(record, dead)
            self.restart(record.job, cause=f"rank {dead[0].rank} died")
        elif all(not r.alive for r in record.ranks) and all(r.exit_code == 0 for r in record.ranks):
            # The event first: a reader that sees SUCCEEDED must also find it.
            self.events.emit("job_succeeded", f"job {record.job} finished", job=record.job)
            self._set_state(record, JobState.SUCCEEDED)
            self._ranks_changed()

    def _diagnose_unreachable(self, record: JobRecord, dead: list[RankProcess]) -> None:
        """Name the peer a failed rank could not reach (from its log's last lines), once per
        address and failure, for the first few dead ranks: the usual reason a job spanning nodes
        crash-loops at its process-group set-up."""
        seen: set[tuple[str, int | None]] = set()
        for r in dead[:MAX_DIAGNOSED_RANKS]:
            try:
                found = diagnose(read_tail(r.log_path), self.peer_node_of)
            except Exception:  # noqa: BLE001 - a diagnosis must never stop the restart
                continue
            if found is None or (found.address, found.port) in seen:
                continue
            seen.add((found.address, found.port))
            self.events.emit("rank_peer_unreachable", found.message(record.job, r.rank), severity="error",
                             job=record.job, rank=r.rank, cause="peer_unreachable",
                             attempt=record.block.attempt if record.block is not None else 0, **found.fields())

    def _monitor(self) -> None:
        while not self._stopping.is_set():
            health.beat(self, "rank-monitor")
            try:
                self._monitor_once()
            except Exception as exc:  # noqa: BLE001 - one bad record must not end supervision of every job
                health.failed(self, "rank-monitor", exc)
                self._stopping.wait(0.1)  # a failure that repeats at once must not spin
        health.stopped(self, "rank-monitor")

    def _monitor_once(self) -> None:
        with self._lock:
            fds: dict[int, tuple[JobRecord, RankProcess]] = {}
            waiting = False
            for rec in self.jobs.values():
                for r in rec.ranks:
                    if not r.alive:
                        continue
                    if r.pidfd_fired:
                        # Its process ended and its status has not come (a warm launcher's rank
                        # whose zygote has not reported yet): polled again, its pidfd would
                        # answer at once, a busy loop (~800-1,300 rounds a kill on the recovery
                        # bench) that held the GIL from the very thread that brings the report.
                        waiting = True
                        continue
                    fd = r.pidfd
                    if fd is None:
                        try:
                            fd = os.pidfd_open(r.pid)
                        except OSError:
                            fd = -1
                        r.pidfd = fd
                    if fd >= 0:
                        fds[fd] = (rec, r)
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        for fd in fds:
            poller.register(fd, select.POLLIN)
        # Statuses still to come are looked for every few ms (the eBPF exit event wakes at once).
        ready = poller.poll(STATUS_POLL_MS if waiting else 500)
        if any(fd == self._wake_r for fd, _ in ready):
            try:
                os.read(self._wake_r, 4096)
            except BlockingIOError:
                pass
        self.reap_all()
        for fd, _ in ready:
            if fd in fds:
                fds[fd][1].pidfd_fired = True

    def reap_all(self) -> None:
        with self._lock:
            for rec in list(self.jobs.values()):
                try:
                    ended = self.launcher.reap(rec.ranks)
                    for r in ended:
                        _close_pidfd(r)
                    if ended:
                        self._handle_exits(rec, ended)
                except Exception as exc:  # noqa: BLE001 - one job's fault must not stop reaping the others
                    health.failed(self, "rank-monitor", exc)

    def close(self) -> None:
        self._stopping.set()
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass
        self._thread.join(timeout=2)

    def status(self) -> list[dict[str, Any]]:
        with self._lock:
            return [rec.to_dict() for rec in self.jobs.values()]
