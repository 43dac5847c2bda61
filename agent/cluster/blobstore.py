"""What other agents push to this one over the blob API: peer-tier checkpoint copies in RAM.

The daemon sets ``agent.blob_store = BlobStore(root)``; the control API's blob routes
(``PUT/GET/DELETE /v1/blobs/<ns>/<path>``, admin token) call ``put``/``get``/``delete``.

Namespace ``ckpt`` holds checkpoints, laid out exactly like a ``LocalDirTier`` per origin node, so
that a held copy can be read, verified and restored in place by the checkpoint package::

    <root>/ckpt/<origin>/<job>/step_<N>/...            committed copy (manifest inside)
    <root>/ckpt/<origin>/<job>/.tmp-step_<N>-incoming/  upload in progress

Paths in namespace ``ckpt``::

    PUT    <origin>/<job>/step_<N>/<file>              one file into the upload (atomic per file)
    PUT    <origin>/<job>/step_<N>/trainguard-manifest.json
                                                       last: verify every file against it, commit
    DELETE <origin>/<job>/step_<N>/_incoming           drop an upload (a sender starting over)
    DELETE <origin>/<job>/step_<N>                     uncommit and remove a copy (peer pruning)
    GET    <origin>/<job>/step_<N>/<file>              read a committed file
    GET    <origin>/<job>/step_<N>/_verify             verify a committed copy here (JSON)
    GET    <origin>/<job>/_index                       committed copies of that job (JSON)
    GET    _origins                                    origins and their jobs (JSON)

With ``own_node``/``own_root`` set, origin ``own_node`` reads this agent's own memory tier
(read-only): the parts of a checkpoint of a job spanning nodes are fetched from the node that
wrote them exactly as from a node that holds a copy.

Checksums of uploaded files are computed while they arrive, so the manifest commit compares
numbers instead of reading the data again. Other namespaces are plain files (atomic per file).
"""

from __future__ import annotations

import json
import os
import re
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from trainguard.agent.api.handler import ApiError, Blob, BlobReader
from trainguard.agent.checkpoint.errors import CheckpointError, UnsafePathError
from trainguard.agent.checkpoint.local import LocalDirTier, rmtree_quiet
from trainguard.agent.checkpoint.manifest import (
    DEFAULT_ALGORITHM,
    MANIFEST_NAME,
    Manifest,
    new_hasher,
    safe_relpath,
    verify_against,
)
from trainguard.agent.checkpoint.tier import (
    RANK_PEER,
    TMP_PREFIX,
    check_job,
    parse_step_dirname,
    step_dirname,
)

CKPT_NS = "ckpt"
INCOMING = "_incoming"
INDEX = "_index"
VERIFY = "_verify"
ORIGINS = "_origins"
_CHUNK = 1 << 20
_NS = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_NODE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
MAX_MANIFEST_UPLOAD = 16 << 20


def _json_blob(doc: Any) -> Blob:
    data = json.dumps(doc).encode()
    return Blob(len(data), [data], "application/json")


def _file_chunks(path: Path) -> Iterator[bytes]:
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            yield chunk


class HeldTier(LocalDirTier):
    """The copies one origin node pushed here, as a read-only-in-spirit local tier (restore in place)."""

    def __init__(self, root: Path, origin: str) -> None:
        super().__init__(f"peer-held:{origin}", root, RANK_PEER, durable=False, restore_in_place=True)
        self.origin = origin


class BlobStore:
    """Thread-safe. ``max_bytes``: refuse uploads beyond this much held data (0: no limit)."""

    def __init__(self, root: str | os.PathLike[str], *, max_bytes: int = 0, own_node: str = "",
                 own_root: str | os.PathLike[str] | None = None) -> None:
        self.root = Path(root)
        self.max_bytes = max_bytes
        self.own_node = own_node
        self.own_root = Path(own_root) if own_root is not None else None
        self._lock = threading.Lock()
        # (origin, job, step) -> {relpath: (size, crc32)} of files received into the upload
        self._received: dict[tuple[str, str, int], dict[str, tuple[int, str]]] = {}
        self.commits = 0
        self.rejected = 0

    # -- layout ----------------------------------------------------------------------------------
    def ckpt_root(self) -> Path:
        return self.root / CKPT_NS

    def held(self, origin: str) -> HeldTier:
        if not _NODE.match(origin):
            raise ValueError(f"bad origin node name {origin!r}")
        if origin == self.own_node and self.own_root is not None:
            return HeldTier(self.own_root, origin)
        return HeldTier(self.ckpt_root() / origin, origin)

    def _writable(self, origin: str) -> None:
        if origin == self.own_node and self.own_root is not None:
            raise ApiError(403, f"checkpoints of {origin} are this node's own memory tier: read-only over the API")

    def origins(self) -> list[str]:
        try:
            return sorted(p.name for p in self.ckpt_root().iterdir() if p.is_dir() and _NODE.match(p.name))
        except FileNotFoundError:
            return []

    def cleanup_tmp(self) -> int:
        return sum(self.held(o).cleanup_tmp() for o in self.origins())

    def _incoming(self, origin: str, job: str, step: int) -> Path:
        return self.ckpt_root() / origin / job / f"{TMP_PREFIX}{step_dirname(step)}-incoming"

    # -- parsing ---------------------------------------------------------------------------------
    @staticmethod
    def _ns(namespace: str) -> str:
        if not _NS.match(namespace):
            raise ApiError(400, f"bad blob namespace {namespace[:80]!r}")
        return namespace

    @staticmethod
    def _ckpt_path(path: str) -> tuple[str, str, int | None, str]:
        """``origin/job[/step_N[/rel]]`` -> (origin, job, step, rel); ApiError(400) otherwise."""
        parts = path.split("/")
        if len(parts) < 2 or not _NODE.match(parts[0]):
            raise ApiError(400, f"bad checkpoint blob path {path[:200]!r}: expected ORIGIN/JOB/step_N/FILE")
        try:
            check_job(parts[1])
        except ValueError as exc:
            raise ApiError(400, str(exc)) from None
        if len(parts) == 2:
            return parts[0], parts[1], None, ""
        step = parse_step_dirname(parts[2])
        if step is None:
            if len(parts) == 3 and parts[2] == INDEX:
                return parts[0], parts[1], None, INDEX
            raise ApiError(400, f"bad checkpoint blob path {path[:200]!r}: third part must be step_N")
        rel = "/".join(parts[3:])
        if rel and rel not in (INCOMING, VERIFY, MANIFEST_NAME):
            try:
                safe_relpath(rel)
            except UnsafePathError as exc:
                raise ApiError(400, f"bad file path: {exc}") from None
        return parts[0], parts[1], step, rel

    def _plain_path(self, namespace: str, path: str) -> Path:
        try:
            rel = safe_relpath(path)
        except UnsafePathError as exc:
            raise ApiError(400, f"bad blob path: {exc}") from None
        return self.root / namespace / rel

    # -- API -------------------------------------------------------------------------------------
    def put(self, namespace: str, path: str, body: BlobReader) -> dict[str, Any]:
        if self._ns(namespace) != CKPT_NS:
            dst = self._plain_path(namespace, path)
            size, digest = self._receive(body, dst)
            return {"size": size, "checksum": digest}
        origin, job, step, rel = self._ckpt_path(path)
        self._writable(origin)
        if step is None or not rel or rel in (INCOMING, VERIFY):
            raise ApiError(400, "PUT needs ORIGIN/JOB/step_N/FILE")
        if rel == MANIFEST_NAME:
            return self._commit(origin, job, step, body)
        if self.max_bytes and self.held_bytes() + body.size > self.max_bytes:
            raise ApiError(507, f"peer store full: {self.max_bytes} bytes held at most")
        staging = self._incoming(origin, job, step)
        staging.mkdir(parents=True, exist_ok=True)
        size, digest = self._receive(body, staging / rel)
        with self._lock:
            self._received.setdefault((origin, job, step), {})[rel] = (size, digest)
        return {"size": size, "checksum": digest}

    def _receive(self, body: BlobReader, dst: Path) -> tuple[int, str]:
        """Stream ``body`` into ``dst`` via a partial file and rename; crc32 computed on the way."""
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = dst.parent / f".{dst.name}.partial-{uuid.uuid4().hex}"
        hasher = new_hasher(DEFAULT_ALGORITHM)
        size = 0
        try:
            with open(tmp, "wb") as f:
                while chunk := body.read(_CHUNK):
                    hasher.update(chunk)
                    f.write(chunk)
                    size += len(chunk)
            os.replace(tmp, dst)
        except ConnectionError as exc:
            tmp.unlink(missing_ok=True)
            raise ApiError(400, f"upload cut short: {exc}") from None
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise ApiError(507, f"cannot store blob: {exc.strerror or exc}") from None
        return size, hasher.hexdigest()

    def _commit(self, origin: str, job: str, step: int, body: BlobReader) -> dict[str, Any]:
        if body.size > MAX_MANIFEST_UPLOAD:
            raise ApiError(413, "manifest too large")
        data = body.read()
        staging = self._incoming(origin, job, step)
        with self._lock:
            received = self._received.pop((origin, job, step), {})
        try:
            manifest = Manifest.from_json(data)
        except CheckpointError as exc:
            self._reject(staging)
            raise ApiError(422, f"invalid manifest: {exc}") from None
        if manifest.job != job or manifest.step != step:
            self._reject(staging)
            raise ApiError(422, f"manifest names {manifest.job} step {manifest.step}, path says {job} step {step}")
        if not staging.is_dir():
            raise ApiError(409, f"no upload in progress for {origin}/{job}/step_{step}")
        problems = self._check(staging, manifest, received)
        if problems:
            self._reject(staging)
            raise ApiError(422, "checksum verification failed on the receiving side: " + "; ".join(problems[:10]))
        tier = self.held(origin)
        try:
            info = tier.commit_dir(staging, job, step, manifest=manifest)
        except OSError as exc:
            self._reject(staging)
            raise ApiError(507, f"cannot commit: {exc.strerror or exc}") from None
        self.commits += 1
        return {"committed": True, "step": step, "bytes": info.size}

    def _check(self, staging: Path, manifest: Manifest, received: dict[str, tuple[int, str]]) -> list[str]:
        expected = {f.path for f in manifest.files}
        if manifest.algorithm == DEFAULT_ALGORITHM and set(received) == expected:
            bad = [f"checksum mismatch: {f.path}" for f in manifest.files
                   if received[f.path] != (f.size, f.checksum)]
            present = {p.relative_to(staging).as_posix() for p in staging.rglob("*") if p.is_file()}
            return bad + [f"unexpected file: {p}" for p in sorted(present - expected)]
        # Another algorithm, or the agent restarted mid-upload: read the files once more.
        return verify_against(staging, manifest).problems()

    def _reject(self, staging: Path) -> None:
        self.rejected += 1
        rmtree_quiet(staging)

    def get(self, namespace: str, path: str) -> Blob:
        if self._ns(namespace) != CKPT_NS:
            p = self._plain_path(namespace, path)
            return self._file_blob(p)
        if path == ORIGINS:
            return _json_blob({o: self.held(o).jobs() for o in self.origins()})
        origin, job, step, rel = self._ckpt_path(path)
        tier = self.held(origin)
        if rel == INDEX:
            return _json_blob([i.to_dict() for i in tier.list(job)])
        if step is None or not rel or rel == INCOMING:
            raise ApiError(400, "GET needs ORIGIN/JOB/_index or ORIGIN/JOB/step_N/FILE")
        if rel == VERIFY:
            return _json_blob(tier.verify(job, step).to_dict())
        return self._file_blob(tier.step_path(job, step) / rel)

    @staticmethod
    def _file_blob(p: Path) -> Blob:
        try:
            size = p.stat().st_size
        except FileNotFoundError:
            raise ApiError(404, "no such blob") from None
        if not p.is_file():
            raise ApiError(404, "no such blob")
        return Blob(size, _file_chunks(p))

    def delete(self, namespace: str, path: str) -> dict[str, Any]:
        if self._ns(namespace) != CKPT_NS:
            p = self._plain_path(namespace, path)
            existed = p.is_file()
            p.unlink(missing_ok=True)
            return {"deleted": existed}
        origin, job, step, rel = self._ckpt_path(path)
        self._writable(origin)
        if step is None:
            raise ApiError(400, "DELETE needs ORIGIN/JOB/step_N")
        if rel == INCOMING:
            with self._lock:
                self._received.pop((origin, job, step), None)
            staging = self._incoming(origin, job, step)
            existed = staging.exists()
            rmtree_quiet(staging)
            return {"deleted": existed}
        if rel:
            raise ApiError(400, "DELETE of single files of a committed checkpoint is not allowed")
        tier = self.held(origin)
        existed = tier.step_path(job, step).exists()
        tier.delete(job, step)
        return {"deleted": existed}

    def drop_stale(self, keep_origins: set[str], older_than: float, now: float) -> list[str]:
        """Remove every copy held for an origin not in ``keep_origins`` whose newest commit is older
        than ``older_than`` seconds (by directory mtime). Returns the origins removed."""
        removed = []
        for origin in self.origins():
            if origin in keep_origins:
                continue
            root = self.ckpt_root() / origin
            try:
                newest = max((p.stat().st_mtime for p in root.rglob("*")), default=root.stat().st_mtime)
            except OSError:
                continue
            if now - newest >= older_than:
                rmtree_quiet(root)
                removed.append(origin)
        return removed

    def held_bytes(self) -> int:
        total = 0
        for dirpath, _, files in os.walk(self.root):
            for name in files:
                try:
                    total += os.stat(os.path.join(dirpath, name)).st_size
                except OSError:
                    continue
        return total

