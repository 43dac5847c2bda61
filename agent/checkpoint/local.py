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
import ctypes
import os
import shutil
import stat
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
    MAX_MANIFEST_BYTES,
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
from trainguard.agent.safefs import (
    DirCheck,
    JobOwner,
    UnsafeTreeError,
    dir_fd,
    dir_problem,
    ensure_agent_dir,
    open_beneath,
    rename_beneath,
    rmtree_beneath,
    tighten,
    unlink_beneath,
    walk_files,
    write_atomic_at,
)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def copy_checked(src: Path, dst: Path, algorithm: str, *, durable: bool,
                 src_root: Path | None = None) -> tuple[int, str]:
    """Copy one file, hashing the bytes on the way (one read pass); returns (size, checksum).
    ``src_root``: the source checkpoint's directory, below which no symlink is followed (a tree
    ranks wrote); the destination is the tier's own staging directory."""
    hasher = new_hasher(algorithm)
    buf = bytearray(CHUNK_BYTES)
    view = memoryview(buf)
    size = 0
    dst.parent.mkdir(parents=True, exist_ok=True)
    if src_root is not None:
        try:
            source = os.fdopen(open_beneath(src_root, src, os.O_RDONLY), "rb", buffering=0)
        except UnsafeTreeError as exc:
            raise CheckpointCorrupt(f"{src}: {exc.reason}", [f"unsafe: {src}"]) from exc
    else:
        source = open(src, "rb", buffering=0)  # noqa: SIM115 - closed by the with below
    with source as fin, open(dst, "xb", buffering=0) as fout:
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


_RENAME_EXCHANGE = 2
_libc = ctypes.CDLL(None, use_errno=True)
_renameat2 = getattr(_libc, "renameat2", None)


def exchange_at(dfd: int, a: str, b: str) -> bool:
    """Swap two entries of directory ``dfd`` in one step (``renameat2(RENAME_EXCHANGE)``); False
    where the kernel or filesystem cannot, and nothing changed."""
    if _renameat2 is None:
        return False
    rc = _renameat2(dfd, os.fsencode(a), dfd, os.fsencode(b), _RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (22, 38, 95):  # EINVAL, ENOSYS, EOPNOTSUPP: no exchange here
        return False
    raise OSError(err, os.strerror(err), b)


def _old_step(name: str) -> int | None:
    """The step of an ``old`` leftover (``.tmp-old_<N>-<uuid>``), else None."""
    head = f"{TMP_PREFIX}old_"
    if not name.startswith(head):
        return None
    digits = name[len(head):].split("-", 1)[0]
    return int(digits) if digits.isdigit() else None


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
        self.job_owner: JobOwner | None = None
        """(uid, gid) of a job's ranks where they are not the agent's user: its job directory is
        theirs, and checkpoints they wrote are trusted at restore (the launcher sets it)."""

    # -- the tree's safety -------------------------------------------------------------------------
    def secure_root(self, *, takeover: bool = True, mode: int = 0o755) -> DirCheck:
        """Make the root a directory of the agent's own (created, or an unsafe one moved aside and
        made anew): called at start, before anything in it is trusted. A root that is a symlink
        root or the agent made (an admin pointing the disk tier at an NVMe mount) is followed once,
        here, and its target secured and used from then on; anyone else's symlink is moved aside."""
        try:
            st = os.lstat(self.root)
        except FileNotFoundError:
            st = None
        if st is not None and stat.S_ISLNK(st.st_mode) and st.st_uid in (0, os.geteuid()):
            self.root = Path(os.path.realpath(self.root))
        return ensure_agent_dir(self.root, mode=mode, takeover=takeover)

    def check_root(self) -> None:
        """Before use: the root is a real directory owned by root or this process's user and
        writable by no one else (UnsafeTreeError otherwise)."""
        try:
            st = os.lstat(self.root)
        except FileNotFoundError:
            ensure_agent_dir(self.root, takeover=False)
            return
        problem = dir_problem(st, {0, os.geteuid()})
        if problem is not None and not (stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid()
                                        and tighten(self.root)):
            raise UnsafeTreeError(str(self.root), problem)

    def trusted_uids(self, job: str) -> set[int]:
        """Who may have written a checkpoint of ``job`` that ranks are handed: root, the agent, the
        job's own user."""
        uids = {0, os.geteuid()}
        owner = self.job_owner(job) if self.job_owner is not None else None
        if owner is not None:
            uids.add(owner[0])
        return uids

    def _read_manifest(self, step_dir: Path) -> Manifest:
        """A committed checkpoint's manifest, read below the root without following a symlink and
        never from a FIFO or device a rank put in its place (its open would block the agent)."""
        fd = open_beneath(self.root, step_dir / MANIFEST_NAME, os.O_RDONLY | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as fh:
            if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
                raise ManifestError(f"{step_dir / MANIFEST_NAME} is not a regular file")
            return Manifest.from_json(fh.read(MAX_MANIFEST_BYTES + 1))

    def manifest(self, job: str, step: int) -> Manifest:
        """The manifest of a committed checkpoint (``ManifestError`` or ``OSError`` when unreadable)."""
        return self._read_manifest(self.step_path(job, step))

    def _rmtree(self, path: Path) -> None:
        rmtree_beneath(self.root, path)

    # -- paths ---------------------------------------------------------------------------------
    def job_dir(self, job: str) -> Path:
        return self.root / check_job(job)

    def step_path(self, job: str, step: int) -> Path:
        return self.job_dir(job) / step_dirname(step)

    def _tmp_name(self, job: str, step: int, kind: str = "step") -> Path:
        return self.job_dir(job) / f"{TMP_PREFIX}{kind}_{step}-{uuid.uuid4().hex}"

    def _new_tmp(self, job: str, step: int, kind: str = "step") -> Path:
        self.check_root()
        owner = self.job_owner(job) if self.job_owner is not None else None
        tmp = self._tmp_name(job, step, kind)
        with dir_fd(self.root, self.job_dir(job), create=True, mode=0o755, owner=owner) as jfd:
            os.mkdir(tmp.name, 0o755, dir_fd=jfd)
            if owner is not None:
                os.chown(tmp.name, owner[0], owner[1], dir_fd=jfd, follow_symlinks=False)
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
        # Through the staging directory's own fd: a rank that swapped it for a symlink makes
        # this fail, never write the manifest elsewhere.
        with dir_fd(self.root, tmp) as tfd:
            write_atomic_at(tfd, MANIFEST_NAME, manifest.to_json(), durable=self.durable)
        final = self.step_path(job, step)
        with self._lock:
            old = self._replace(tmp, final, job, step)
        if old is not None:
            self._retire(old)
        return self._info(job, step, manifest)

    def _replace(self, tmp: Path, final: Path, job: str, step: int) -> Path | None:
        """Put ``tmp`` in place as ``final``; returns where an older copy of ``final`` went. The
        old copy is replaced, then retired: at no point is the step absent (one exchange; where the
        filesystem cannot exchange, a crash between the two renames leaves the old copy under an
        ``old`` name that ``cleanup_tmp`` puts back)."""
        with dir_fd(self.root, final.parent) as jfd:
            try:
                st = os.lstat(final.name, dir_fd=jfd)
            except FileNotFoundError:
                st = None
            if st is None:
                os.rename(tmp.name, final.name, src_dir_fd=jfd, dst_dir_fd=jfd)
                old = None
            elif stat.S_ISDIR(st.st_mode) and exchange_at(jfd, tmp.name, final.name):
                old = tmp  # tmp's name now holds the former copy
            else:
                aside = self._tmp_name(job, step, "old")
                os.rename(final.name, aside.name, src_dir_fd=jfd, dst_dir_fd=jfd)
                os.rename(tmp.name, final.name, src_dir_fd=jfd, dst_dir_fd=jfd)
                old = aside
            if self.durable:
                os.fsync(jfd)
        return old

    def _retire(self, path: Path) -> None:
        """Dispose of an uncommitted former checkpoint directory (the memory tier recycles it)."""
        self._rmtree(path)

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
                manifest = self._read_manifest(path)
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
            self._rmtree(tmp)
            raise
        except (OSError, CheckpointError) as exc:
            self._rmtree(tmp)
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
                size, digest = copy_checked(src / rel, dst / rel, DEFAULT_ALGORITHM, durable=self.durable,
                                             src_root=src)
                entries.append(FileEntry(rel, size, digest))
            self._fsync_subdirs(dst, entries)
            return Manifest(job, step, self._clock(), DEFAULT_ALGORITHM, tuple(entries), {})
        bad: list[str] = []
        for entry in src_manifest.files:
            rel = safe_relpath(entry.path)
            try:
                size, digest = copy_checked(src / rel, dst / rel, src_manifest.algorithm,
                                             durable=self.durable, src_root=src)
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

    def tree_problem(self, job: str, step: int) -> str | None:
        """Why the committed tree of (job, step) must not be handed to ranks: a symlink or special
        file in it, or an entry another identity than root, the agent or the job's user owns (or
        that others may write). None: safe."""
        try:
            walk_files(self.root, self.step_path(job, step), uids=self.trusted_uids(job))
        except UnsafeTreeError as exc:
            return f"untrusted checkpoint tree: {exc.reason} ({exc.path})"
        except OSError as exc:
            return f"cannot walk the checkpoint tree: {exc}"
        return None

    def verify(self, job: str, step: int) -> VerifyResult:
        path = self.step_path(job, step)
        try:
            self.check_root()
        except UnsafeTreeError as exc:
            return VerifyResult(error=f"tier {self.name}: {exc}")
        unsafe = self.tree_problem(job, step)
        if unsafe is not None:
            return VerifyResult(error=f"tier {self.name}: {job} step {step}: {unsafe}")
        try:
            manifest = self._read_manifest(path)
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
            if not os.path.lexists(final):
                return
            # Rename away first: the checkpoint disappears from listings atomically, and a crash
            # during the removal leaves only a .tmp-* directory for cleanup_tmp.
            tmp = self._tmp_name(job, step, "del")
            rename_beneath(self.root, final, tmp)
            unlink_beneath(self.root, tmp / MANIFEST_NAME)
        self._retire(tmp)

    def cleanup_job_tmp(self, job: str) -> int:
        """Remove the staging directories of one job (its ranks died during a save, or it ended):
        safe whenever none of the job's ranks is alive."""
        removed = 0
        try:
            entries = self._entries(self.job_dir(job))
        except (OSError, ValueError, CheckpointError):
            return 0
        for name, _ in entries:
            if name.startswith(TMP_PREFIX):
                self._rmtree(self.job_dir(job) / name)
                removed += 1
        return removed

    def _entries(self, directory: Path) -> builtins.list[tuple[str, os.stat_result]]:
        """(name, lstat) of each entry of a directory below the root, reached without a symlink."""
        with dir_fd(self.root, directory) as fd:
            return [(n, os.lstat(n, dir_fd=fd)) for n in os.listdir(fd)]

    def cleanup_tmp(self) -> int:
        """Remove crash leftovers; an ``old`` copy whose step a crash left absent (the two-rename
        replacement, where the filesystem cannot exchange) is put back instead."""
        removed = 0
        for job in self.jobs():
            jd = self.job_dir(job)
            try:
                entries = self._entries(jd)
            except OSError:
                continue
            names = {n for n, _ in entries}
            for name, st in entries:
                if not name.startswith(TMP_PREFIX):
                    continue
                step = _old_step(name)
                if step is not None and stat.S_ISDIR(st.st_mode) and step_dirname(step) not in names:
                    try:
                        rename_beneath(self.root, jd / name, jd / step_dirname(step))
                        names.add(step_dirname(step))
                        continue
                    except OSError:
                        pass
                self._rmtree(jd / name)
                removed += 1
        return removed

    def jobs(self) -> builtins.list[str]:
        try:
            entries = self._entries(self.root)
        except (FileNotFoundError, UnsafeTreeError):
            return []
        except OSError:
            return []
        return sorted(n for n, st in entries if stat.S_ISDIR(st.st_mode) and not n.startswith("."))
