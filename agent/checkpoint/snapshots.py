"""Per-step in-memory snapshots: the files, as the agent and the ranks both see them (torch-free).

A rank snapshots its state after a step into one of two slot files of its own
(``<memory_root>/.snapshots/<job>/rank<R>.<a|b>``), always overwriting the slot that does not hold
its newest complete snapshot, so a rank killed in the middle of a copy still has the previous
one. Each slot is a 4 KiB header followed by the tensor bytes and a small skeleton (the state's
structure with placeholders for the tensors). The header says ``writing`` before the copy and
``done`` with the skeleton's CRC after it: a slot that is not ``done`` is never restored.

The files are tmpfs pages the rank allocated and touched once (pre-faulted), so a snapshot costs
about a memcpy of the rank's state; no collective, no fsync, no manifest. They are not copied to
other tiers (the DCP checkpoints at ``checkpoint.memory_every`` are): they cover a rank crash on a
node that stays up. Such a crash loses the step that was running and the steps done since the newest
snapshot every rank completed: at a snapshot every N steps up to N - 1 of them, or N when the kill
lands while the killed rank is still copying its newest snapshot (the copy overlaps the next
step's forward and backward and ends before that step's optimizer step; until it ends, the rank's
previous snapshot is its newest complete one).

The agent picks, before restarting a job with the same world size, the newest step every rank
has a ``done`` slot of (``SnapshotSet.common_step``), and clears every other slot
(``keep_only``) so the new attempt's ranks write on from that step alone.
"""

from __future__ import annotations

import os
import shutil
import struct
import time
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

SNAPSHOT_DIRNAME = ".snapshots"
MAGIC = b"TGSNAP01"
HEADER_BYTES = 4096
_HEADER = struct.Struct("<8sIIqqqqQQI")
SLOTS = ("a", "b")

EMPTY, WRITING, DONE = 0, 1, 2


@dataclass(frozen=True)
class SlotHeader:
    state: int
    step: int
    attempt: int
    world_size: int
    rank: int
    payload_bytes: int
    skeleton_bytes: int
    skeleton_crc: int

    def pack(self) -> bytes:
        return _HEADER.pack(MAGIC, 1, self.state, self.step, self.attempt, self.world_size, self.rank,
                            self.payload_bytes, self.skeleton_bytes, self.skeleton_crc)

    @classmethod
    def unpack(cls, raw: bytes) -> SlotHeader | None:
        if len(raw) < _HEADER.size:
            return None
        magic, version, state, step, attempt, world, rank, payload, skel, crc = _HEADER.unpack_from(raw)
        if magic != MAGIC or version != 1:
            return None
        return cls(state, step, attempt, world, rank, payload, skel, crc)

    @property
    def skeleton_offset(self) -> int:
        return HEADER_BYTES + self.payload_bytes


def snapshot_dir(memory_root: str | os.PathLike[str], job: str) -> Path:
    return Path(memory_root) / SNAPSHOT_DIRNAME / job


def slot_path(directory: str | os.PathLike[str], rank: int, slot: str) -> Path:
    return Path(directory) / f"rank{rank}.{slot}"


def read_header(path: str | os.PathLike[str]) -> SlotHeader | None:
    try:
        with open(path, "rb") as fh:
            return SlotHeader.unpack(fh.read(_HEADER.size))
    except OSError:
        return None


def read_done(path: str | os.PathLike[str]) -> tuple[SlotHeader, bytes] | None:
    """The slot's header and skeleton when the slot is complete (``done``, CRC right), else None."""
    try:
        with open(path, "rb") as fh:
            header = SlotHeader.unpack(fh.read(_HEADER.size))
            if header is None or header.state != DONE:
                return None
            fh.seek(header.skeleton_offset)
            skeleton = fh.read(header.skeleton_bytes)
    except OSError:
        return None
    if len(skeleton) != header.skeleton_bytes or zlib.crc32(skeleton) != header.skeleton_crc:
        return None
    return header, skeleton


def mark_empty(path: str | os.PathLike[str]) -> None:
    """Make a slot unusable in place (its pages stay: the next snapshot reuses them)."""
    try:
        fd = os.open(path, os.O_WRONLY)
    except OSError:
        return
    try:
        os.pwrite(fd, SlotHeader(EMPTY, -1, 0, 0, 0, 0, 0, 0).pack(), 0)
    finally:
        os.close(fd)


class SnapshotSet:
    """A job's snapshot files, from the agent's side."""

    def __init__(self, memory_root: str | os.PathLike[str], job: str) -> None:
        self.dir = snapshot_dir(memory_root, job)

    def done_steps(self, rank: int, world_size: int) -> set[int]:
        steps = set()
        for slot in SLOTS:
            found = read_done(slot_path(self.dir, rank, slot))
            if found is not None and found[0].world_size == world_size and found[0].rank == rank:
                steps.add(found[0].step)
        return steps

    def common_step(self, world_size: int, max_step: int | None = None) -> int | None:
        """The newest step every rank of a ``world_size`` job has a complete snapshot of."""
        if world_size < 1 or not self.dir.is_dir():
            return None
        common: set[int] | None = None
        for rank in range(world_size):
            steps = self.done_steps(rank, world_size)
            common = steps if common is None else common & steps
            if not common:
                return None
        eligible = [s for s in common or () if max_step is None or s <= max_step]
        return max(eligible) if eligible else None

    def settle(self, dead: Iterable[int], alive: Iterable[int], world_size: int, within_s: float, *,
               clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> float:
        """Before the agent kills the survivors of a rank's death: wait (at most ``within_s``) until
        every live rank has completed its snapshot of the newest step all the dead ranks completed.

        A rank that died right after its snapshot of step N (a crash at the top of step N+1) leaves
        peers that finished step N too, since its collectives of step N had completed, but that may
        still be copying their own snapshot of N: killed at once, they would leave N+1's restore to
        step N-1 and lose a step that every rank had computed. Peers that already hold that step
        (the usual case) cost no wait. Returns the seconds waited."""
        dead_newest = [max(self.done_steps(r, world_size), default=None) for r in dead]
        if not dead_newest or any(s is None for s in dead_newest):
            return 0.0
        target = min(s for s in dead_newest if s is not None)
        waiting = [r for r in alive if target not in self.done_steps(r, world_size)]
        start = clock()
        while waiting and clock() - start < within_s:
            sleep(0.002)
            waiting = [r for r in waiting if target not in self.done_steps(r, world_size)]
        return clock() - start

    def keep_only(self, step: int) -> None:
        """Every slot but those holding ``step`` becomes empty."""
        for path in self._slot_files():
            header = read_header(path)
            if header is None or header.state != DONE or header.step != step:
                mark_empty(path)

    def clear(self) -> None:
        """No slot may be restored (the job goes on from something older, or is gone)."""
        for path in self._slot_files():
            mark_empty(path)

    def remove(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)

    def _slot_files(self) -> list[Path]:
        try:
            return sorted(p for p in self.dir.iterdir() if p.name.startswith("rank") and p.suffix[1:] in SLOTS)
        except FileNotFoundError:
            return []
