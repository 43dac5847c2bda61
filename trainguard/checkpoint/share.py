"""Sending a whole checkpoint from the ranks of the nodes that hold it to the ranks of the nodes
that do not, over the job's own process group, when a job spanning nodes starts a round with a
new world (a node lost or joined): the nodes agreed on the step, and only some of them hold it.

The lowest rank that holds it reads the checkpoint's regular files (never following a link) and
broadcasts an index and their bytes as tensors (nothing is unpickled) to one rank per node that
lacks it, which writes them into a fresh private directory; that node's other ranks load from
there, once the copy matches the checkpoint's manifest.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from trainguard.agent.checkpoint.errors import ManifestError
from trainguard.agent.checkpoint.manifest import MANIFEST_NAME, safe_relpath, verify

CHUNK_BYTES = 64 << 20
"""The most bytes one broadcast carries: a large file goes in several."""

MAX_INDEX_BYTES = 16 << 20
MAX_FILES = 100_000
PATH_BYTES = 1024
"""Room for a receiving node's directory name in the all-gather that tells its ranks."""


class ShareError(RuntimeError):
    """The checkpoint could not be sent: one line, the same on every rank."""


@dataclass(frozen=True)
class _Rank:
    holds: bool
    node: int
    local_rank: int


def _cpu_group() -> dist.ProcessGroup | None:
    """A group that carries CPU tensors: the default one under gloo, else a gloo group of all ranks."""
    return None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")


def _gather_ranks(holds: bool, node: int, local_rank: int, world: int, group: dist.ProcessGroup | None) -> list[_Rank]:
    mine = torch.tensor([int(holds), node, local_rank], dtype=torch.int64)
    rows = [torch.zeros(3, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(rows, mine, group=group)
    return [_Rank(bool(r[0]), int(r[1]), int(r[2])) for r in rows]


def _files(root: str) -> list[tuple[str, int]]:
    """The regular files below ``root`` as (relative path, size), sorted; a link or anything but a
    file or directory refuses the whole checkpoint."""
    out: list[tuple[str, int]] = []
    for here, dirs, names in os.walk(root, followlinks=False):
        for name in dirs + names:
            path = os.path.join(here, name)
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode):
                out.append((os.path.relpath(path, root), st.st_size))
            elif not stat.S_ISDIR(st.st_mode):
                raise ShareError(f"{path} is neither a file nor a directory")
    return sorted(out)


def _broadcast_bytes(data: bytes | None, size: int, src: int, group: dist.ProcessGroup | None) -> bytes:
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(size, dtype=torch.uint8)
    if size:
        dist.broadcast(buf, src=src, group=group)
    return buf.numpy().tobytes()


def _send(root: str, src: int, group: dist.ProcessGroup | None) -> None:
    files = _files(root)
    # Every file is opened before the index goes out: a receiver waits on each broadcast, so a
    # failure past this point would leave it waiting for gloo's timeout.
    handles = [open(os.path.join(root, rel), "rb", opener=_nofollow) for rel, _size in files]  # noqa: SIM115
    try:
        index = json.dumps(files).encode()
        head = torch.tensor([len(index)], dtype=torch.int64)
        dist.broadcast(head, src=src, group=group)
        _broadcast_bytes(index, len(index), src, group)
        for (_rel, size), fh in zip(files, handles, strict=True):
            left = size
            while left:
                n = min(CHUNK_BYTES, left)
                chunk = fh.read(n)
                if len(chunk) != n:
                    chunk += bytes(n - len(chunk))  # the receiver's checksum check fails it, not a hang
                _broadcast_bytes(chunk, n, src, group)
                left -= n
    finally:
        for fh in handles:
            fh.close()


def _receive(dest: str, src: int, group: dist.ProcessGroup | None) -> None:
    head = torch.zeros(1, dtype=torch.int64)
    dist.broadcast(head, src=src, group=group)
    length = int(head.item())
    if not 0 < length <= MAX_INDEX_BYTES:
        raise ShareError(f"checkpoint index of {length} bytes")
    try:
        files = json.loads(_broadcast_bytes(None, length, src, group))
    except ValueError as exc:
        raise ShareError("the checkpoint index is not JSON") from exc
    if not isinstance(files, list) or len(files) > MAX_FILES:
        raise ShareError("the checkpoint index is not a list of files")
    sizes = [e[1] if isinstance(e, list) and len(e) == 2 and isinstance(e[1], int) and e[1] >= 0 else None
             for e in files]
    if None in sizes:
        raise ShareError(f"bad checkpoint index entry: {files[sizes.index(None)]!r}")
    # A receiver that cannot take a file goes on taking the broadcasts (and drops them): the sender
    # must not be left waiting for it.
    problem = ""
    for entry in files:
        fh = None
        try:
            rel, size = _check_entry(entry)
            path = os.path.join(dest, rel)
            os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
            fh = os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600), "wb")
        except (OSError, ShareError) as exc:
            problem = problem or str(exc)
        left = entry[1]
        try:
            while left:
                n = min(CHUNK_BYTES, left)
                data = _broadcast_bytes(None, n, src, group)
                left -= n
                if fh is not None and not problem:
                    try:
                        fh.write(data)
                    except OSError as exc:
                        problem = str(exc)
        finally:
            if fh is not None:
                fh.close()
    if problem:
        raise ShareError(problem)
    checked = verify(dest)
    if not checked.ok:
        raise ShareError(f"the checkpoint received does not match its manifest: {checked.problems()[0]}")


def _check_entry(entry: object) -> tuple[str, int]:
    """An index entry ``[relative path, size]``, or ``ShareError``."""
    if not isinstance(entry, list) or len(entry) != 2 or not isinstance(entry[1], int) or entry[1] < 0:
        raise ShareError(f"bad checkpoint index entry: {entry!r}")
    try:
        return (entry[0] if entry[0] == MANIFEST_NAME else safe_relpath(entry[0])), entry[1]
    except ManifestError as exc:
        raise ShareError(str(exc)) from exc


def _nofollow(path: str, flags: int) -> int:
    return os.open(path, flags | os.O_NOFOLLOW)


def _scratch_root() -> str | None:
    """RAM where there is some (the checkpoint is loaded right away), else the temp directory."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


def share(path: str | None, *, rank: int, world: int, node: int, local_rank: int) -> tuple[str | None, Callable[[], None]]:
    """Collective over every rank: returns a local directory holding the checkpoint (``path`` on a
    rank that holds it) and what to call once every rank loaded it; (None, ...) when no rank holds
    it. ``ShareError`` on every rank when the sending failed."""
    group = _cpu_group()
    ranks = _gather_ranks(path is not None, node, local_rank, world, group)
    holders = [r for r, info in enumerate(ranks) if info.holds]
    if not holders or len(holders) == world:
        return (path if holders else None), lambda: None
    src = holders[0]
    writers: dict[int, int] = {}
    for r, info in enumerate(ranks):
        if not info.holds and (info.node not in writers or info.local_rank < ranks[writers[info.node]].local_rank):
            writers[info.node] = r
    members = sorted({src, *writers.values()})
    wire = dist.new_group(members, backend="gloo")
    dest: str | None = None
    error = ""
    if rank in members:
        try:
            if rank == src:
                _send(path or "", src, wire)
            else:
                dest = tempfile.mkdtemp(prefix="trainguard-restore-", dir=_scratch_root())
                _receive(dest, src, wire)
        except (OSError, ShareError, RuntimeError) as exc:
            error = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    # Each member says how it went: a receiving node's writer with where its copy is, so that
    # the node's other ranks load from there; an empty note is a failure.
    note = b"" if error else (dest.encode() if dest else b"sent")
    if len(note) > PATH_BYTES:
        note, error = b"", f"{dest} is too long a path"
    mine = torch.zeros(PATH_BYTES, dtype=torch.uint8)
    if note:
        mine[: len(note)] = torch.frombuffer(bytearray(note), dtype=torch.uint8)
    notes = [torch.zeros(PATH_BYTES, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(notes, mine, group=group)
    said = [bytes(n.numpy().tobytes()).rstrip(b"\0").decode(errors="replace") for n in notes]
    bad = [r for r in members if not said[r]]
    if bad:
        if dest:
            shutil.rmtree(dest, ignore_errors=True)
        raise ShareError(error or f"rank {bad[0]} could not {'send' if bad[0] == src else 'receive'} the checkpoint")
    writer = writers.get(ranks[rank].node)
    local = path if path is not None else said[writers[ranks[rank].node]]

    def done() -> None:
        dist.barrier(group=group)
        if rank == writer and dest:
            shutil.rmtree(dest, ignore_errors=True)

    return local, done
