"""One object the agent daemon holds for checkpoints: tiers, replication, restore and status.

Wiring: the memory tier is written by the ranks (``stage``/``commit``, in the agent or in the
trainer's rank 0); ``poll`` (once per agent interval) notices new memory checkpoints whoever
committed them, hands them to the replicator and applies the memory retention; ``restore`` picks
the newest verified checkpoint across tiers; ``status``/``metrics``/``catalog`` feed the API and
``/metrics``.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client.metrics_core import Metric

from trainguard.agent.checkpoint.catalog import Restored, newest_restorable, restore
from trainguard.agent.checkpoint.disk import DiskTier
from trainguard.agent.checkpoint.errors import CheckpointError, CheckpointWriteError, describe
from trainguard.agent.checkpoint.local import LocalDirTier
from trainguard.agent.checkpoint.memory import DEFAULT_MEMORY_ROOT, MemoryTier
from trainguard.agent.checkpoint.objectstore import ObjectScope, ObjectStoreConfig, ObjectTier
from trainguard.agent.checkpoint.replicator import TierReplicator
from trainguard.agent.checkpoint.snapshots import SNAPSHOT_DIRNAME, SnapshotSet
from trainguard.agent.checkpoint.status import CheckpointStatus
from trainguard.agent.checkpoint.tier import CheckpointInfo, Tier
from trainguard.agent.safefs import DirCheck, JobOwner, dir_fd, ensure_agent_dir

_STAMP_SETTLED_S = 0.05

EmitFn = Callable[[str, dict[str, object]], None]


def _noop(kind: str, fields: dict[str, object]) -> None:
    pass


@dataclass(frozen=True)
class CheckpointSettings:
    """The ``[checkpoint]`` part of the agent config. Intervals are in training steps."""

    memory_root: str = str(DEFAULT_MEMORY_ROOT)
    """Shared-memory directory of the memory tier (``/dev/shm/trainguard``)."""
    memory_interval: int = 100
    """Ranks save to the memory tier every this many steps (the trainer reads it from its config)."""
    memory_keep: int = 2
    memory_spare_buffers: int = 1
    """Pruned memory checkpoints kept as pre-faulted buffers for the next save."""
    disk_dir: str = ""
    """Disk tier directory; empty: no disk tier (the daemon passes ``<state_dir>/checkpoints``)."""
    disk_interval: int = 500
    disk_keep: int = 3
    object_store: ObjectStoreConfig | None = None
    """Object tier; None: no object tier."""
    object_interval: int = 2000
    object_keep: int = 3
    scratch_dir: str = ""
    """Where checkpoints from non-local tiers are fetched for restore; empty: ``<memory_root>/.restore``."""

    def __post_init__(self) -> None:
        for key in ("memory_interval", "memory_keep", "disk_interval", "disk_keep", "object_interval",
                    "object_keep"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"checkpoint.{key}: must be a positive integer, got {value!r}")
        if self.memory_spare_buffers < 0:
            raise ValueError(f"checkpoint.memory_spare_buffers: must be >= 0, got {self.memory_spare_buffers}")
        if not os.path.isabs(self.memory_root):
            raise ValueError(f"checkpoint.memory_root: must be an absolute path, got {self.memory_root!r}")
        for key in ("disk_dir", "scratch_dir"):
            value = getattr(self, key)
            if value and not os.path.isabs(value):
                raise ValueError(f"checkpoint.{key}: must be an absolute path, got {value!r}")

    @property
    def scratch(self) -> Path:
        return Path(self.scratch_dir) if self.scratch_dir else Path(self.memory_root) / ".restore"


class CheckpointManager:
    """Tiers + replicator + status + restore for one agent.

    ``extra_tiers``: more targets fed by the replicator (the peer tier), with their interval and
    retention in ``extra_intervals``/``extra_keep`` keyed by tier name.
    """

    def __init__(
        self,
        settings: CheckpointSettings,
        *,
        emit: EmitFn = _noop,
        clock: Callable[[], float] = time.time,
        extra_tiers: Sequence[Tier] = (),
        extra_intervals: Mapping[str, int] | None = None,
        extra_keep: Mapping[str, int] | None = None,
        cluster: str = "default",
        object_scope: Callable[[str], ObjectScope | None] | None = None,
    ) -> None:
        self.settings = settings
        self.emit = emit
        self._clock = clock
        self.memory = MemoryTier(settings.memory_root, keep=settings.memory_keep,
                                 spare_buffers=settings.memory_spare_buffers, clock=clock)
        targets: list[Tier] = []
        intervals: dict[str, int] = dict(extra_intervals or {})
        keep: dict[str, int] = dict(extra_keep or {})
        self.disk = DiskTier(settings.disk_dir, clock=clock) if settings.disk_dir else None
        if self.disk is not None:
            targets.append(self.disk)
            intervals["disk"], keep["disk"] = settings.disk_interval, settings.disk_keep
        self.object = ObjectTier(settings.object_store, clock=clock, cluster=cluster,
                                 scope=object_scope) if settings.object_store else None
        if self.object is not None:
            targets.append(self.object)
            intervals["object"], keep["object"] = settings.object_interval, settings.object_keep
        targets += list(extra_tiers)
        self.tiers: list[Tier] = sorted([self.memory, *targets], key=lambda t: t.rank)
        self.status = CheckpointStatus([t.name for t in self.tiers], clock)
        self.replicator = TierReplicator(self.memory, targets, intervals, keep=keep, emit=emit,
                                         status=self.status)
        self._seen: dict[str, int] = {}
        self._polled: dict[str, int] = {}
        """The mtime (ns) of each job's memory directory at its last poll that left nothing to do."""

    # -- life cycle ------------------------------------------------------------------------------
    def start(self) -> None:
        """Make the local tiers' roots the agent's own, clean crash leftovers, learn what the tiers
        already hold, start replication."""
        self.secure_roots()
        for tier in self.tiers:
            try:
                removed = tier.cleanup_tmp()
            except OSError as exc:
                self.emit("checkpoint_cleanup_failed", {"tier": tier.name, "error": describe(exc)})
                continue
            if removed:
                self.emit("checkpoint_tmp_cleaned", {"tier": tier.name, "removed": removed})
        jobs = set(self.memory.jobs()) | (set(self.disk.jobs()) if self.disk else set())
        for job in sorted(jobs):
            self.seed_job(job)
            newest = self.memory.newest(job)
            if newest is not None:
                self._seen[job] = newest.step
        self.replicator.start()

    def secure_roots(self) -> None:
        """Each local tier's root (and the snapshots' directory) is created by the agent, owned by
        it and writable by no one else; one that another identity made first, a symlink or a
        group/other-writable one, is moved aside and made anew (``agent_dir_taken_over``), so
        nothing planted in it is ever restored. One that cannot be made safe is refused
        (``agent_dir_refused``) and its tier fails every use."""
        local = [t for t in self.tiers if isinstance(t, LocalDirTier)]
        for tier in local:
            try:
                check = tier.secure_root()
            except OSError as exc:
                self.emit("agent_dir_refused", {"tier": tier.name, "path": str(tier.root), "error": describe(exc)})
                continue
            self._report_dir(tier.name, check)
            if tier is self.memory and str(tier.root) != self.settings.memory_root:
                # A root's symlink was followed: ranks and snapshots use the real directory too.
                self.settings = dataclasses.replace(self.settings, memory_root=str(tier.root))
            if tier is self.memory:
                try:
                    snaps = ensure_agent_dir(os.path.join(tier.root, SNAPSHOT_DIRNAME))
                except OSError as exc:
                    self.emit("agent_dir_refused", {"tier": "snapshots", "path": str(tier.root),
                                                    "error": describe(exc)})
                    continue
                self._report_dir("snapshots", snaps)
        try:  # where checkpoints of non-local tiers are fetched for a restore
            self._report_dir("scratch", ensure_agent_dir(self.settings.scratch, mode=0o755))
        except OSError as exc:
            self.emit("agent_dir_refused", {"tier": "scratch", "path": str(self.settings.scratch),
                                            "error": describe(exc)})

    def _report_dir(self, tier: str, check: DirCheck) -> None:
        if check.action == "taken_over":
            self.emit("agent_dir_taken_over", {"tier": tier, "path": check.path, "reason": check.reason,
                                               "moved_to": check.moved_to})
        elif check.action == "tightened":
            self.emit("agent_dir_tightened", {"tier": tier, "path": check.path, "reason": check.reason})

    def set_job_owner(self, owner: JobOwner | None) -> None:
        """Who a job's ranks run as (the launcher's ``user``): their job directories are made theirs
        and checkpoints they wrote are trusted at restore (see ``LocalDirTier.job_owner``)."""
        for tier in self.tiers:
            if isinstance(tier, LocalDirTier):
                tier.job_owner = owner

    def prepare_job(self, job: str) -> None:
        """Before a job's ranks start: its memory-tier directory and its snapshots' directory exist,
        made by the agent and given to the job's user (``set_job_owner``), so that ranks that do
        not run as the agent's user can write there and nowhere else in the memory root."""
        self.memory.check_root()
        owner = self.memory.job_owner(job) if self.memory.job_owner is not None else None
        with dir_fd(self.memory.root, self.memory.job_dir(job), create=True, owner=owner):
            pass
        SnapshotSet(self.memory.root, job).prepare(owner)

    def seed_job(self, job: str) -> None:
        """Fill the status of ``job`` from real listings (e.g. when the agent adopts a job)."""
        for tier in self.tiers:
            try:
                self.status.seed(tier.list(job))
            except (CheckpointError, OSError) as exc:
                self.emit("checkpoint_tier_unavailable", {"tier": tier.name, "job": job, "error": describe(exc)})

    def stop(self, timeout: float = 30.0) -> bool:
        return self.replicator.stop(timeout)

    # -- saving ----------------------------------------------------------------------------------
    def stage(self, job: str, step: int) -> Path:
        return self.memory.stage(job, step)

    def commit(self, job: str, step: int, extra: Mapping[str, Any] | None = None, *,
               force: bool = False) -> CheckpointInfo:
        """Commit a staged memory checkpoint and queue it for the slower tiers (never waits on them).

        ``force``: copy to every tier now regardless of intervals (checkpoint-now from the plan).
        """
        try:
            info = self.memory.commit(job, step, extra)
        except CheckpointWriteError as exc:
            self.status.observe_failure(self.memory.name, describe(exc.cause))
            self.emit("checkpoint_write_failed", {"tier": self.memory.name, "job": job, "step": step,
                                                  "error": describe(exc.cause)})
            raise
        self._committed(info, force)
        return info

    def abort(self, job: str, step: int) -> None:
        self.memory.abort(job, step)

    def poll(self, force_jobs: Iterable[str] = ()) -> None:
        """Pick up memory checkpoints committed by another process (trainer rank 0) and prune.

        A job whose directory has not changed since a poll that left nothing to prune is skipped:
        commits and deletions are renames and removals in it, which change its mtime, and reading
        every manifest on each tick was ~10 % of the agent's CPU beside a job saving every 0.25 s."""
        force = set(force_jobs)
        for job in self.memory.jobs():
            try:
                stamp: int | None = self.memory.job_dir(job).stat().st_mtime_ns
            except OSError:
                stamp = None
            if stamp is not None and self._polled.get(job) == stamp and job not in force:
                continue
            infos = self.memory.list(job)
            newest = infos[-1] if infos else None
            if newest is not None and (newest.step > self._seen.get(job, -1) or job in force):
                self._committed(newest, job in force)
            try:
                deleted = self.memory.prune(job, self.memory.keep, listed=infos)
            except OSError as exc:
                self.emit("checkpoint_prune_failed", {"tier": self.memory.name, "job": job, "error": describe(exc)})
                continue
            # A checkpoint kept because a restore reads it is pruned at a later poll. A stamp of the
            # last 50 ms is not kept: mtimes move in jiffies, so a second change within the one
            # this poll saw could leave the same stamp.
            if (stamp is not None and len(deleted) >= len(infos) - self.memory.keep
                    and self._clock() - stamp / 1e9 > _STAMP_SETTLED_S):
                self._polled[job] = stamp

    def _committed(self, info: CheckpointInfo, force: bool) -> None:
        self._seen[info.job] = max(info.step, self._seen.get(info.job, -1))
        self.status.observe_commit(info)
        self.emit("checkpoint_committed", {"tier": info.tier, "job": info.job, "step": info.step,
                                           "bytes": info.size})
        self.replicator.notify(info.job, info.step, force=force)

    # -- restoring -------------------------------------------------------------------------------
    def newest_restorable(self, job: str, max_step: int | None = None) -> tuple[Tier, CheckpointInfo] | None:
        return newest_restorable(job, self.tiers, max_step=max_step, emit=self.emit, status=self.status)

    def local_tiers(self) -> list[LocalDirTier]:
        """The tiers that hold checkpoints on this node's own file systems (memory, disk)."""
        return [t for t in self.tiers if isinstance(t, LocalDirTier)]

    def restore(self, job: str, max_step: int | None = None, exclude: Collection[int] = ()) -> Restored | None:
        """Newest verified checkpoint as a local directory; call ``release()`` once ranks loaded it.
        ``exclude``: steps not to pick (those a rollback came from)."""
        restored = restore(job, self.tiers, self.settings.scratch, max_step=max_step, emit=self.emit,
                           status=self.status, exclude=exclude)
        if restored is not None:
            self.emit("checkpoint_restore_selected", {"tier": restored.tier, "job": job,
                                                      "step": restored.info.step, "path": str(restored.path),
                                                      "fetched": restored.fetched})
        return restored

    # -- reporting -------------------------------------------------------------------------------
    def catalog(self, job: str | None = None) -> list[dict[str, Any]]:
        """Every committed checkpoint (one job or all jobs known locally), for ``trainguard checkpoints``."""
        jobs = [job] if job else sorted(set(self.memory.jobs()) | (set(self.disk.jobs()) if self.disk else set()))
        rows: list[dict[str, Any]] = []
        for j in jobs:
            for tier in self.tiers:
                try:
                    rows += [i.to_dict() | {"rank": tier.rank} for i in tier.list(j)]
                except (CheckpointError, OSError) as exc:
                    rows.append({"tier": tier.name, "job": j, "error": describe(exc)})
        return rows

    def status_rows(self) -> list[dict[str, Any]]:
        return self.status.snapshot()

    def metrics(self) -> Iterable[Metric]:
        return self.status.metrics()
