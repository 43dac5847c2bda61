"""The object tier: checkpoints in an object store through fsspec (``s3://bucket/prefix``, ``file://``).

Object stores have no atomic directory rename, so the manifest is the commit marker: data objects
are uploaded first and the manifest LAST; ``list`` only reports checkpoints whose manifest exists,
and ``delete`` removes the manifest first. Uploads are streamed and hashed on the way (one read of
the source), and checked against the source's manifest; downloads are hashed on the way and
compared with the stored manifest before the local directory is renamed into place.

Checkpoints are keyed ``<base>/<cluster>/<job uid>/<job>/step_N``: the uid is unique per
submission, so two clusters' jobs named ``train`` (or a job submitted again under an old name)
never list, restore or prune each other's steps. Every manifest carries the writer's epoch; a
writer older than the newest committed epoch of the same job (a fenced copy still running) does
not commit and prunes nothing.
"""

from __future__ import annotations

import builtins
import contextlib
import os
import re
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fsspec

from trainguard.agent.checkpoint.errors import (
    CheckpointCorrupt,
    CheckpointError,
    CheckpointNotFound,
    CheckpointWriteError,
    ManifestError,
    UnsafePathError,
)
from trainguard.agent.checkpoint.local import rmtree_quiet
from trainguard.agent.checkpoint.manifest import (
    CHUNK_BYTES,
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    FileEntry,
    Manifest,
    VerifyResult,
    build_manifest,
    new_hasher,
    read_manifest,
    safe_relpath,
    write_manifest,
)
from trainguard.agent.checkpoint.tier import (
    RANK_OBJECT,
    TMP_PREFIX,
    CheckpointInfo,
    Tier,
    check_job,
    parse_step_dirname,
    step_dirname,
)

_SCHEMES = ("s3", "file", "memory")
_SEGMENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_UID = re.compile(r"^[0-9a-f]{8,64}$")
UNSCOPED_UID = "unscoped"
"""The uid segment of a job this agent knows no uid for (a record written before uids)."""
EPOCH_KEY = "writer_epoch"
UID_KEY = "job_uid"


@dataclass(frozen=True)
class ObjectScope:
    """Which submission of a job a checkpoint belongs to, and the fencing epoch of its writer."""

    uid: str
    epoch: int = 0

    def __post_init__(self) -> None:
        if self.uid != UNSCOPED_UID and not _UID.match(self.uid):
            raise ValueError(f"job uid {self.uid[:80]!r} is not 8-64 lowercase hex digits")
        if isinstance(self.epoch, bool) or not isinstance(self.epoch, int) or not 0 <= self.epoch < 1 << 62:
            raise ValueError(f"epoch {self.epoch!r} is not a non-negative integer")


_UNSCOPED = ObjectScope(UNSCOPED_UID, 0)


class StaleEpoch(CheckpointError):
    """A writer whose epoch is older than one already committed for the job: it is fenced."""


@dataclass(frozen=True)
class ObjectStoreConfig:
    """Where the object tier lives and how to reach it."""

    url: str
    """``s3://bucket/prefix``, ``file:///abs/path`` (or ``memory://x`` in tests)."""
    endpoint_url: str | None = None
    """S3-compatible endpoint (MinIO, moto, Ceph); None: AWS."""
    key: str | None = None
    """Access key id; None: the default credential chain."""
    secret: str | None = field(default=None, repr=False)
    """Secret access key (never printed)."""
    region: str | None = None
    timeout_s: float = 30.0
    """Connect/read timeout of each request."""
    retries: int = 3
    """Attempts per request (botocore)."""

    def __post_init__(self) -> None:
        scheme, sep, rest = self.url.partition("://")
        if not sep or scheme not in _SCHEMES or not rest.strip("/"):
            raise ValueError(f"checkpoint.object.url: {self.url!r} must look like s3://bucket/prefix or file:///path")
        if scheme == "file" and not rest.startswith("/"):
            raise ValueError(f"checkpoint.object.url: {self.url!r} must be an absolute file:/// path")
        if self.timeout_s <= 0:
            raise ValueError(f"checkpoint.object.timeout_s must be > 0, got {self.timeout_s}")
        if self.retries < 1:
            raise ValueError(f"checkpoint.object.retries must be >= 1, got {self.retries}")
        if (self.key is None) != (self.secret is None):
            raise ValueError("checkpoint.object.key and checkpoint.object.secret must be given together")

    @property
    def scheme(self) -> str:
        return self.url.partition("://")[0]

    def storage_options(self) -> dict[str, Any]:
        if self.scheme == "file":
            return {"auto_mkdir": True}
        if self.scheme != "s3":
            return {}
        opts: dict[str, Any] = {
            "skip_instance_cache": True,
            "config_kwargs": {
                "connect_timeout": self.timeout_s,
                "read_timeout": self.timeout_s,
                "retries": {"max_attempts": self.retries, "mode": "standard"},
            },
        }
        client: dict[str, Any] = {}
        if self.endpoint_url:
            client["endpoint_url"] = self.endpoint_url
        if self.region:
            client["region_name"] = self.region
        if client:
            opts["client_kwargs"] = client
        if self.key is not None:
            opts["key"] = self.key
            opts["secret"] = self.secret
        return opts


class ObjectTier(Tier):
    def __init__(
        self,
        config: ObjectStoreConfig,
        *,
        name: str = "object",
        orphan_age_s: float = 3600.0,
        clock: Callable[[], float] = time.time,
        cluster: str = "default",
        scope: Callable[[str], ObjectScope | None] | None = None,
    ) -> None:
        if not _SEGMENT.match(cluster):
            raise ValueError(f"cluster name {cluster[:80]!r} is not one path segment")
        self.name = name
        self.cluster = cluster
        self._scope_fn = scope
        self.orphan_age_s = orphan_age_s
        self.rank = RANK_OBJECT
        self.config = config
        self._clock = clock
        fs, base = fsspec.core.url_to_fs(config.url, **config.storage_options())
        self.fs = fs
        self.base = str(base).rstrip("/")

    # -- scope -----------------------------------------------------------------------------------
    def scope(self, job: str) -> ObjectScope:
        """The uid and writer epoch of ``job`` (a part key ``<job>.part-<node>`` is its job's);
        a job the resolver does not know, or a resolver that fails, is unscoped."""
        if self._scope_fn is None:
            return _UNSCOPED
        try:
            found = self._scope_fn(job)
        except Exception:  # noqa: BLE001 - the resolver reads live agent state; never fail a tier call on it
            return _UNSCOPED
        return found if isinstance(found, ObjectScope) else _UNSCOPED

    def _cluster_root(self) -> str:
        return f"{self.base}/{self.cluster}"

    # -- paths -----------------------------------------------------------------------------------
    def _job(self, job: str) -> str:
        return f"{self._cluster_root()}/{self.scope(job).uid}/{check_job(job)}"

    def job_prefix(self, job: str) -> str:
        """Where ``job``'s checkpoints are stored (this cluster, the job's current uid)."""
        return self._job(job)

    def _step(self, job: str, step: int) -> str:
        return f"{self._job(job)}/{step_dirname(step)}"

    def url_of(self, job: str, step: int) -> str:
        path = self._step(job, step)
        return f"file://{path}" if self.config.scheme == "file" else f"{self.config.scheme}://{path.lstrip('/')}"

    def _invalidate(self, path: str) -> None:
        with contextlib.suppress(Exception):
            self.fs.invalidate_cache(path)

    def _read_manifest(self, job: str, step: int) -> Manifest:
        path = f"{self._step(job, step)}/{MANIFEST_NAME}"
        with self.fs.open(path, "rb") as f:
            data = f.read(MAX_MANIFEST_BYTES + 1)
        return Manifest.from_json(data)

    # -- Tier ------------------------------------------------------------------------------------
    def list(self, job: str) -> list[CheckpointInfo]:
        jp = self._job(job)
        self._invalidate(jp)
        try:
            names = self.fs.ls(jp, detail=False)
        except FileNotFoundError:
            return []
        except Exception as exc:
            raise CheckpointError(f"tier {self.name}: listing {jp} failed: {exc}") from exc
        out = []
        for entry in names:
            step = parse_step_dirname(str(entry).rstrip("/").rsplit("/", 1)[-1])
            if step is None:
                continue
            try:
                manifest = self._read_manifest(job, step)
            except FileNotFoundError:
                continue  # upload in progress or aborted: not committed
            except ManifestError:
                out.append(CheckpointInfo(self.name, job, step, self.url_of(job, step), 0, 0.0))
                continue
            except Exception as exc:
                raise CheckpointError(f"tier {self.name}: reading manifest of step {step} failed: {exc}") from exc
            out.append(CheckpointInfo(self.name, job, step, self.url_of(job, step),
                                      manifest.total_bytes, manifest.created))
        return sorted(out, key=lambda i: i.step)

    def write_from(self, src_dir: Path, job: str, step: int) -> CheckpointInfo:
        src = Path(src_dir)
        sp = self._step(job, step)
        data: str | None = None
        try:
            try:
                manifest = read_manifest(src)
            except FileNotFoundError:
                manifest = build_manifest(src, job, step, created=self._clock())
            # Replace, then delete: a step saved again gets its objects under a generation of their
            # own, the manifest naming it is the one-object commit, and only then does the older
            # copy go. A failure or crash at any point leaves the older copy listed whole.
            scope = self.scope(job)
            manifest = Manifest(job, step, manifest.created, manifest.algorithm, manifest.files,
                                {**manifest.extra, EPOCH_KEY: scope.epoch, UID_KEY: scope.uid})
            self._check_epoch(job, scope.epoch)
            old = self._committed_or_none(job, step)
            if old is None:
                self._remove_prefix(sp)  # an upload that never committed: nothing listed is lost
                data = sp
            else:
                generation = f"g{uuid.uuid4().hex[:12]}"
                manifest = Manifest(job, step, manifest.created, manifest.algorithm, manifest.files,
                                    {**manifest.extra, GENERATION_KEY: generation})
                data = f"{sp}/{generation}"
            bad: list[str] = []
            for entry in manifest.files:
                if not self._upload(src / safe_relpath(entry.path), f"{data}/{entry.path}", entry,
                                    manifest.algorithm):
                    bad.append(f"checksum mismatch: {entry.path}")
            if bad:
                raise CheckpointCorrupt(f"source {src} does not match its manifest", bad)
            # Conditional commit: checked again right before the one-object commit, so a copy
            # fenced during its upload does not commit over the newer owner's lineage.
            self._check_epoch(job, scope.epoch)
            self.fs.pipe_file(f"{sp}/{MANIFEST_NAME}", manifest.to_json())  # the commit
        except (CheckpointCorrupt, StaleEpoch):
            if data is not None:
                self._remove_prefix(data)
            raise
        except Exception as exc:
            if data is not None:
                self._remove_prefix(data)
            raise CheckpointWriteError(self.name, job, step, exc) from exc
        if old is not None:
            self._remove_data(sp, old)
        self._invalidate(self._job(job))
        return CheckpointInfo(self.name, job, step, self.url_of(job, step), manifest.total_bytes, manifest.created)

    def committed_epoch(self, job: str) -> int | None:
        """The newest writer epoch among ``job``'s committed manifests (None: none committed)."""
        jp = self._job(job)
        self._invalidate(jp)
        try:
            names = self.fs.ls(jp, detail=False)
        except FileNotFoundError:
            return None
        newest: int | None = None
        for entry in names:
            step = parse_step_dirname(str(entry).rstrip("/").rsplit("/", 1)[-1])
            if step is None:
                continue
            epoch = self._epoch_of(job, step)
            if epoch is not None and (newest is None or epoch > newest):
                newest = epoch
        return newest

    def _epoch_of(self, job: str, step: int) -> int | None:
        try:
            manifest = self._read_manifest(job, step)
        except Exception:  # noqa: BLE001 - uncommitted or unreadable: no epoch to respect
            return None
        return manifest_epoch(manifest)

    def _check_epoch(self, job: str, epoch: int) -> None:
        newest = self.committed_epoch(job)
        if newest is not None and newest > epoch:
            raise StaleEpoch(f"tier {self.name}: {job} has steps committed at epoch {newest}; "
                             f"this writer's epoch {epoch} is fenced")

    def prune(self, job: str, keep: int,
              listed: builtins.list[CheckpointInfo] | None = None) -> builtins.list[int]:
        """The base prune, but a writer older than the job's newest committed epoch prunes
        nothing: its idea of "the newest ``keep``" misses the newer owner's steps."""
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        newest = self.committed_epoch(job)
        if newest is not None and newest > self.scope(job).epoch:
            return []
        return super().prune(job, keep, listed)

    def _may_delete(self, job: str, step: int) -> bool:
        """Never a step a newer epoch committed (it may have been committed since the listing)."""
        epoch = self._epoch_of(job, step)
        return epoch is None or epoch <= self.scope(job).epoch

    def _committed_or_none(self, job: str, step: int) -> Manifest | None:
        """The manifest of a committed copy of (job, step) that a new copy replaces, if any."""
        try:
            return self._read_manifest(job, step)
        except FileNotFoundError:
            return None
        except Exception:  # noqa: BLE001 - unreadable: its objects stay for cleanup_tmp's age rule
            return None

    def _remove_data(self, sp: str, old: Manifest) -> None:
        """Delete a replaced copy's objects: its generation, or (a copy written before
        generations) exactly the files its manifest names."""
        generation = _generation(old)
        if generation is not None:
            self._remove_prefix(f"{sp}/{generation}")
            return
        for entry in old.files:
            with contextlib.suppress(Exception):
                self.fs.rm_file(f"{sp}/{safe_relpath(entry.path)}")
        self._invalidate(sp)

    def _data(self, sp: str, manifest: Manifest) -> str:
        """Where a committed copy's data objects are."""
        generation = _generation(manifest)
        return f"{sp}/{generation}" if generation is not None else sp

    def _upload(self, local: Path, remote: str, entry: FileEntry, algorithm: str) -> bool:
        hasher = new_hasher(algorithm)
        size = 0
        with open(local, "rb") as fin, self.fs.open(remote, "wb") as fout:
            while chunk := fin.read(CHUNK_BYTES):
                hasher.update(chunk)
                fout.write(chunk)
                size += len(chunk)
        return size == entry.size and hasher.hexdigest() == entry.checksum

    def _uncommit(self, job: str, step: int) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(f"{self._step(job, step)}/{MANIFEST_NAME}")

    def _remove_prefix(self, prefix: str) -> None:
        with contextlib.suppress(Exception):
            self.fs.rm(prefix, recursive=True)
        self._invalidate(prefix)

    def open(self, job: str, step: int) -> Path | None:
        return None

    def _stream(self, remote: str, algorithm: str, sink: Any = None) -> tuple[int, str]:
        hasher = new_hasher(algorithm)
        size = 0
        with self.fs.open(remote, "rb", block_size=CHUNK_BYTES) as f:
            while chunk := f.read(CHUNK_BYTES):
                hasher.update(chunk)
                size += len(chunk)
                if sink is not None:
                    sink.write(chunk)
        return size, hasher.hexdigest()

    def fetch(self, job: str, step: int, dest_dir: Path) -> Path:
        try:
            manifest = self._read_manifest(job, step)
        except FileNotFoundError:
            raise CheckpointNotFound(f"tier {self.name}: no committed {job} step {step}") from None
        dest = Path(dest_dir)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.parent / f"{TMP_PREFIX}fetch-{dest.name}-{uuid.uuid4().hex}"
        tmp.mkdir()
        sp = self._data(self._step(job, step), manifest)
        try:
            bad: list[str] = []
            for entry in manifest.files:
                rel = safe_relpath(entry.path)
                local = tmp / rel
                local.parent.mkdir(parents=True, exist_ok=True)
                try:
                    with open(local, "wb") as out:
                        size, digest = self._stream(f"{sp}/{rel}", manifest.algorithm, out)
                except FileNotFoundError:
                    bad.append(f"missing: {rel}")
                    continue
                if size != entry.size:
                    bad.append(f"size mismatch: {rel}")
                elif digest != entry.checksum:
                    bad.append(f"checksum mismatch: {rel}")
            if bad:
                raise CheckpointCorrupt(f"tier {self.name}: {job} step {step} fails verification", bad)
            write_manifest(tmp, manifest, durable=False)
            os.rename(tmp, dest)
        except BaseException:
            rmtree_quiet(tmp)
            raise
        return dest

    def verify(self, job: str, step: int) -> VerifyResult:
        try:
            manifest = self._read_manifest(job, step)
        except FileNotFoundError:
            return VerifyResult(error=f"tier {self.name}: no manifest for {job} step {step}")
        except ManifestError as exc:
            return VerifyResult(error=f"invalid manifest: {exc}")
        except Exception as exc:
            return VerifyResult(error=f"cannot read manifest: {exc}")
        step_prefix = self._step(job, step)
        sp = self._data(step_prefix, manifest)
        self._invalidate(step_prefix)
        try:
            listed = self.fs.find(sp, detail=True)
        except Exception as exc:
            return VerifyResult(error=f"cannot list {sp}: {exc}", manifest=manifest)
        present: dict[str, int] = {}
        extra: list[str] = []
        for key, info in listed.items():
            if not str(key).startswith(sp + "/"):
                extra.append(repr(key))
                continue
            rel = str(key)[len(sp) + 1:]
            if rel == MANIFEST_NAME or (sp == step_prefix and _GENERATION_RE.match(rel.split("/", 1)[0])):
                continue  # the manifest; another generation (a newer copy being uploaded)
            try:
                present[safe_relpath(rel)] = int(info.get("size") or 0)
            except UnsafePathError:
                extra.append(repr(rel))
        expected = {e.path: e for e in manifest.files}
        missing = sorted(set(expected) - set(present))
        extra += sorted(set(present) - set(expected))
        size_bad, sum_bad = [], []
        for path in sorted(set(expected) & set(present)):
            if present[path] != expected[path].size:
                size_bad.append(path)
                continue
            try:
                _, digest = self._stream(f"{sp}/{path}", manifest.algorithm)
            except Exception:
                missing.append(path)
                continue
            if digest != expected[path].checksum:
                sum_bad.append(path)
        error = None
        if manifest.job != job or manifest.step != step:
            error = f"manifest names {manifest.job} step {manifest.step}"
        return VerifyResult(tuple(missing), tuple(extra), tuple(size_bad), tuple(sum_bad), error, manifest)

    def delete(self, job: str, step: int) -> None:
        self._uncommit(job, step)
        self._remove_prefix(self._step(job, step))
        self._invalidate(self._job(job))

    def cleanup_tmp(self, min_age_s: float | None = None) -> int:
        """Remove uploads that never got their manifest (a crash mid-upload).

        Only prefixes whose newest object is older than ``min_age_s`` (default: this tier's
        ``orphan_age_s``) go: another agent may be uploading into the same store right now.
        """
        age = self.orphan_age_s if min_age_s is None else min_age_s
        now = self._clock()
        removed = 0
        root = self._cluster_root()
        self._invalidate(root)
        try:
            uids = self.fs.ls(root, detail=False)
        except (FileNotFoundError, NotADirectoryError):
            return 0
        for uid_path in uids:
            uid = str(uid_path).rstrip("/").rsplit("/", 1)[-1]
            if uid != UNSCOPED_UID and not _UID.match(uid):
                continue
            try:
                jobs = self.fs.ls(f"{root}/{uid}", detail=False)
            except (FileNotFoundError, NotADirectoryError):
                continue
            for job_path in jobs:
                job = str(job_path).rstrip("/").rsplit("/", 1)[-1]
                try:
                    check_job(job)
                    jp = f"{root}/{uid}/{job}"
                    entries = self.fs.ls(jp, detail=False)
                except (ValueError, FileNotFoundError, NotADirectoryError):
                    continue
                for entry in entries:
                    step = parse_step_dirname(str(entry).rstrip("/").rsplit("/", 1)[-1])
                    if step is None:
                        continue
                    sp = f"{jp}/{step_dirname(step)}"
                    if self.fs.exists(f"{sp}/{MANIFEST_NAME}"):
                        removed += self._remove_stale_generations(sp, now - age)
                        continue
                    listed = self.fs.find(sp, detail=True)
                    newest = max((_mtime(info) for info in listed.values()), default=0.0)
                    if now - newest >= age:
                        self._remove_prefix(sp)
                        removed += 1
        return removed

    def _remove_stale_generations(self, sp: str, before: float) -> int:
        """Generations of a committed step (at ``sp``) that its manifest does not name (a re-save
        that never committed, or whose older copy a crash left behind), once nothing in them is
        newer than ``before``."""
        try:
            with self.fs.open(f"{sp}/{MANIFEST_NAME}", "rb") as f:
                current = _generation(Manifest.from_json(f.read(MAX_MANIFEST_BYTES + 1)))
            entries = self.fs.ls(sp, detail=False)
        except Exception:  # noqa: BLE001 - unreadable now: left for the next start
            return 0
        removed = 0
        for entry in entries:
            name = str(entry).rstrip("/").rsplit("/", 1)[-1]
            if not _GENERATION_RE.match(name) or name == current:
                continue
            listed = self.fs.find(f"{sp}/{name}", detail=True)
            if max((_mtime(info) for info in listed.values()), default=0.0) <= before:
                self._remove_prefix(f"{sp}/{name}")
                removed += 1
        return removed


GENERATION_KEY = "object_generation"
"""Manifest ``extra`` key naming the prefix under the step that holds this copy's data objects."""
_GENERATION_RE = re.compile(r"^g[0-9a-f]{12}$")


def _generation(manifest: Manifest) -> str | None:
    value = manifest.extra.get(GENERATION_KEY)
    return value if isinstance(value, str) and _GENERATION_RE.match(value) else None


def manifest_epoch(manifest: Manifest) -> int:
    """The writer epoch a manifest carries (0: written before epochs, or malformed)."""
    value = manifest.extra.get(EPOCH_KEY, 0)
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 62 else 0


def _mtime(info: Mapping[str, Any]) -> float:
    """Modification time of an fsspec listing entry (s3: LastModified datetime; local: mtime)."""
    value = info.get("LastModified", info.get("mtime", info.get("created", 0.0)))
    if hasattr(value, "timestamp"):
        return float(value.timestamp())
    return float(value or 0.0)
