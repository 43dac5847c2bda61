"""What other agents push to this one over the blob API: peer-tier checkpoint copies in RAM.

The cluster service holds one (``ClusterService.store``); the control API's blob routes
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

Checksums of uploaded files (sha256, what a signed peer manifest holds) are computed while they
arrive, so the manifest commit compares numbers instead of reading the data again. Other
namespaces are plain files (atomic per file).

Trust: the API lets a node write only copies whose origin is itself (its certificate's name);
with the cluster ``key`` a copy commits only under its origin's signature, and held copies are
verified by that signature too, so nothing another node planted or altered is ever restored.
Bounds: bytes held per origin (``max_origin_bytes``) and in all (``max_bytes``), and free space
left on the store's filesystem (``min_free_bytes``), are checked before an upload is accepted;
a refusal is 413 (larger than a quota can ever hold) or 507 (full now), counted and reported.
"""

from __future__ import annotations

import json
import os
import re
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from trainguard.agent.api.handler import ApiError, Blob, BlobReader
from trainguard.agent.checkpoint.errors import CheckpointError, UnsafePathError
from trainguard.agent.checkpoint.local import LocalDirTier, rmtree_quiet
from trainguard.agent.checkpoint.manifest import (
    DEFAULT_ALGORITHM,
    MANIFEST_NAME,
    Manifest,
    VerifyResult,
    new_hasher,
    read_manifest,
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
from trainguard.agent.cluster.signing import check_manifest, sign_manifest

CKPT_NS = "ckpt"
INCOMING = "_incoming"
INDEX = "_index"
VERIFY = "_verify"
ORIGINS = "_origins"
_CHUNK = 1 << 20
_NS = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_NODE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
MAX_MANIFEST_UPLOAD = 16 << 20
RECEIVE_ALGORITHM = "sha256"  # of checkpoint files as they arrive: what signed manifests hold

RefuseFn = Callable[[str, str, int], None]  # (origin, reason, bytes) of a refused upload


def _json_blob(doc: Any) -> Blob:
    data = json.dumps(doc).encode()
    return Blob(len(data), [data], "application/json")


def _file_chunks(path: Path) -> Iterator[bytes]:
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            yield chunk


class HeldTier(LocalDirTier):
    """The copies one origin node pushed here, as a read-only-in-spirit local tier (restore in place).
    With ``key``, a copy verifies only under its origin's signature besides its checksums."""

    def __init__(self, root: Path, origin: str, key: bytes = b"") -> None:
        super().__init__(f"peer-held:{origin}", root, RANK_PEER, durable=False, restore_in_place=True)
        self.origin = origin
        self.key = key

    def verify(self, job: str, step: int) -> VerifyResult:
        result = super().verify(job, step)
        if not result.ok or not self.key:
            return result
        try:
            check_manifest(self.key, self.origin, result.manifest or read_manifest(self.step_path(job, step)))
        except (CheckpointError, OSError) as exc:
            return VerifyResult(error=str(exc), manifest=result.manifest)
        return result


class BlobStore:
    """Thread-safe. ``max_bytes``/``max_origin_bytes``: data held in all / per origin node at most
    (0: no limit); ``min_free_bytes``: free space an upload must leave on the filesystem; ``key``:
    the cluster key copies are signed with (empty: unsigned copies are accepted, tests only);
    ``on_refuse``: told of every refused upload (the daemon makes it an event)."""

    def __init__(self, root: str | os.PathLike[str], *, max_bytes: int = 0, own_node: str = "",
                 own_root: str | os.PathLike[str] | None = None, max_origin_bytes: int = 0,
                 min_free_bytes: int = 0, key: bytes = b"", on_refuse: RefuseFn | None = None) -> None:
        self.root = Path(root)
        self.max_bytes = max_bytes
        self.max_origin_bytes = max_origin_bytes
        self.min_free_bytes = min_free_bytes
        self.key = key
        self.on_refuse = on_refuse
        self.own_node = own_node
        self.own_root = Path(own_root) if own_root is not None else None
        self._lock = threading.Lock()
        # (origin, job, step) -> {relpath: (size, sha256)} of files received into the upload
        self._received: dict[tuple[str, str, int], dict[str, tuple[int, str]]] = {}
        self._reserved: dict[str, int] = {}  # origin -> bytes of uploads in flight
        self.commits = 0
        self.rejected = 0
        self.refused = 0

    # -- layout ----------------------------------------------------------------------------------
    def ckpt_root(self) -> Path:
        return self.root / CKPT_NS

    def held(self, origin: str) -> HeldTier:
        if not _NODE.match(origin):
            raise ValueError(f"bad origin node name {origin!r}")
        if origin == self.own_node and self.own_root is not None:
            return HeldTier(self.own_root, origin)  # this node's own memory tier: nothing to check
        return HeldTier(self.ckpt_root() / origin, origin, self.key)

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
            with self._admitted(path.split("/", 1)[0], body.size, self.root / namespace):
                size, digest = self._receive(body, dst, DEFAULT_ALGORITHM)
            return {"size": size, "checksum": digest}
        origin, job, step, rel = self._ckpt_path(path)
        self._writable(origin)
        if step is None or not rel or rel in (INCOMING, VERIFY):
            raise ApiError(400, "PUT needs ORIGIN/JOB/step_N/FILE")
        if rel == MANIFEST_NAME:
            return self._commit(origin, job, step, body)
        staging = self._incoming(origin, job, step)
        with self._admitted(origin, body.size, self.ckpt_root() / origin):
            staging.mkdir(parents=True, exist_ok=True)
            size, digest = self._receive(body, staging / rel, RECEIVE_ALGORITHM)
        with self._lock:
            self._received.setdefault((origin, job, step), {})[rel] = (size, digest)
        return {"size": size, "checksum": digest}

    # -- quotas ----------------------------------------------------------------------------------
    def _refuse(self, origin: str, status: int, reason: str, size: int) -> ApiError:
        self.refused += 1
        if self.on_refuse is not None:
            self.on_refuse(origin, reason, size)
        return ApiError(status, reason)

    def _admitted(self, origin: str, size: int, origin_dir: Path) -> _Reservation:
        """Reserve ``size`` bytes for an upload of ``origin`` (released when it ends), or raise
        413/507 when a quota or the filesystem's free space cannot take it."""
        for limit, what in ((self.max_origin_bytes, "per origin node"), (self.max_bytes, "in all")):
            if limit and size > limit:
                raise self._refuse(origin, 413, f"upload of {size} bytes is larger than the peer store's "
                                                f"quota of {limit} bytes {what}", size)
        with self._lock:
            reserved_origin = self._reserved.get(origin, 0)
            reserved_all = sum(self._reserved.values())
            self._reserved[origin] = reserved_origin + size
        try:
            if self.max_origin_bytes:
                held = _bytes_under(origin_dir) + reserved_origin
                if held + size > self.max_origin_bytes:
                    raise self._refuse(origin, 507, f"peer store holds {held} bytes of {origin}'s, quota "
                                                    f"{self.max_origin_bytes}: no room for {size} more", size)
            if self.max_bytes:
                held = self.held_bytes() + reserved_all
                if held + size > self.max_bytes:
                    raise self._refuse(origin, 507, f"peer store holds {held} bytes, quota {self.max_bytes}: "
                                                    f"no room for {size} more", size)
            free = self._free_bytes()
            if free is not None and free - reserved_all - size < self.min_free_bytes:
                raise self._refuse(origin, 507, f"the peer store's filesystem has {free} bytes free; {size} more "
                                                f"would leave less than {self.min_free_bytes}", size)
        except ApiError:
            self._unreserve(origin, size)
            raise
        return _Reservation(self, origin, size)

    def _unreserve(self, origin: str, size: int) -> None:
        with self._lock:
            left = self._reserved.get(origin, 0) - size
            if left > 0:
                self._reserved[origin] = left
            else:
                self._reserved.pop(origin, None)

    def _free_bytes(self) -> int | None:
        path = self.root
        while not path.exists() and path != path.parent:
            path = path.parent
        try:
            st = os.statvfs(path)
        except OSError:
            return None
        return st.f_bavail * st.f_frsize

    def _receive(self, body: BlobReader, dst: Path, algorithm: str) -> tuple[int, str]:
        """Stream ``body`` into ``dst`` via a partial file and rename; checksummed on the way."""
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = dst.parent / f".{dst.name}.partial-{uuid.uuid4().hex}"
        hasher = new_hasher(algorithm)
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
        if self.key:
            try:
                check_manifest(self.key, origin, manifest)
            except CheckpointError as exc:
                self._reject(staging)
                raise self._refuse(origin, 422, f"refused: {exc}", body.size) from None
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
        if manifest.algorithm == RECEIVE_ALGORITHM and set(received) == expected:
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
        if rel == MANIFEST_NAME and origin == self.own_node and self.own_root is not None and self.key:
            return self._signed_own_manifest(tier, job, step)
        return self._file_blob(tier.step_path(job, step) / rel)

    def _signed_own_manifest(self, tier: HeldTier, job: str, step: int) -> Blob:
        """A part of this node's own memory tier, fetched by another node for a restore: its
        manifest goes out signed by this node, the origin, so the fetching node can check it."""
        try:
            manifest = read_manifest(tier.step_path(job, step))
        except FileNotFoundError:
            raise ApiError(404, "no such blob") from None
        except CheckpointError as exc:
            raise ApiError(409, f"own checkpoint {job} step {step} has an unusable manifest: {exc}") from None
        data = sign_manifest(self.key, self.own_node, manifest).to_json()
        return Blob(len(data), [data], "application/json")

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
        return _bytes_under(self.root)


class _Reservation:
    """Bytes reserved for one upload in flight; released when the ``with`` block ends."""

    def __init__(self, store: BlobStore, origin: str, size: int) -> None:
        self.store, self.origin, self.size = store, origin, size

    def __enter__(self) -> _Reservation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.store._unreserve(self.origin, self.size)


def _bytes_under(root: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(root):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                continue
    return total

