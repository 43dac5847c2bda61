"""Background replication of memory checkpoints to slower tiers (disk, object, peer).

The ranks only ever write the memory tier. After each memory commit the agent calls ``notify``,
which returns at once; one worker thread per target tier then copies the newest committed memory
checkpoint when its step crossed that tier's interval (``step // interval`` advanced), prunes the
target to its retention, and records the outcome. One thread per target keeps a slow object-store
upload from delaying the disk copy, and a failing tier from stopping the others. Requests
coalesce: a worker busy with step 500 that is notified of 600 and 700 next copies only 700.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from trainguard.agent import health
from trainguard.agent.checkpoint.errors import CheckpointCorrupt, CheckpointWriteError, describe
from trainguard.agent.checkpoint.local import LocalDirTier
from trainguard.agent.checkpoint.status import CheckpointStatus
from trainguard.agent.checkpoint.tier import CheckpointInfo, Tier, check_job

EmitFn = Callable[[str, dict[str, object]], None]


def _noop(kind: str, fields: dict[str, object]) -> None:
    pass


@dataclass
class _Pending:
    step: int
    force: bool


class _Worker:
    def __init__(self, owner: TierReplicator, target: Tier, interval: int, keep: int | None) -> None:
        self.owner = owner
        self.target = target
        self.interval = interval
        self.keep = keep
        self.cond = threading.Condition()
        self.pending: dict[str, _Pending] = {}
        self.busy = False
        self.stopping = False
        self.last_bucket: dict[str, int] = {}
        self.thread = threading.Thread(target=self.run, name=f"ckpt-replicate-{target.name}", daemon=True)

    def submit(self, job: str, step: int, force: bool) -> None:
        with self.cond:
            cur = self.pending.get(job)
            if cur is None or step >= cur.step:
                self.pending[job] = _Pending(step, force or (cur.force if cur else False))
            self.cond.notify_all()

    def run(self) -> None:
        while True:
            health.beat(self, self.thread.name)
            with self.cond:
                while not self.pending and not self.stopping:
                    self.cond.wait(5.0)  # woken by work; the timeout only lets it beat while idle
                    health.beat(self, self.thread.name)
                if self.stopping and not self.pending:
                    return
                job, req = next(iter(self.pending.items()))
                del self.pending[job]
                self.busy = True
            try:
                self.replicate(job, req)
            except Exception as exc:  # never let the thread die: report and wait for the next one
                self.owner._failed(self.target, job, req.step, exc)
            finally:
                with self.cond:
                    self.busy = False
                    self.cond.notify_all()

    def _last(self, job: str) -> int:
        if job not in self.last_bucket:
            newest = self.target.newest(job)
            self.last_bucket[job] = newest.step // self.interval if newest else 0
        return self.last_bucket[job]

    def replicate(self, job: str, req: _Pending) -> None:
        source = self.owner.source
        newest = source.newest(job)
        if newest is None:
            return
        step = newest.step
        bucket = step // self.interval
        if not req.force and bucket <= self._last(job):
            return
        with source.pin(job, step):
            path = source.step_path(job, step)
            if not path.exists():
                return  # pruned between list and pin; a newer one will be notified
            t0 = time.monotonic()
            try:
                info = self.target.write_from(path, job, step)
            except CheckpointCorrupt as exc:
                self.owner._corrupt(source.name, job, step, exc)
                return
            except Exception as exc:
                self.owner._failed(self.target, job, step, exc)
                return
        self.last_bucket[job] = max(bucket, self.last_bucket.get(job, 0))
        self.owner._written(self.target, info, time.monotonic() - t0)
        if self.keep is not None:
            try:
                removed = self.target.prune(job, self.keep)
            except Exception as exc:
                self.owner.emit("checkpoint_prune_failed", {"tier": self.target.name, "job": job,
                                                            "error": describe(exc)})
            else:
                if removed and self.owner.status is not None:
                    self.owner.status.observe_removed(self.target.name, job, removed)

    def idle(self) -> bool:
        return not self.pending and not self.busy


class TierReplicator:
    """Copies newest memory checkpoints to target tiers in background threads.

    ``intervals`` and ``keep`` are keyed by target tier name; a target without a ``keep`` entry is
    never pruned. Events: ``checkpoint_replicated`` {tier, job, step, bytes, seconds},
    ``checkpoint_write_failed`` {tier, job, step, error}, ``checkpoint_corrupt`` {tier, job, step,
    problems} (the memory copy no longer matches its manifest: it is not copied on).
    """

    def __init__(
        self,
        source: LocalDirTier,
        targets: Sequence[Tier],
        intervals: Mapping[str, int],
        *,
        keep: Mapping[str, int] | None = None,
        emit: EmitFn = _noop,
        status: CheckpointStatus | None = None,
    ) -> None:
        keep = dict(keep or {})
        names = [t.name for t in targets]
        if len(set(names)) != len(names) or source.name in names:
            raise ValueError(f"replicator: tier names must be unique, got {[source.name, *names]}")
        for t in targets:
            iv = intervals.get(t.name)
            if not isinstance(iv, int) or iv < 1:
                raise ValueError(f"checkpoint.{t.name}.interval must be a positive integer, got {iv!r}")
            k = keep.get(t.name)
            if k is not None and k < 1:
                raise ValueError(f"checkpoint.{t.name}.keep must be >= 1, got {k}")
        self.source = source
        self.emit = emit
        self.status = status
        self._workers = [_Worker(self, t, intervals[t.name], keep.get(t.name)) for t in targets]
        self._started = False
        self._last_error: dict[tuple[str, str], str] = {}
        """(tier, job) -> the error its last copy failed with, until one succeeds: the same
        failure again (a cluster of one has no peer, at every checkpoint) is counted, not re-emitted."""
        if status is not None:
            for t in (source, *targets):
                status.register(t.name)

    def start(self) -> None:
        if not self._started:
            self._started = True
            for w in self._workers:
                w.thread.start()

    def notify(self, job: str, step: int, *, force: bool = False) -> None:
        """A memory checkpoint of ``job`` at ``step`` was committed; never blocks on I/O.

        ``force`` (checkpoint-now from the plan) copies to every target regardless of interval.
        """
        check_job(job)
        for w in self._workers:
            w.submit(job, step, force)

    def wait_idle(self, timeout: float) -> bool:
        """Wait until every worker has nothing pending (tests, graceful shutdown)."""
        deadline = time.monotonic() + timeout
        for w in self._workers:
            with w.cond:
                while not w.idle():
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    w.cond.wait(left)
        return True

    def stop(self, timeout: float = 30.0) -> bool:
        """Finish pending copies (up to ``timeout``) and stop the threads; True if all stopped."""
        for w in self._workers:
            with w.cond:
                w.stopping = True
                w.cond.notify_all()
        deadline = time.monotonic() + timeout
        ok = True
        for w in self._workers:
            if w.thread.is_alive():
                w.thread.join(max(0.0, deadline - time.monotonic()))
                ok = ok and not w.thread.is_alive()
        return ok

    # -- outcomes --------------------------------------------------------------------------------
    def _written(self, tier: Tier, info: CheckpointInfo, seconds: float) -> None:
        self._last_error.pop((tier.name, info.job), None)
        if self.status is not None:
            self.status.observe_commit(info)
        self.emit("checkpoint_replicated", {"tier": tier.name, "job": info.job, "step": info.step,
                                            "bytes": info.size, "seconds": round(seconds, 4)})

    def _failed(self, tier: Tier, job: str, step: int, exc: BaseException) -> None:
        error = describe(exc.cause) if isinstance(exc, CheckpointWriteError) else describe(exc)
        if self.status is not None:
            self.status.observe_failure(tier.name, error)
        if self._last_error.get((tier.name, job)) == error:
            return
        self._last_error[(tier.name, job)] = error
        self.emit("checkpoint_write_failed", {"tier": tier.name, "job": job, "step": step, "error": error,
                                              "note": "repeats of this error are counted, not reported, until a copy succeeds"})

    def _corrupt(self, tier: str, job: str, step: int, exc: CheckpointCorrupt) -> None:
        if self.status is not None:
            self.status.observe_corrupt(tier)
        self.emit("checkpoint_corrupt", {"tier": tier, "job": job, "step": step, "problems": exc.problems[:20]})
