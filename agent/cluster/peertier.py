"""The peer tier: a copy of this node's memory checkpoints in another node's RAM.

Writing (``write_from``, fed by the checkpoint replicator like the disk and object tiers): the
files of a committed memory checkpoint are streamed to the peer agent's blob API, checksummed on
the way out against the local manifest (a corrupt source is never copied on) and hashed with
sha256; the manifest goes last, rewritten with those sha256 sums and signed with the cluster key
as this node's (``agent.cluster.signing``), and the receiving agent verifies every file against it
before it commits the copy (``BlobStore``). Which peer: the configured one, else the next node in
sorted membership (ring).

Whoever restores a copy checks the origin's signature and every file itself
(``fetch_remote_copy``): a holder that altered a file and recomputed the checksums has no key to
sign them with, so its copy is refused and the next holder is tried.

Reading, two kinds of copies under the one tier name ``peer``:

* *remote*: copies of our own checkpoints that our peer holds (after this agent lost its RAM,
  e.g. a reboot): listed through the peer's ``_index``, verified there (``_verify``), fetched
  over the API with checksum verification;
* *held*: copies other nodes pushed into our own blob store. After such a node is lost, the
  leader restarts its job here and restores from them in place (nothing to transfer).

On equal steps the catalog prefers the faster tier (memory, then peer, then disk, object); a peer
copy that fails verification is reported corrupt and the next tier is used.
"""

from __future__ import annotations

import builtins
import json
import logging
import os
import ssl
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import BinaryIO

from trainguard.agent.api.client import ApiClient, ApiClientError
from trainguard.agent.checkpoint.errors import (
    CheckpointCorrupt,
    CheckpointError,
    CheckpointNotFound,
    CheckpointWriteError,
    ManifestError,
)
from trainguard.agent.checkpoint.local import rmtree_quiet
from trainguard.agent.checkpoint.manifest import (
    MANIFEST_NAME,
    FileEntry,
    Manifest,
    VerifyResult,
    new_hasher,
    read_manifest,
    write_manifest,
)
from trainguard.agent.checkpoint.tier import (
    RANK_PEER,
    TMP_PREFIX,
    CheckpointInfo,
    Tier,
    check_job,
    step_dirname,
)
from trainguard.agent.cluster.blobstore import CKPT_NS, INCOMING, INDEX, BlobStore, HeldTier
from trainguard.agent.cluster.etcd import parse_endpoint
from trainguard.agent.cluster.signing import check_manifest, sign_manifest

log = logging.getLogger("trainguard.cluster.peer")
_CHUNK = 1 << 20


@dataclass(frozen=True)
class PeerRef:
    node: str
    api: str  # HOST:PORT of its TCP API


ClientFactory = Callable[[PeerRef], ApiClient]


def token_client_factory(token: str | None, timeout: float, tls: ssl.SSLContext | None = None) -> ClientFactory:
    """Clients for peer agents: the cluster's token, and TLS with ``tls`` (the agent's client context)."""
    def make(peer: PeerRef) -> ApiClient:
        host, port = parse_endpoint(peer.api)
        return ApiClient.remote(host, port, token=token, timeout=timeout, tls=tls)

    return make


SIGNED_ALGORITHM = "sha256"  # what a signed peer manifest's file sums are: a crc32 could be forged


class _HashingReader:
    """A file read for upload that checksums what it hands out (with the source manifest's
    algorithm, and with sha256 for the signed manifest the peer gets)."""

    def __init__(self, f: BinaryIO, algorithm: str) -> None:
        self.f = f
        self.hasher = new_hasher(algorithm)
        self.strong = new_hasher(SIGNED_ALGORITHM) if algorithm != SIGNED_ALGORITHM else self.hasher
        self.size = 0

    def read(self, n: int = -1) -> bytes:
        data = self.f.read(n)
        self.hasher.update(data)
        if self.strong is not self.hasher:
            self.strong.update(data)
        self.size += len(data)
        return data


class _HashingSink:
    def __init__(self, f: BinaryIO, algorithm: str) -> None:
        self.f = f
        self.hasher = new_hasher(algorithm)
        self.size = 0

    def write(self, data: bytes) -> int:
        self.hasher.update(data)
        self.size += len(data)
        return self.f.write(data)


class PeerTier(Tier):
    """See the module docstring. ``resolve()`` names the current peer (None: no peer yet)."""

    def __init__(self, node: str, store: BlobStore, resolve: Callable[[], PeerRef | None],
                 client_for: ClientFactory, *, name: str = "peer", key: bytes = b"") -> None:
        """``key``: the cluster key this node signs its copies with and checks fetched copies by."""
        self.key = key
        self.name = name
        self.rank = RANK_PEER
        self.node = node
        self.store = store
        self.resolve = resolve
        self.client_for = client_for
        self.pushed = 0

    # -- helpers ---------------------------------------------------------------------------------
    def _remote(self) -> tuple[PeerRef, ApiClient] | None:
        peer = self.resolve()
        if peer is None or not peer.api:
            return None
        return peer, self.client_for(peer)

    def _path(self, job: str, step: int | None = None, rel: str = "") -> str:
        parts = [self.node, check_job(job)]
        if step is not None:
            parts.append(step_dirname(step))
        if rel:
            parts.append(rel)
        return "/".join(parts)

    def _held(self, job: str) -> dict[int, tuple[HeldTier, CheckpointInfo]]:
        """Copies other nodes pushed here, newest origin copy per step."""
        out: dict[int, tuple[HeldTier, CheckpointInfo]] = {}
        for origin in self.store.origins():
            if origin == self.node:
                continue
            tier = self.store.held(origin)
            for info in tier.list(job):
                cur = out.get(info.step)
                if cur is None or info.created > cur[1].created:
                    out[info.step] = (tier, info)
        return out

    def _remote_list(self, job: str) -> list[CheckpointInfo]:
        remote = self._remote()
        if remote is None:
            return []
        peer, client = remote
        raw = client.get_blob(CKPT_NS, self._path(job, rel=INDEX))
        rows = json.loads(raw)
        out = []
        for row in rows if isinstance(rows, list) else []:
            try:
                out.append(CheckpointInfo(self.name, job, int(row["step"]), f"peer://{peer.node}/{self._path(job, int(row['step']))}",
                                          int(row["size"]), float(row["created"])))
            except (KeyError, TypeError, ValueError):
                continue
        return out

    # -- Tier ------------------------------------------------------------------------------------
    def list(self, job: str) -> list[CheckpointInfo]:
        held = self._held(job)
        by_step: dict[int, CheckpointInfo] = {}
        try:
            for info in self._remote_list(job):
                by_step[info.step] = info
        except (ApiClientError, ValueError) as exc:
            if not held:
                raise CheckpointError(f"tier {self.name}: peer unreachable: {exc}") from None
            log.info("peer listing failed, using held copies only: %s", exc)
        for step, (_tier, info) in held.items():
            by_step[step] = CheckpointInfo(self.name, job, step, info.location, info.size, info.created)
        return [by_step[s] for s in sorted(by_step)]

    def write_from(self, src_dir: Path, job: str, step: int) -> CheckpointInfo:
        remote = self._remote()
        if remote is None:
            raise CheckpointWriteError(self.name, job, step, "no peer node to copy to (cluster of one?)")
        peer, client = remote
        src = Path(src_dir)
        try:
            manifest = read_manifest(src)
        except FileNotFoundError:
            raise CheckpointWriteError(self.name, job, step, f"{src} has no manifest") from None
        except ManifestError as exc:
            raise CheckpointCorrupt(f"source {src}: {exc}") from None
        try:
            client.delete_blob(CKPT_NS, self._path(job, step, INCOMING))  # start clean
            bad: list[str] = []
            strong: list[FileEntry] = []
            for entry in manifest.files:
                path = src / entry.path
                try:
                    with open(path, "rb") as f:
                        reader = _HashingReader(f, manifest.algorithm)
                        client.put_blob(CKPT_NS, self._path(job, step, entry.path), reader,  # type: ignore[arg-type]
                                        size=entry.size)
                except FileNotFoundError:
                    bad.append(f"missing: {entry.path}")
                    continue
                if reader.hasher.hexdigest() != entry.checksum or reader.size != entry.size:
                    bad.append(f"checksum mismatch: {entry.path}")
                strong.append(FileEntry(entry.path, reader.size, reader.strong.hexdigest()))
            if bad:
                client.delete_blob(CKPT_NS, self._path(job, step, INCOMING))
                raise CheckpointCorrupt(f"source {src} does not match its manifest", bad)
            sent = replace(manifest, algorithm=SIGNED_ALGORITHM, files=tuple(strong), signature="")
            if self.key:
                sent = sign_manifest(self.key, self.node, sent)
            client.put_blob(CKPT_NS, self._path(job, step, MANIFEST_NAME), sent.to_json())
        except ApiClientError as exc:
            raise CheckpointWriteError(self.name, job, step, f"peer {peer.node}: {exc}") from None
        except OSError as exc:
            raise CheckpointWriteError(self.name, job, step, exc) from None
        self.pushed += 1
        return CheckpointInfo(self.name, job, step, f"peer://{peer.node}/{self._path(job, step)}",
                              manifest.total_bytes, manifest.created)

    def open(self, job: str, step: int) -> Path | None:
        held = self._held(job).get(step)
        return held[0].open(job, step) if held is not None else None

    def fetch(self, job: str, step: int, dest_dir: Path) -> Path:
        held = self._held(job).get(step)
        if held is not None:
            return held[0].fetch(job, step, dest_dir)
        remote = self._remote()
        if remote is None:
            raise CheckpointNotFound(f"tier {self.name}: no peer")
        peer, client = remote
        return fetch_remote_copy(client, peer.node, self.node, job, step, Path(dest_dir), key=self.key,
                                 label=f"tier {self.name}")

    def verify(self, job: str, step: int) -> VerifyResult:
        held = self._held(job).get(step)
        if held is not None:
            return held[0].verify(job, step)
        remote = self._remote()
        if remote is None:
            return VerifyResult(error=f"tier {self.name}: no peer")
        peer, client = remote
        # The peer's own word ("_verify") is not trusted: its manifest must carry this node's
        # signature; every file is then checked against it when the copy is fetched.
        try:
            manifest = Manifest.from_json(client.get_blob(CKPT_NS, self._path(job, step, MANIFEST_NAME)))
            if manifest.job != job or manifest.step != step:
                raise CheckpointCorrupt(f"manifest names {manifest.job} step {manifest.step}")
            if not self.key:
                raise CheckpointError("no cluster key to check the copy's signature with")
            check_manifest(self.key, self.node, manifest)
        except (ApiClientError, CheckpointError) as exc:
            return VerifyResult(error=f"peer {peer.node}: cannot verify: {exc}")
        return VerifyResult(manifest=manifest)

    def delete(self, job: str, step: int) -> None:
        held = self._held(job).get(step)
        if held is not None:
            held[0].delete(job, step)
            return
        remote = self._remote()
        if remote is None:
            return
        try:
            remote[1].delete_blob(CKPT_NS, self._path(job, step))
        except ApiClientError as exc:
            raise CheckpointError(f"tier {self.name}: delete at {remote[0].node} failed: {exc}") from None

    def prune(self, job: str, keep: int, listed: builtins.list[CheckpointInfo] | None = None) -> builtins.list[int]:
        """Prune only our own copies at the peer; held copies belong to their origin nodes (always
        listed there afresh: ``listed`` is of this node's view)."""
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        remote = self._remote()
        if remote is None:
            return []
        try:
            infos = self._remote_list(job)
        except (ApiClientError, ValueError) as exc:
            raise CheckpointError(f"tier {self.name}: listing at {remote[0].node} failed: {exc}") from None
        deleted = []
        for info in infos[:-keep]:
            try:
                remote[1].delete_blob(CKPT_NS, self._path(job, info.step))
            except ApiClientError as exc:
                raise CheckpointError(f"tier {self.name}: delete at {remote[0].node} failed: {exc}") from None
            deleted.append(info.step)
        return deleted

    def cleanup_tmp(self) -> int:
        return self.store.cleanup_tmp()


def ring_peer(me: str, members: dict[str, str], configured: str = "") -> PeerRef | None:
    """The node that holds ``me``'s copy: ``configured`` if it is a member, else the next node
    after ``me`` in sorted order (wrapping). ``members``: node -> API address."""
    if configured:
        api = members.get(configured)
        return PeerRef(configured, api) if api else None
    names = sorted(n for n, api in members.items() if api and n != me)
    if not names:
        return None
    after = [n for n in names if n > me]
    chosen = after[0] if after else names[0]
    return PeerRef(chosen, members[chosen])


def fetch_remote_copy(client: ApiClient, holder: str, origin: str, job: str, step: int, dest: Path, *,
                      key: bytes, label: str = "remote copy") -> Path:
    """Download ``origin``'s checkpoint ``job`` step ``step`` from the agent ``holder`` (its own
    memory tier when ``holder == origin``, else a copy it holds) into ``dest``: the manifest must
    carry ``origin``'s signature by the cluster ``key``, and every file is checked against it while
    it arrives (nothing of the holder's own verification is trusted). ``dest`` appears complete or
    not at all; a bad copy raises CheckpointCorrupt."""
    if not key:
        raise CheckpointError(f"{label}: no cluster key to check {origin}'s signature with")
    prefix = f"{origin}/{check_job(job)}/{step_dirname(step)}"
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f"{TMP_PREFIX}fetch-{dest.name}-{uuid.uuid4().hex}"
    tmp.mkdir()
    try:
        try:
            raw = client.get_blob(CKPT_NS, f"{prefix}/{MANIFEST_NAME}")
        except ApiClientError as exc:
            if exc.status == 404:
                raise CheckpointNotFound(f"{label}: {holder} holds no {job} step {step}") from None
            raise
        manifest = Manifest.from_json(raw)
        if manifest.job != job or manifest.step != step:
            raise CheckpointCorrupt(f"{label}: manifest on {holder} names {manifest.job} step {manifest.step}")
        check_manifest(key, origin, manifest, where=f"{label} on {holder}: ")
        bad: list[str] = []
        for entry in manifest.files:
            target = tmp / entry.path
            target.parent.mkdir(parents=True, exist_ok=True)
            with open(target, "wb") as f:
                sink = _HashingSink(f, manifest.algorithm)
                client.get_blob(CKPT_NS, f"{prefix}/{entry.path}", sink)
            if sink.size != entry.size or sink.hasher.hexdigest() != entry.checksum:
                bad.append(f"checksum mismatch: {entry.path}")
        if bad:
            raise CheckpointCorrupt(f"copy of {job} step {step} on {holder} is corrupt", bad)
        write_manifest(tmp, manifest, durable=False)
        os.rename(tmp, dest)
    except ApiClientError as exc:
        rmtree_quiet(tmp)
        raise CheckpointError(f"{label}: fetching from {holder} failed: {exc}") from None
    except BaseException:
        rmtree_quiet(tmp)
        raise
    return dest
