"""Recovery on the agent: watches jobs for hangs and loss divergence once per tick, and decides
what every (re)start of a job restores from.

* Rank exit: the supervisor restarts all ranks (instantly, from the warm launcher); here we pick
  the newest verified checkpoint across tiers (fastest tier first) and hand it to the ranks.
* Hang: Python stacks of every rank (py-spy) go into the event, then the job restarts. The
  embedded trainer is hung when no rank advanced its step for long enough (or never reached its
  first step). A user's command is judged only on what it gives: with step telemetry
  (``trainguard.init()``), a step stall while its ranks use no CPU; with ``--hang-timeout``, ranks
  that used no CPU for that long (``agent.detect.activity``). A silent script is never hung.
* Loss NaN/spike: roll back to the newest checkpoint before the divergence and cut the LR
  (``agent.heal.rollback``).

The detectors are agent.detect's; the actions other parts take (excluding a rank) are agent.heal's.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client.metrics_core import Metric

from trainguard.agent.checkpoint import CheckpointManager, CheckpointSettings, ObjectStoreConfig, Restored
from trainguard.agent.checkpoint.snapshots import SnapshotSet
from trainguard.agent.config import AgentConfig, apply_state_dir
from trainguard.agent.detect.activity import ActivityProbe, descends_from
from trainguard.agent.detect.divergence import LossDetector
from trainguard.agent.detect.finding import Finding
from trainguard.agent.detect.hang import HangDetector
from trainguard.agent.detect.stacks import probe_all
from trainguard.agent.eventlog import EventLog
from trainguard.agent.heal.counts import ActionCounts
from trainguard.agent.heal.rollback import Rollback
from trainguard.agent.lifecycle.jobrecord import JobRecord
from trainguard.agent.lifecycle.jobs import JobState
from trainguard.agent.lifecycle.supervisor import Supervisor
from trainguard.agent.metricspec import MetricSpec
from trainguard.agent.paths import agent_tag
from trainguard.agent.ranktable import RankTable
from trainguard.agent.wire import CKPT_FAILED_ELSEWHERE, PART_MARK
from trainguard.run.environment import ENV_SNAPSHOT_DIR, ENV_SNAPSHOT_EVERY, ENV_SNAPSHOT_STEP

if TYPE_CHECKING:
    from trainguard.agent.daemon import Agent  # the daemon imports this module: only its type here

log = logging.getLogger("trainguard.recovery")

ACTIONS = MetricSpec(
    "trainguard_heal_actions_total", "counter", "", ("job", "action", "cause"), "Healing actions taken, by action and cause."
)
DETECTIONS = MetricSpec(
    "trainguard_failures_detected_total", "counter", "", ("job", "kind"), "Failures detected (rank_exit, hang, loss_diverged, oom_kill, ...)."
)
RECOVERY_SECONDS = MetricSpec(
    "trainguard_recovery_last_seconds", "gauge", "seconds", ("job",), "Failure detection to the first step of the restarted ranks, last recovery."
)
METRICS = (ACTIONS, DETECTIONS, RECOVERY_SECONDS)

ENV_RESTORE = "TRAINGUARD_RESTORE"
ENV_RESTORE_STEP = "TRAINGUARD_RESTORE_STEP"
SNAPSHOT_SETTLE_S = 1.0
"""The most the agent waits, after a rank died, for its peers to finish the snapshot of the step
the dead rank completed (their copy takes milliseconds; a peer that cannot finish costs this)."""


def memory_root_for(cfg: AgentConfig) -> str:
    if cfg.checkpoint.memory_root:
        return cfg.checkpoint.memory_root
    return f"/dev/shm/trainguard-{agent_tag(cfg.agent.state_dir)}"


def default_memory_root(state_dir: str) -> str:
    """The memory tier of an agent run with ``--state-dir state_dir`` and no memory root of its own
    (kept in RAM across the agent's restarts: whoever is done with that agent removes it)."""
    return memory_root_for(apply_state_dir(AgentConfig(), state_dir))


def checkpoint_settings(cfg: AgentConfig) -> CheckpointSettings:
    c = cfg.checkpoint
    obj = None
    if c.object.url:
        obj = ObjectStoreConfig(
            url=c.object.url, endpoint_url=c.object.endpoint_url, key=c.object.key, secret=c.object.secret, region=c.object.region
        )
    return CheckpointSettings(
        memory_root=memory_root_for(cfg),
        memory_interval=c.memory_every,
        memory_keep=c.memory_keep,
        disk_dir=c.disk_dir or os.path.join(cfg.agent.state_dir, "checkpoints"),
        disk_interval=c.disk_every,
        disk_keep=c.disk_keep,
        object_store=obj,
        object_interval=c.object_every,
        object_keep=c.object_keep,
    )


TIMELINE_PHASES = ("detect_s", "teardown_s", "fork_s", "startup_s", "rendezvous_s", "setup_s", "restore_s",
                   "first_step_s")
"""The phases of a recovery's timeline in order (``recovery_timeline``); the job_resumed event's
``timeline`` holds those someone reported."""


def recovery_timeline(failed_at: float, launched_at: float | None, window: list[Any], first_step_at: float,
                      died_at: float | None = None) -> dict[str, float]:
    """Where the time from a failure to the first resumed step went, as the lead rank saw it:
    detect (the kernel saw the rank die, ``died_at`` -> the supervisor saw its exit, ``failed_at``),
    teardown (-> the new ranks' launch: stopping the survivors, picking the restore), fork (-> the
    rank's process exists, or the warm launcher's spare that becomes it is handed its work),
    startup (-> the script's own start-up ends: imports, building a model or a Hugging Face Trainer,
    up to its ``init_process_group`` where the rank timed that, else up to ``trainguard.init``, a
    rendezvous before it included), rendezvous (-> ``init_process_group`` returned, where timed),
    setup (-> its restore begins), restore, first step. Phases no one reported are left out."""
    marks: dict[str, float] = {}
    for msg in window:
        for name in ("proc_start", "init_at", "rdzv_begin", "group_ready", "restore_begin", "restore_end"):
            value = getattr(msg, name, None)
            if value is not None:
                marks.setdefault(name, value)
    script_end = marks.get("rdzv_begin") if "group_ready" in marks else None
    ends = (failed_at if died_at is not None else None, launched_at, marks.get("proc_start"),
            script_end or marks.get("init_at"), marks.get("group_ready") if script_end else None,
            marks.get("restore_begin"), marks.get("restore_end"), first_step_at)
    points = list(zip(TIMELINE_PHASES, ends, strict=True))
    out: dict[str, float] = {}
    previous = died_at if died_at is not None else failed_at
    for name, at in points:
        if at is None:
            continue
        out[name] = round(max(0.0, at - previous), 4)
        previous = at
    return out


DEATH_BEFORE_EXIT_S = 5.0
"""How long before the supervisor's word of a failed rank the kernel's word of its death may come
and still be that failure's (the supervisor reaps within milliseconds; a death this much older
was not reported as a failure: a rank stopped on purpose)."""

SECONDHAND_WAIT_S = 5.0
"""How long a save failure reported only as another rank's waits for that rank's own report."""


class RecoveryService:
    """Judges every running job once per tick, heals what it finds (a hung job restarts with its
    stacks in the event, a diverged one rolls back), times each recovery and picks what every start
    of a job restores. Its collaborators are the agent's parts it uses, not the agent."""

    def __init__(self, config: Callable[[], AgentConfig], events: EventLog, supervisor: Supervisor,
                 table: RankTable, checkpoints: CheckpointManager, rollback: Rollback, counts: ActionCounts) -> None:
        self.config = config
        """The agent's configuration in force, read at each use (a reload takes effect)."""
        self.cfg = config().recovery
        self.events = events
        self.supervisor = supervisor
        self.table = table
        self.checkpoints = checkpoints
        self.rollback = rollback
        """Restarts a diverged job from an older checkpoint (agent.heal.rollback)."""
        self.counts = counts
        self.hangs = HangDetector(self.cfg.hang_factor, self.cfg.hang_floor_s, self.cfg.startup_timeout_s)
        self.losses = LossDetector(self.cfg.loss_spike_factor)
        self.activity = ActivityProbe()
        self._failed_saves: set[tuple[str, int]] = set()
        self._secondhand_saves: dict[tuple[str, int], tuple[float, int, str]] = {}
        self._attempt_seen: dict[str, int] = {}
        self._restored: dict[str, Restored] = {}
        self._busy: set[str] = set()
        self._recovering = threading.RLock()
        """Held while a failure's clock starts or stops: the supervisor's thread and the tick both do."""
        self.detections: dict[tuple[str, str], int] = {}
        self._failure_at: dict[str, float] = {}
        self._died_at: dict[str, float] = {}
        """The kernel's time of the first rank death of a failure the supervisor has not seen yet,
        or of the one its clock runs for (``note_death``)."""
        self._launch_at: dict[str, float] = {}
        self._rolled_back_from = rollback.rolled_back_from
        """Steps each job diverged after restoring: no later start of the job picks them again."""
        self.last_recovery_s: dict[str, float] = {}
        self._settled_s: dict[str, float] = {}

    # --- hooks the daemon installs --------------------------------------------------------------
    def before_survivors_stop(self, record: JobRecord) -> None:
        """Called by the supervisor when ranks of a job died, before it kills the rest."""
        if not self.config().checkpoint.snapshots or record.block is not None:
            return
        dead = [r.rank for r in record.ranks if not r.alive and r.exit_code != 0]
        alive = [r.rank for r in record.ranks if r.alive]
        if not dead or not alive:
            return
        snapshots = SnapshotSet(self.checkpoints.settings.memory_root, record.job)
        waited = snapshots.settle(dead, alive, record.spec.nproc, SNAPSHOT_SETTLE_S)
        if waited > 0.001:
            self._settled_s[record.job] = round(waited, 4)

    def launch_env(self, record: JobRecord) -> dict[str, str]:
        """Called by the supervisor before every start of a job's ranks."""
        job = record.job
        self._launch_at[job] = time.time()
        old = self._restored.pop(job, None)
        if old is not None:
            old.release()
        self._clean_staging(job)
        try:
            self.checkpoints.prepare_job(job)
        except OSError as exc:
            self.events.emit("agent_dir_refused", f"job {job}: cannot prepare its memory-tier directories: "
                             f"{exc}", severity="error", job=job, error=str(exc))
        env = {
            "TRAINGUARD_CKPT_MEMORY_ROOT": self.checkpoints.settings.memory_root,
            "TRAINGUARD_CKPT_MEMORY_EVERY": str(self.checkpoints.settings.memory_interval),
            "TRAINGUARD_LR_BATCH_RULE": self.config().controller.lr_batch_rule,
        }
        if record.block is not None and record.block.rendezvous:
            return self._rendezvous_env(record, env)
        if record.block is not None:
            # A job spanning nodes: the cluster leader chose the step and this agent assembled it
            # from the nodes' parts (``agent.cluster.gang``); the block carries the result.
            record.restored_from = record.block.restore
            record.restore_max_step = None
            if record.block.restore is not None:
                self.events.emit(
                    "restore_selected",
                    f"job {job}: ranks restore step {record.block.restore['step']} assembled from the "
                    f"parts of nodes {', '.join(sorted(record.block.restore.get('parts', {})))}",
                    job=job, tier="assembled", step=record.block.restore["step"],
                    parts=record.block.restore.get("parts", {}),
                )
            return env
        snapshots = SnapshotSet(self.checkpoints.settings.memory_root, job)
        snap_step = None
        excluded = self._rolled_back_from.get(job, set())
        if self.config().checkpoint.snapshots:
            every = self.config().checkpoint.snapshot_every
            env[ENV_SNAPSHOT_DIR] = str(snapshots.dir)
            env[ENV_SNAPSHOT_EVERY] = str(every) if every > 0 else "auto"
            # The same world size only: a snapshot is one rank's own state, not reshardable. Its
            # tensor bytes are checked against their crc32 first: a damaged slot falls back.
            snap_step = snapshots.common_step(record.spec.nproc, max_step=record.restore_max_step,
                                              exclude=excluded, verify=True)
            self._tell_snapshot_problems(job, snapshots)
        try:
            restored = self.checkpoints.restore(job, max_step=record.restore_max_step, exclude=excluded)
        except Exception as exc:  # noqa: BLE001 - no checkpoint is better than no job
            self.events.emit("checkpoint_restore_failed", f"job {job}: cannot restore: {exc}", severity="error", job=job)
            restored = None
        record.restore_max_step = None
        if restored is not None:
            self._restored[job] = restored
            env[ENV_RESTORE] = str(restored.path)
        settled_s = self._settled_s.pop(job, None)
        if snap_step is not None and (restored is None or snap_step >= restored.info.step):
            snapshots.keep_only(snap_step)
            env[ENV_SNAPSHOT_STEP] = str(snap_step)
            fallback = {"tier": restored.tier, "step": restored.info.step} if restored is not None else None
            record.restored_from = {"tier": "snapshot", "step": snap_step, "path": str(snapshots.dir), "fallback": fallback}
            self.events.emit(
                "restore_selected",
                f"job {job}: ranks restore step {snap_step} from their snapshots in shared memory"
                + (f" (fallback: step {restored.info.step} from the {restored.tier} tier)" if restored is not None else "")
                + (f"; waited {settled_s * 1000:.0f} ms for the survivors to finish that snapshot" if settled_s else ""),
                job=job, tier="snapshot", step=snap_step, fallback=fallback, settled_s=settled_s or 0.0,
            )
            return env
        # The job goes on from an older checkpoint (or from scratch): no slot of the attempt that
        # ended may be restored later, nor confuse which slot the new ranks overwrite.
        snapshots.clear()
        if restored is None:
            record.restored_from = None
            return env
        record.restored_from = {"tier": restored.tier, "step": restored.info.step, "path": str(restored.path)}
        self.events.emit(
            "restore_selected",
            f"job {job}: ranks restore step {restored.info.step} from the {restored.tier} tier",
            job=job,
            tier=restored.tier,
            step=restored.info.step,
        )
        return env

    def _rendezvous_env(self, record: JobRecord, env: dict[str, str]) -> dict[str, str]:
        """This node's ranks of a ``trainguard run --nnodes`` round: they snapshot as on one node
        and restore the step every node's ranks hold, which the nodes agreed at the rendezvous."""
        assert record.block is not None
        job, step = record.job, record.block.snapshot_step
        snapshots = SnapshotSet(self.checkpoints.settings.memory_root, job)
        record.restore_max_step = None
        if not self.config().checkpoint.snapshots:
            record.restored_from = None
            return env
        every = self.config().checkpoint.snapshot_every
        env[ENV_SNAPSHOT_DIR] = str(snapshots.dir)
        env[ENV_SNAPSHOT_EVERY] = str(every) if every > 0 else "auto"
        if step is None:
            snapshots.clear()  # a new world or no step common to every node
            return self._rendezvous_checkpoint(record, env)
        snapshots.keep_only(step)
        env[ENV_SNAPSHOT_STEP] = str(step)
        record.restored_from = {"tier": "snapshot", "step": step, "path": str(snapshots.dir), "fallback": None}
        self.events.emit("restore_selected", f"job {job}: ranks restore step {step} from their snapshots in "
                         "shared memory (the newest step every node's ranks hold)",
                         job=job, tier="snapshot", step=step, fallback=None, settled_s=0.0)
        return env

    def _rendezvous_checkpoint(self, record: JobRecord, env: dict[str, str]) -> dict[str, str]:
        """The whole checkpoint the nodes agreed on (``restore_step``): a node that holds it hands
        its ranks the local copy, which they send to the ranks of the nodes that do not."""
        assert record.block is not None
        job, step = record.job, record.block.restore_step
        record.restored_from = None
        if step is None:
            return env  # nothing every node can resume from: from scratch
        env[ENV_RESTORE_STEP] = str(step)
        if not record.block.restore_here:
            record.restored_from = {"tier": "other node", "step": step}
            self.events.emit("restore_selected", f"job {job}: ranks restore step {step}, sent by the ranks "
                             "of the node(s) that hold it", job=job, tier="other node", step=step)
            return env
        try:
            restored = self.checkpoints.restore(job, max_step=step)
        except Exception as exc:  # noqa: BLE001 - the ranks then start afresh, said in the event
            self.events.emit("checkpoint_restore_failed", f"job {job}: cannot restore: {exc}", severity="error",
                             job=job)
            restored = None
        if restored is None or restored.info.step != step:
            if restored is not None:
                restored.release()
            self.events.emit("checkpoint_restore_failed", f"job {job}: the checkpoint of step {step} the "
                             "nodes agreed on no longer verifies here", severity="error", job=job, step=step)
            return env
        self._restored[job] = restored
        env[ENV_RESTORE] = str(restored.path)
        record.restored_from = {"tier": restored.tier, "step": step, "path": str(restored.path)}
        self.events.emit("restore_selected", f"job {job}: ranks restore step {step} from the {restored.tier} "
                         "tier, and send it to the ranks of nodes that do not hold it", job=job,
                         tier=restored.tier, step=step)
        return env

    def _tell_snapshot_problems(self, job: str, snapshots: SnapshotSet) -> None:
        """Slots skipped as forged or damaged: one event each (the count is ``REJECTED``)."""
        for problem in snapshots.problems[:16]:
            self.events.emit("snapshot_corrupt", f"job {job}: snapshot slot skipped: {problem}",
                             severity="error", job=job, tier="snapshot", problem=problem)
        snapshots.problems.clear()

    def _clean_staging(self, job: str) -> None:
        """Saves that ranks of the previous attempt left half-written (they died during one): no rank
        of the job runs now, so every staging directory of it is garbage."""
        memory = self.checkpoints.memory
        keys = [k for k in memory.jobs() if k == job or k.startswith(job + PART_MARK)]
        removed = sum(memory.cleanup_job_tmp(k) for k in keys)
        if removed:
            self.events.emit("checkpoint_tmp_cleaned", f"job {job}: removed {removed} half-written memory "
                             "checkpoint(s) of ranks that died during a save", job=job, tier="memory",
                             removed=removed)

    def _note_save_failures(self, job: str, ranks: list[Any], now: float) -> None:
        """Checkpoints the ranks could not write (they skip them and train on): one event per
        checkpoint, with the error of the rank that had it, and the tier's failure count (the alert).
        A rank that only knows another rank failed may report first (the failing one can be rank 0,
        whose write runs in the background); its word waits ``SECONDHAND_WAIT_S`` for the cause."""
        for view in sorted(ranks, key=lambda v: v.rank):
            for msg in self.table.window(job, view.rank, 64):
                if msg.ckpt_failed is None or (key := (job, msg.ckpt_failed)) in self._failed_saves:
                    continue
                error = msg.ckpt_error or "unknown error"
                if error == CKPT_FAILED_ELSEWHERE:
                    self._secondhand_saves.setdefault(key, (now, view.rank, error))
                    continue
                self._save_failed(job, msg.ckpt_failed, view.rank, error)
        self._tell_secondhand(job, now - SECONDHAND_WAIT_S)

    def _tell_secondhand(self, job: str, seen_by: float) -> None:
        """Secondhand save failures of ``job`` first seen at or before ``seen_by``, told as they are."""
        for (owner, step), (seen, rank, error) in list(self._secondhand_saves.items()):
            if owner == job and seen <= seen_by:
                self._save_failed(job, step, rank, error)

    def _save_failed(self, job: str, step: int, rank: int, error: str) -> None:
        self._failed_saves.add((job, step))
        self._secondhand_saves.pop((job, step), None)
        self.checkpoints.status.observe_failure("memory", error)
        self.events.emit(
            "checkpoint_write_failed", f"job {job}: rank {rank} could not write the memory "
            f"checkpoint of step {step} ({error}); training goes on without it",
            severity="error", job=job, rank=rank, tier="memory", step=step, error=error)

    def tick(self, _agent: Agent, now: float) -> None:
        try:
            self.checkpoints.poll()
        except Exception as exc:  # noqa: BLE001
            log.warning("checkpoint poll failed: %s", exc)
        snapshot = self.table.snapshot()
        for record in list(self.supervisor.jobs.values()):
            job = record.job
            if record.state != JobState.RUNNING or job in self._busy:
                if record.state.finished:
                    if job in self._failure_at and job not in self._busy:
                        # An attempt that resumed and ended between two ticks still resumed (told
                        # at the first tick after the end: the ranks' last telemetry is in by then).
                        self._note_recovered(job, record, self._attempt_ranks(record, snapshot), now)
                    self._finish(job)
                continue
            if self._attempt_seen.get(job) != record.attempt:
                self._attempt_seen[job] = record.attempt
                self.hangs.reset(job, now)
            attempt_ranks = self._attempt_ranks(record, snapshot)
            max_step = max((v.step for v in attempt_ranks), default=-1)
            self._note_recovered(job, record, attempt_ranks, now)
            self._note_save_failures(job, attempt_ranks, now)
            medians = [v.median_step_s for v in attempt_ranks if v.median_step_s]
            if record.spec.is_command:
                finding = self._command_hang(record, max_step, max(medians) if medians else None, now)
            else:
                finding = self.hangs.check(job, max_step, max(medians) if medians else None, now)
            if finding is None and attempt_ranks:
                lead = min(attempt_ranks, key=lambda v: v.rank)
                # Every step since the last tick (a fast job runs many per tick; a NaN among them counts).
                window = self.table.window(job, lead.rank, self.config().telemetry.ring)
                finding = self.losses.observe(job, [(t.step, t.loss) for t in window if t.pid == lead.pid and t.has_loss])
            if finding is not None:
                self._handle(record, finding)

    @staticmethod
    def _attempt_ranks(record: JobRecord, snapshot: Any) -> list[Any]:
        """The rank views of the job's current attempt (a user's command: its processes' too)."""
        pids = {r.pid for r in record.ranks}
        return [v for v in snapshot.jobs.get(record.job, {}).values()
                if v.pid in pids or (record.spec.is_command and descends_from(v.pid, pids))]

    def _command_hang(self, record: JobRecord, max_step: int, median_step_s: float | None,
                      now: float) -> Finding | None:
        """A user's command: hung only on the evidence it gives (see the module docstring)."""
        job, spec = record.job, record.spec
        if spec.hang_timeout_s <= 0 and max_step < 0:
            return None  # silent and no --hang-timeout: nothing to judge, no /proc scan
        idle = self.activity.observe(job, [r.pid for r in record.ranks if r.alive], now, progress=max_step)
        if spec.hang_timeout_s > 0 and idle >= spec.hang_timeout_s:
            self.activity.forget(job)
            return Finding("hang", job, f"no rank used the CPU for {idle:.1f}s (--hang-timeout "
                           f"{spec.hang_timeout_s:g}s)", max(max_step, 0),
                           {"idle_s": round(idle, 3), "hang_timeout_s": spec.hang_timeout_s, "signal": "cpu_activity"})
        if max_step < 0:
            return None  # no step reported yet in this attempt: silence is not a hang
        stalled = self.hangs.check(job, max_step, median_step_s, now)
        if stalled is not None and idle < float(stalled.evidence.get("limit_s", 0.0)):
            # The steps stopped but the ranks compute (a long evaluation, a final save): not hung.
            self.hangs.forget(job)
            self.hangs.check(job, max_step, median_step_s, now)
            return None
        return stalled

    def _note_recovered(self, job: str, record: JobRecord, ranks: list[Any], now: float) -> None:
        with self._recovering:
            self._note_recovered_locked(job, record, ranks, now)

    def _note_recovered_locked(self, job: str, record: JobRecord, ranks: list[Any], now: float) -> None:
        started = self._failure_at.get(job)
        if started is not None and self._launch_at.get(job, float("-inf")) < started:
            # No attempt started here since the failure (this node stopped or fenced its copy, the
            # job goes on elsewhere): the ranks in view trained before it, nothing resumed.
            return
        restored_step = (record.restored_from or {}).get("step", -1)
        if started is not None and ranks and all(v.step > restored_step for v in ranks):
            # The first step of the new attempt by its own clock, not this tick's: ticks are coarse.
            pids = {v.pid for v in ranks}
            lead = min(ranks, key=lambda v: v.rank)
            window = [t for t in self.table.window(job, lead.rank, 256) if t.pid in pids and t.step > restored_step]
            first = min((t.wall_time for t in window), default=time.time())
            # The ranks' own word of where they went on: the first step they reported after the
            # restore (counted as checkpoints count steps done; the restored step + 1 when they
            # resumed where the restore put them), not the newest step seen by this tick.
            first_step = min((t.step - t.steps + 1 for t in window), default=None)
            died = self._died_at.pop(job, None)
            if died is not None and not started - DEATH_BEFORE_EXIT_S <= died <= started:
                died = None  # not this failure's: a death the supervisor never reported as one
            took = first - (died if died is not None else started)
            self.last_recovery_s[job] = took
            del self._failure_at[job]
            timeline = recovery_timeline(started, self._launch_at.get(job), window, first, died)
            origin = f"from step {restored_step} (restored)" if restored_step >= 0 else "from scratch"
            self.events.emit(
                "job_resumed",
                f"job {job} training again {origin}, first step reported {first_step if first_step is not None else '?'}, "
                f"{took:.2f}s after the failure"
                + (" (" + ", ".join(f"{k.removesuffix('_s')} {v:.3f}s" for k, v in timeline.items()) + ")" if timeline else ""),
                job=job,
                first_step_after_restore=first_step,
                restored_step=restored_step if restored_step >= 0 else None,
                recovery_s=round(took, 3),
                restored_from=record.restored_from,
                timeline=timeline,
            )
            restored = self._restored.pop(job, None)
            if restored is not None:
                restored.release()

    def note_failure(self, job: str, kind: str, when: float | None = None) -> None:
        """A failure the supervisor or a collector saw (rank exit, OOM): start the recovery clock.
        An attempt that resumed and failed again between two ticks still resumed: that is told
        first, so that this failure's clock starts now, not at the one before. (Only an attempt
        launched after that failure: the other ranks' exits, an OOM kill or a node loss are more
        word of the same failure.)"""
        with self._recovering:
            record = self.supervisor.jobs.get(job)
            relaunched = self._launch_at.get(job, 0.0) > self._failure_at.get(job, float("inf"))
            if relaunched and job not in self._busy and record is not None:
                self._note_recovered_locked(job, record, self._attempt_ranks(record, self.table.snapshot()),
                                            time.time())
            self._failure_at.setdefault(job, when if when is not None else time.time())
        key = (job, kind)
        self.detections[key] = self.detections.get(key, 0) + 1

    def note_death(self, job: str, died_at: float) -> None:
        """The kernel saw a rank of ``job`` die (the eBPF exit event, ahead of the supervisor's
        reaping): the failure's clock, once the supervisor reports it, counts from the first such
        death, and the resumed event's timeline gets its detection time. Deaths after the clock
        started are its teardown's (the survivors stopped) or more word of the same failure."""
        with self._recovering:
            started = self._failure_at.get(job)
            if started is not None and died_at > started:
                return
            self._died_at[job] = min(died_at, self._died_at.get(job, died_at))

    def _finish(self, job: str) -> None:
        self._failure_at.pop(job, None)  # a job submitted again under this name starts with no failure
        self._rolled_back_from.pop(job, None)
        self._died_at.pop(job, None)
        restored = self._restored.pop(job, None)
        if restored is not None:
            restored.release()
        if self._attempt_seen.pop(job, None) is not None:  # once, not on every tick after the end
            SnapshotSet(self.checkpoints.settings.memory_root, job).remove()
        self.hangs.forget(job)
        self.losses.forget(job)
        self.activity.forget(job)
        self._tell_secondhand(job, float("inf"))  # the job ended before the failing rank's own word came

    def _handle(self, record: JobRecord, finding: Finding) -> None:
        job = record.job
        self.note_failure(job, finding.kind)
        if finding.kind == "hang":
            self._busy.add(job)
            threading.Thread(target=self._heal_hang, args=(record, finding), name=f"hang-{job}", daemon=True).start()
        elif finding.kind == "loss_diverged":
            self.events.emit(
                "loss_diverged", f"job {job}: {finding.message}", severity="error", job=job, cause="loss_divergence", step=finding.step, **finding.evidence
            )
            self.rollback(job, finding.message, before_step=finding.step)

    def _heal_hang(self, record: JobRecord, finding: Finding) -> None:
        job = record.job
        try:
            pids = [r.pid for r in record.ranks if r.alive]
            probes = probe_all(pids)
            ranks = [r for r in record.ranks if r.pid in probes]
            states = ", ".join(f"rank {r.rank} {probes[r.pid].state or 'gone'}" for r in ranks)
            self.events.emit(
                "hang_detected",
                f"job {job}: {finding.message} ({states})",
                severity="error",
                job=job,
                cause="hang",
                step=finding.step,
                stacks={str(r.rank): probes[r.pid].stack or probes[r.pid].error for r in ranks},
                processes={str(r.rank): probes[r.pid].to_dict() for r in ranks},
                **finding.evidence,
            )
            self.counts.add(job, "restart", "hang")
            self.supervisor.restart(job, cause=f"hang: {finding.message}")
        finally:
            self._busy.discard(job)

    # --- reporting -----------------------------------------------------------------------------
    def metrics(self) -> Iterator[Metric]:
        actions = ACTIONS.counter()
        for (job, action, cause), n in self.counts.items():
            actions.add_metric([job, action, cause], n)
        yield actions
        det = DETECTIONS.counter()
        for (job, kind), n in sorted(self.detections.items()):
            det.add_metric([job, kind], n)
        yield det
        rec = RECOVERY_SECONDS.gauge()
        for job, s in sorted(self.last_recovery_s.items()):
            rec.add_metric([job], s)
        yield rec


