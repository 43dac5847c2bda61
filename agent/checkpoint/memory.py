"""The memory tier: checkpoints in agent-owned shared memory (``/dev/shm/trainguard/<job>/``).

Ranks write their DCP shards straight into a staging directory the tier hands out
(``stage``); once every rank has finished, the agent calls ``commit``, which writes the manifest
and renames the directory into place. Training is blocked only for that in-memory copy; the disk
and object tiers are fed from here in the background (``TierReplicator``).

Buffer reuse: a fresh tmpfs page costs a page fault and zeroing, so writing into new files runs
at ~1 GB/s here against ~7.6 GB/s into pages already touched. Pruned checkpoints are
therefore not deleted but kept as *spare* directories; ``stage`` moves one into the staging
directory as ``.reuse/``, and ``open_for_overwrite`` (used by the trainer's DCP writer) moves the
file of the same name into place and overwrites it without truncating, so the pages are reused.
Files nobody rewrote are dropped at commit, so a spare never leaks into a checkpoint.
"""

from __future__ import annotations

import io
import os
import stat
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from trainguard.agent.checkpoint.errors import CheckpointError, CheckpointWriteError
from trainguard.agent.checkpoint.local import LocalDirTier, rmtree_quiet
from trainguard.agent.checkpoint.manifest import MANIFEST_NAME
from trainguard.agent.checkpoint.tier import RANK_MEMORY, TMP_PREFIX, CheckpointInfo, check_job, check_step
from trainguard.agent.safefs import rename_beneath, unlink_beneath

DEFAULT_MEMORY_ROOT = Path("/dev/shm/trainguard")
REUSE_DIRNAME = ".reuse"
SPARE_PREFIX = ".spare-"


class _OverwriteFile(io.FileIO):
    """A file opened for writing without O_TRUNC; on close it is cut to the furthest byte written.

    Truncating on open would hand the old tmpfs pages back to the kernel and fault fresh ones in
    again, which is exactly the cost buffer reuse avoids.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o640)
        super().__init__(fd, "wb", closefd=True)
        self._end = 0

    def write(self, b: Any, /) -> int:
        n = super().write(b)
        if n:
            self._end = max(self._end, self.tell())
        return n or 0

    def close(self) -> None:
        if not self.closed:
            try:
                self.truncate(self._end)
            finally:
                super().close()


def open_for_overwrite(path: str | os.PathLike[str]) -> io.BufferedWriter:
    """Open ``path`` (inside a staging directory) for writing, reusing a spare file's pages.

    For the trainer: give DCP a ``FileSystem`` whose ``create_stream(path, "wb")`` yields this
    (other modes: the default). Torch-free; works on any directory (no spare: a plain new file).
    """
    p = Path(path)
    spare = p.parent / REUSE_DIRNAME / p.name
    try:
        os.rename(spare, p)
    except OSError:
        pass  # no spare of that name: a fresh file
    return io.BufferedWriter(_OverwriteFile(p), buffer_size=1 << 20)


class MemoryTier(LocalDirTier):
    """Checkpoints in shared memory; restore reads them in place."""

    def __init__(
        self,
        root: str | os.PathLike[str] = DEFAULT_MEMORY_ROOT,
        *,
        keep: int = 2,
        spare_buffers: int = 1,
        name: str = "memory",
        clock: Callable[[], float] = time.time,
    ) -> None:
        if keep < 1:
            raise ValueError(f"memory tier 'keep' must be >= 1, got {keep}")
        if spare_buffers < 0:
            raise ValueError(f"memory tier 'spare_buffers' must be >= 0, got {spare_buffers}")
        # tmpfs has nothing to flush: fsync would only cost syscalls.
        super().__init__(name, root, RANK_MEMORY, durable=False, restore_in_place=True, clock=clock)
        self.keep = keep
        self.spare_buffers = spare_buffers
        self._staged: dict[tuple[str, int], Path] = {}
        self._stage_lock = threading.Lock()
        self.reused_stages = 0  # how many stage() calls got a spare buffer (for status and tests)

    # -- spare pool ------------------------------------------------------------------------------
    def _spares(self, job: str) -> list[Path]:
        jd = self.job_dir(job)
        try:
            entries = self._entries(jd)
        except OSError:
            return []
        # Real directories only: a spare a rank swapped for a symlink is not handed out.
        spares = [(st.st_mtime, jd / n) for n, st in entries if n.startswith(SPARE_PREFIX) and stat.S_ISDIR(st.st_mode)]
        return [p for _, p in sorted(spares)]

    def _retire(self, path: Path) -> None:
        job = path.parent.name
        with self._lock:
            if len(self._spares(job)) < self.spare_buffers:
                try:
                    unlink_beneath(self.root, path / MANIFEST_NAME)
                    rename_beneath(self.root, path, path.parent / f"{SPARE_PREFIX}{uuid.uuid4().hex}")
                    return
                except OSError:
                    pass
        self._rmtree(path)

    # -- staging ---------------------------------------------------------------------------------
    def stage(self, job: str, step: int) -> Path:
        """A fresh staging directory for (job, step) that ranks write their DCP files into."""
        check_job(job)
        check_step(step)
        with self._stage_lock:
            old = self._staged.pop((job, step), None)
        if old is not None:
            self._rmtree(old)  # a save of the same step restarted: its half-written files go
        try:
            tmp = self._new_tmp(job, step)
        except OSError as exc:
            raise CheckpointWriteError(self.name, job, step, exc) from exc
        with self._lock:
            spares = self._spares(job)
            if spares:
                try:
                    rename_beneath(self.root, spares[0], tmp / REUSE_DIRNAME)
                    self.reused_stages += 1
                except OSError:
                    pass
        with self._stage_lock:
            self._staged[(job, step)] = tmp
        return tmp

    def staged_path(self, job: str, step: int) -> Path | None:
        with self._stage_lock:
            return self._staged.get((job, step))

    def commit(
        self,
        job: str,
        step: int,
        extra: Mapping[str, Any] | None = None,
        *,
        staged: str | os.PathLike[str] | None = None,
        prune: bool = True,
    ) -> CheckpointInfo:
        """Commit a staged checkpoint once all ranks finished writing.

        ``staged``: the directory ``stage`` returned, for a commit from another process than the
        one that staged (the trainer's rank 0 after ``dcp.save`` returned). ``prune``: trim to
        ``keep`` afterwards; a trainer passes False and leaves pruning to the agent, whose pins
        protect checkpoints it is replicating or restoring from.
        """
        with self._stage_lock:
            tmp = self._staged.pop((job, step), None)
        if staged is not None:
            tmp = self._check_staged(job, step, Path(staged))
        if tmp is None or not tmp.is_dir():
            raise CheckpointError(f"tier {self.name}: {job} step {step} was not staged")
        self._rmtree(tmp / REUSE_DIRNAME)  # spares no rank rewrote (smaller world, fewer files)
        try:
            info = self.commit_dir(tmp, job, step, extra=extra)
        except (OSError, CheckpointError) as exc:
            self._rmtree(tmp)
            raise CheckpointWriteError(self.name, job, step, exc) from exc
        if prune:
            self.prune(job, self.keep)
        return info

    def _check_staged(self, job: str, step: int, staged: Path) -> Path:
        # The path comes from another process: accept only a staging directory of this very
        # (job, step) directly under this tier's job directory.
        jd = self.job_dir(job).resolve()
        path = staged.resolve()
        if path.parent != jd or not path.name.startswith(f"{TMP_PREFIX}step_{step}-"):
            raise CheckpointError(f"tier {self.name}: {staged} is not a staging directory of {job} step {step}")
        return self.job_dir(job) / path.name  # below the root as configured: walked without symlinks

    def hand_over(self, job: str, step: int) -> None:
        """Forget a staged checkpoint that another process commits or drops (a background writer)."""
        with self._stage_lock:
            self._staged.pop((job, step), None)

    def abort(self, job: str, step: int) -> None:
        """Drop a staged checkpoint (a rank failed during the save)."""
        with self._stage_lock:
            tmp = self._staged.pop((job, step), None)
        if tmp is not None:
            self._rmtree(tmp)

    def cleanup_tmp(self) -> int:
        """Remove crash leftovers and spares beyond ``spare_buffers`` (the setting may have shrunk)."""
        with self._stage_lock:
            self._staged.clear()
        removed = super().cleanup_tmp()
        for job in self.jobs():
            for extra in self._spares(job)[self.spare_buffers:]:
                self._rmtree(extra)
                removed += 1
        return removed


def bench_buffer_reuse(root: str | os.PathLike[str], size_bytes: int = 256 << 20, rounds: int = 3,
                       files: int = 4) -> dict[str, float]:
    """Save-stall micro benchmark: GB/s of writing ``size_bytes`` split over ``files`` shard files.

    * ``fresh_gbps``: new files each round (what creating new tmpfs files costs),
    * ``truncate_gbps``: DCP's default ``open(path, "wb")`` over a recycled directory,
    * ``reuse_gbps``: MemoryTier stage/commit with ``open_for_overwrite`` (recycled pages),
    and ``reuse_ratio`` = reuse ÷ fresh. Uses a throw-away MemoryTier under ``root``.
    """
    payload = memoryview(os.urandom(1 << 20) * max(1, size_bytes // files // (1 << 20)))
    tier = MemoryTier(Path(root) / f"bench-{uuid.uuid4().hex}", keep=1, spare_buffers=1)

    def write_all(directory: Path, opener: Callable[[Path], Any]) -> float:
        t0 = time.perf_counter()
        for i in range(files):
            with opener(directory / f"__{i}_0.distcp") as f:
                f.write(payload)
        return time.perf_counter() - t0

    total = len(payload) * files
    results: dict[str, float] = {}
    try:
        for label, opener, reuse in (
            ("fresh", lambda p: open(p, "wb"), False),
            ("truncate", lambda p: open(p, "wb"), True),
            ("reuse", open_for_overwrite, True),
        ):
            tier.spare_buffers = 1 if reuse else 0
            for d in tier._spares("bench"):
                rmtree_quiet(d)
            seconds = []
            for r in range(rounds + 1):  # round 0 fills the pool (first write is always fresh)
                stage = tier.stage("bench", r)
                if label == "truncate":
                    # DCP's default: same names in place, but "wb" truncates before writing.
                    reuse_dir = stage / REUSE_DIRNAME
                    if reuse_dir.exists():
                        for f in reuse_dir.iterdir():
                            os.rename(f, stage / f.name)
                dt = write_all(stage, opener)
                tier.commit("bench", r)
                if r > 0:
                    seconds.append(dt)
            results[f"{label}_gbps"] = total / min(seconds) / 1e9
    finally:
        rmtree_quiet(tier.root)
    results["reuse_ratio"] = results["reuse_gbps"] / results["fresh_gbps"]
    return results
