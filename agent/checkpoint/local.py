"""Checkpoint tiers on a local filesystem (shared by the memory and disk tiers).

Layout: ``<root>/<job>/step_<N>/`` holds a committed checkpoint. A write goes into
``<root>/<job>/.tmp-step_<N>-<uuid>/``; the manifest is written last, files and directories are
fsync'd (when ``durable``), and one ``rename`` commits it. Readers only look at ``step_*``
directories that hold a manifest, so a crash at any point leaves either the old state or the new
one plus a ``.tmp-*`` leftover that ``cleanup_tmp`` removes on start.
"""

from __future__ import annotations

import builtins
import contextlib
import os
import shutil
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from trainguard.agent.checkpoint.errors import (
    CheckpointCorrupt,
    CheckpointError,
    CheckpointNotFound,
    CheckpointWriteError,
    ManifestError,
)
from trainguard.agent.checkpoint.manifest import (
    CHUNK_BYTES,
    DEFAULT_ALGORITHM,
    MANIFEST_NAME,
    FileEntry,
    Manifest,
    VerifyResult,
    build_manifest,
    list_files,
    new_hasher,
    read_manifest,
    safe_relpath,
    verify_against,
    write_manifest,
)
from trainguard.agent.checkpoint.tier import (
    TMP_PREFIX,
    CheckpointInfo,
    Tier,
    check_job,
    parse_step_dirname,
    step_dirname,
)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def copy_checked(src: Path, dst: Path, algorithm: str, *, durable: bool) -> tuple[int, str]:
    """Copy one file, hashing the bytes on the way (one read pass); returns (size, checksum)."""
    hasher = new_hasher(algorithm)
    buf = bytearray(CHUNK_BYTES)
    view = memoryview(buf)
    size = 0
    dst.parent.mkdir(parents=True, exist_ok=True)
    with open(src, "rb", buffering=0) as fin, open(dst, "wb", buffering=0) as fout:
        while n := fin.readinto(view):  # type: ignore[attr-defined]
            chunk = view[:n]
            hasher.update(chunk)
            written = 0
            while written < n:
                written += fout.write(chunk[written:])
            size += n
        if durable:
            os.fsync(fout.fileno())
    return size, hasher.hexdigest()


def rmtree_quiet(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


class LocalDirTier(Tier):
    """A tier whose checkpoints are directories on a local filesystem."""

    def __init__(
        self,
        name: str,
        root: str | os.PathLike[str],
        rank: int,
        *,
        durable: bool,
        restore_in_place: bool,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.name = name
        self.rank = rank
        self.root = Path(root)
        self.durable = durable
        self.restore_in_place = restore_in_place
        self._clock = clock
        self._lock = threading.RLock()
        self._pins: Counter[tuple[str, int]] = Counter()

    # -- paths ---------------------------------------------------------------------------------
    def job_dir(self, job: str) -> Path:
        return self.root / check_job(job)

    def step_path(self, job: str, step: int) -> Path:
        return self.job_dir(job) / step_dirname(step)

    def _tmp_name(self, job: str, step: int, kind: str = "step") -> Path:
        return self.job_dir(job) / f"{TMP_PREFIX}{kind}_{step}-{uuid.uuid4().hex}"

    def _new_tmp(self, job: str, step: int, kind: str = "step") -> Path:
        self.job_dir(job).mkdir(parents=True, exist_ok=True)
        tmp = self._tmp_name(job, step, kind)
        tmp.mkdir()
        return tmp

    # -- pins: a checkpoint being copied or restored from is never pruned under the reader --------
    @contextlib.contextmanager
    def pin(self, job: str, step: int) -> Iterator[None]:
        with self._lock:
            self._pins[(job, step)] += 1
        try:
            yield
        finally:
            with self._lock:
                self._pins[(job, step)] -= 1
                if self._pins[(job, step)] <= 0:
                    del self._pins[(job, step)]

    def acquire(self, job: str, step: int) -> Callable[[], None]:
        """Pin until the returned release function is called (for restores handed to ranks)."""
        cm = self.pin(job, step)
        cm.__enter__()
        done = threading.Event()

        def release() -> None:
            if not done.is_set():
                done.set()
                cm.__exit__(None, None, None)

        return release

    def _may_delete(self, job: str, step: int) -> bool:
        with self._lock:
            return self._pins.get((job, step), 0) == 0

    # -- commit ----------------------------------------------------------------------------------
    def commit_dir(
        self,
        tmp: Path,
        job: str,
        step: int,
        *,
        manifest: Manifest | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> CheckpointInfo:
        """Write the manifest into ``tmp`` and rename it to ``step_<N>`` (replacing an older copy)."""
        if manifest is None:
            manifest = build_manifest(tmp, job, step, extra, created=self._clock())
        write_manifest(tmp, manifest, durable=self.durable)
        if self.durable:
            fsync_dir(tmp)
        final = self.step_path(job, step)
        with self._lock:
            old: Path | None = None
            if final.exists():
                # Same step saved again (e.g. after a rollback): move the old copy aside first;
                # between the two renames the step is briefly absent, never half-written.
                old = self._tmp_name(job, step, "old")
                os.rename(final, old)
            os.rename(tmp, final)
            if self.durable:
                fsync_dir(final.parent)
        if old is not None:
            self._retire(old)
        return self._info(job, step, manifest)

    def _retire(self, path: Path) -> None:
        """Dispose of an uncommitted former checkpoint directory (the memory tier recycles it)."""
        rmtree_quiet(path)

    def _info(self, job: str, step: int, manifest: Manifest) -> CheckpointInfo:
        return CheckpointInfo(
            tier=self.name,
            job=job,
            step=step,
            location=str(self.step_path(job, step)),
            size=manifest.total_bytes,
            created=manifest.created,
        )

    # -- Tier ------------------------------------------------------------------------------------
    def list(self, job: str) -> list[CheckpointInfo]:
        jd = self.job_dir(job)
        try:
            names = os.listdir(jd)
        except FileNotFoundError:
            return []
        out: list[CheckpointInfo] = []
        for name in names:
            step = parse_step_dirname(name)
            if step is None:
                continue  # .tmp-* and anything else is not a committed checkpoint
            path = jd / name
            try:
                manifest = read_manifest(path)
            except FileNotFoundError:
                continue
            except (ManifestError, OSError):
                # Committed but unreadable: list it so that restore verifies it, reports it
                # corrupt, and falls back, instead of silently pretending it is not there.
                try:
                    created = path.stat().st_mtime
                except OSError:
                    continue
                out.append(CheckpointInfo(self.name, job, step, str(path), 0, created))
                continue
            out.append(self._info(job, step, manifest))
        return sorted(out, key=lambda i: i.step)

    def write_from(self, src_dir: Path, job: str, step: int) -> CheckpointInfo:
        src = Path(src_dir)
        check_job(job)
        try:
            tmp = self._new_tmp(job, step)
        except OSError as exc:
            raise CheckpointWriteError(self.name, job, step, exc) from exc
        try:
            manifest = self._copy_tree(src, tmp, job, step)
            return self.commit_dir(tmp, job, step, manifest=manifest)
        except CheckpointCorrupt:
            rmtree_quiet(tmp)
            raise
        except (OSError, CheckpointError) as exc:
            rmtree_quiet(tmp)
            raise CheckpointWriteError(self.name, job, step, exc) from exc

    def _copy_tree(self, src: Path, dst: Path, job: str, step: int) -> Manifest:
        """Copy ``src`` into ``dst``; check against src's manifest when it has one."""
        try:
            src_manifest: Manifest | None = read_manifest(src)
        except FileNotFoundError:
            src_manifest = None
        if src_manifest is None:
            entries = []
            for rel in list_files(src):
                size, digest = copy_checked(src / rel, dst / rel, DEFAULT_ALGORITHM, durable=self.durable)
                entries.append(FileEntry(rel, size, digest))
            self._fsync_subdirs(dst, entries)
            return Manifest(job, step, self._clock(), DEFAULT_ALGORITHM, tuple(entries), {})
        bad: list[str] = []
        for entry in src_manifest.files:
            rel = safe_relpath(entry.path)
            try:
                size, digest = copy_checked(src / rel, dst / rel, src_manifest.algorithm, durable=self.durable)
            except FileNotFoundError:
                bad.append(f"missing: {rel}")
                continue
            if size != entry.size or digest != entry.checksum:
                bad.append(f"checksum mismatch: {rel}")
        if bad:
            raise CheckpointCorrupt(f"source {src} does not match its manifest", bad)
        self._fsync_subdirs(dst, src_manifest.files)
        return Manifest(job, step, src_manifest.created, src_manifest.algorithm, src_manifest.files,
                        src_manifest.extra)

    def _fsync_subdirs(self, root: Path, entries: Iterable[FileEntry]) -> None:
        # The checkpoint root itself is fsync'd by commit_dir after the manifest is in.
        if self.durable:
            for d in {(root / e.path).parent for e in entries} - {root}:
                fsync_dir(d)

    def open(self, job: str, step: int) -> Path | None:
        if not self.restore_in_place:
            return None
        path = self.step_path(job, step)
        return path if (path / MANIFEST_NAME).exists() else None

    def fetch(self, job: str, step: int, dest_dir: Path) -> Path:
        src = self.step_path(job, step)
        if not (src / MANIFEST_NAME).exists():
            raise CheckpointNotFound(f"tier {self.name}: no committed {job} step {step}")
        dest = Path(dest_dir)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.parent / f"{TMP_PREFIX}fetch-{dest.name}-{uuid.uuid4().hex}"
        tmp.mkdir()
        try:
            with self.pin(job, step):
                manifest = self._copy_tree(src, tmp, job, step)
            write_manifest(tmp, manifest, durable=False)
            os.rename(tmp, dest)
        except BaseException:
            rmtree_quiet(tmp)
            raise
        return dest

    def verify(self, job: str, step: int) -> VerifyResult:
        path = self.step_path(job, step)
        try:
            manifest = read_manifest(path)
        except FileNotFoundError:
            return VerifyResult(error=f"tier {self.name}: no manifest for {job} step {step}")
        except (ManifestError, OSError) as exc:
            return VerifyResult(error=f"invalid manifest: {exc}")
        problems = []
        if manifest.job != job or manifest.step != step:
            problems.append(f"manifest names {manifest.job} step {manifest.step}")
        result = verify_against(path, manifest)
        if problems:
            return VerifyResult(result.missing, result.extra, result.size_mismatch,
                                result.checksum_mismatch, "; ".join(problems), manifest)
        return result

    def delete(self, job: str, step: int) -> None:
        final = self.step_path(job, step)
        with self._lock:
            if not final.exists():
                return
            # Rename away first: the checkpoint disappears from listings atomically, and a crash
            # during the removal leaves only a .tmp-* directory for cleanup_tmp.
            tmp = self._tmp_name(job, step, "del")
            os.rename(final, tmp)
            with contextlib.suppress(OSError):
                (tmp / MANIFEST_NAME).unlink()
        self._retire(tmp)

    def cleanup_job_tmp(self, job: str) -> int:
        """Remove the staging directories of one job (its ranks died during a save, or it ended):
        safe whenever none of the job's ranks is alive."""
        removed = 0
        try:
            entries = list(self.job_dir(job).iterdir())
        except (FileNotFoundError, CheckpointError):
            return 0
        for p in entries:
            if p.name.startswith(TMP_PREFIX) and p.is_dir():
                rmtree_quiet(p)
                removed += 1
        return removed

    def cleanup_tmp(self) -> int:
        removed = 0
        try:
            jobs = [p for p in self.root.iterdir() if p.is_dir() and not p.name.startswith(".")]
        except FileNotFoundError:
            return 0
        for jd in jobs:
            for p in jd.iterdir():
                if p.name.startswith(TMP_PREFIX) and p.is_dir():
                    rmtree_quiet(p)
                    removed += 1
        return removed

    def jobs(self) -> builtins.list[str]:
        try:
            return sorted(p.name for p in self.root.iterdir() if p.is_dir() and not p.name.startswith("."))
        except FileNotFoundError:
            return []
