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
import stat
import struct
import threading
import time
import zlib
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from trainguard.agent.safefs import dir_fd, open_beneath, open_dir_at, rmtree_beneath

SNAPSHOT_DIRNAME = ".snapshots"
MAGIC = b"TGSNAP01"
HEADER_BYTES = 4096
_HEADER = struct.Struct("<8sIIqqqqQQIII")
_PAYLOAD_CRC_AT = struct.calcsize("<8sIIqqqqQQI")
"""Offset of (payload crc32, summed flag): written after the slot is ``done``, the crc first."""
SLOTS = ("a", "b")
MAX_SKELETON_BYTES = 256 << 20
"""A skeleton is the state's structure and small values (kilobytes): anything past this is forged."""

VERIFY_MAX_BYTES = 1 << 30
"""The most tensor bytes (all ranks' slots of a step) the agent sums itself before a restart."""

EMPTY, WRITING, DONE = 0, 1, 2

REJECTED: Counter[str] = Counter()
"""Slots refused while reading them, by reason (``header_bounds``, ``payload_crc``, ``not_a_file``),
process-wide: a forged or damaged slot is a counted skip, never an exception."""
_REJECTED_LOCK = threading.Lock()


def _reject(reason: str) -> None:
    with _REJECTED_LOCK:
        REJECTED[reason] += 1


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
    payload_crc: int = 0
    payload_summed: int = 0
    """1 once ``payload_crc`` holds the crc32 of the tensor bytes (written after ``done``)."""

    def pack(self) -> bytes:
        return _HEADER.pack(MAGIC, 1, self.state, self.step, self.attempt, self.world_size, self.rank,
                            self.payload_bytes, self.skeleton_bytes, self.skeleton_crc, self.payload_crc,
                            self.payload_summed)

    @classmethod
    def unpack(cls, raw: bytes) -> SlotHeader | None:
        if len(raw) < _HEADER.size:
            return None
        magic, version, state, step, attempt, world, rank, payload, skel, crc, pcrc, summed = _HEADER.unpack_from(raw)
        if magic != MAGIC or version != 1:
            return None
        return cls(state, step, attempt, world, rank, payload, skel, crc, pcrc, summed)

    def bounds_problem(self, file_size: int) -> str | None:
        """Why the header's sizes cannot be this file's (a forged or torn header), or None."""
        if self.payload_bytes < 0 or self.skeleton_bytes < 0:
            return "negative sizes"
        if self.skeleton_bytes > MAX_SKELETON_BYTES:
            return f"skeleton of {self.skeleton_bytes} bytes"
        if self.skeleton_offset + self.skeleton_bytes > file_size:
            return (f"payload {self.payload_bytes} + skeleton {self.skeleton_bytes} bytes past the "
                    f"file's {file_size}")
        return None

    @property
    def skeleton_offset(self) -> int:
        return HEADER_BYTES + self.payload_bytes


def snapshot_dir(memory_root: str | os.PathLike[str], job: str) -> Path:
    return Path(memory_root) / SNAPSHOT_DIRNAME / job


def slot_path(directory: str | os.PathLike[str], rank: int, slot: str) -> Path:
    return Path(directory) / f"rank{rank}.{slot}"


def open_slot(path: str | os.PathLike[str], flags: int = os.O_RDONLY,
              root: str | os.PathLike[str] | None = None) -> int:
    """An fd of a slot file: never through a symlink (below ``root``, at any depth), never a FIFO or
    device a rank put there in its place (OSError)."""
    flags |= os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    fd = open_beneath(root, path, flags) if root is not None else os.open(path, flags)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        _reject("not_a_file")
        raise OSError(f"{path} is not a regular file")
    return fd


def read_header(path: str | os.PathLike[str], root: str | os.PathLike[str] | None = None) -> SlotHeader | None:
    try:
        fd = open_slot(path, root=root)
    except OSError:
        return None
    try:
        return SlotHeader.unpack(os.pread(fd, _HEADER.size, 0))
    except OSError:
        return None
    finally:
        os.close(fd)


def read_done(path: str | os.PathLike[str], root: str | os.PathLike[str] | None = None,
              problems: list[str] | None = None) -> tuple[SlotHeader, bytes] | None:
    """The slot's header and skeleton when the slot is complete (``done``, CRC right), else None.
    A header whose sizes the file cannot hold is a counted skip (``REJECTED``), told in ``problems``."""
    try:
        fd = open_slot(path, root=root)
    except OSError:
        return None
    try:
        header = SlotHeader.unpack(os.pread(fd, _HEADER.size, 0))
        if header is None or header.state != DONE:
            return None
        problem = header.bounds_problem(os.fstat(fd).st_size)
        if problem is not None:
            _reject("header_bounds")
            if problems is not None:
                problems.append(f"{path}: header out of bounds: {problem}")
            return None
        skeleton = os.pread(fd, header.skeleton_bytes, header.skeleton_offset)
    except OSError:
        return None
    finally:
        os.close(fd)
    if len(skeleton) != header.skeleton_bytes or zlib.crc32(skeleton) != header.skeleton_crc:
        return None
    return header, skeleton


_CHECK_PIECE = 8 << 20


def payload_problem(path: str | os.PathLike[str], header: SlotHeader,
                    root: str | os.PathLike[str] | None = None) -> str | None:
    """Why the slot's tensor bytes do not match the crc32 its writer recorded (read in pieces), or
    None when they do or none was recorded yet (the writer died within the moment after ``done``:
    the header's own checks still hold)."""
    if not header.payload_summed:
        return None
    try:
        fd = open_slot(path, root=root)
    except OSError as exc:
        return f"unreadable: {exc}"
    try:
        crc = 0
        at, end = HEADER_BYTES, HEADER_BYTES + header.payload_bytes
        while at < end:
            piece = os.pread(fd, min(_CHECK_PIECE, end - at), at)
            if not piece:
                return "short"
            crc = zlib.crc32(piece, crc)
            at += len(piece)
    finally:
        os.close(fd)
    if crc != header.payload_crc:
        _reject("payload_crc")
        return f"tensor bytes damaged (crc32 {crc:08x}, recorded {header.payload_crc:08x})"
    return None


def write_payload_crc(mm: object, crc: int) -> None:
    """Record a ``done`` slot's payload crc32 in its mapped header: the value, then the flag that
    makes readers check it (stores in this order on every architecture torch runs on for CPUs)."""
    view = memoryview(mm)  # type: ignore[arg-type]
    view[_PAYLOAD_CRC_AT:_PAYLOAD_CRC_AT + 4] = struct.pack("<I", crc)
    view[_PAYLOAD_CRC_AT + 4:_PAYLOAD_CRC_AT + 8] = struct.pack("<I", 1)


def mark_empty(path: str | os.PathLike[str], root: str | os.PathLike[str] | None = None) -> None:
    """Make a slot unusable in place (its pages stay: the next snapshot reuses them); a symlink or
    special file in its place is left alone, never written through."""
    try:
        fd = open_slot(path, os.O_WRONLY, root=root)
    except OSError:
        return
    try:
        os.pwrite(fd, SlotHeader(EMPTY, -1, 0, 0, 0, 0, 0, 0).pack(), 0)
    finally:
        os.close(fd)


class SnapshotSet:
    """A job's snapshot files, from the agent's side."""

    def __init__(self, memory_root: str | os.PathLike[str], job: str) -> None:
        self.root = Path(memory_root)
        """The agent's memory root: trusted; nothing below it is reached through a symlink."""
        self.dir = snapshot_dir(memory_root, job)
        self.problems: list[str] = []
        """Slots skipped as forged or damaged since this set was made (for the agent's events)."""
        self.verify_max_bytes = VERIFY_MAX_BYTES

    def done_steps(self, rank: int, world_size: int) -> set[int]:
        steps = set()
        for slot in SLOTS:
            found = read_done(slot_path(self.dir, rank, slot), self.root, self.problems)
            if found is not None and found[0].world_size == world_size and found[0].rank == rank:
                steps.add(found[0].step)
        return steps

    def common_step(self, world_size: int, max_step: int | None = None, *, exclude: Iterable[int] = (),
                    verify: bool = False) -> int | None:
        """The newest step every rank of a ``world_size`` job has a complete snapshot of (at most
        ``max_step``, none of ``exclude``). ``verify``: also check the tensor bytes of that step's
        slots against their crc32; a damaged one is told in ``problems``, emptied, and the next
        older common step is tried."""
        try:
            if world_size < 1 or not stat.S_ISDIR(os.lstat(self.dir).st_mode):
                return None
        except OSError:
            return None
        skip = set(exclude)
        while True:
            common: set[int] | None = None
            for rank in range(world_size):
                steps = self.done_steps(rank, world_size)
                common = steps if common is None else common & steps
                if not common:
                    return None
            eligible = [s for s in common or () if (max_step is None or s <= max_step) and s not in skip]
            if not eligible:
                return None
            best = max(eligible)
            if not verify or self.verify_step(best, world_size):
                return best
            skip.add(best)

    def verify_step(self, step: int, world_size: int) -> bool:
        """Whether every rank's ``done`` slot of ``step`` holds the tensor bytes its writer summed;
        a damaged slot is emptied (never restored) and told in ``problems``. Above
        ``VERIFY_MAX_BYTES`` in all, the agent leaves the check to the ranks' loaders (each checks
        its own slots as it reads them, in parallel, and all fall back to the checkpoint together):
        a restart would otherwise wait for one core to sum every rank's state."""
        slots: list[tuple[int, str, Path, SlotHeader]] = []
        for rank in range(world_size):
            for slot in SLOTS:
                path = slot_path(self.dir, rank, slot)
                found = read_done(path, self.root)
                if found is not None and found[0].step == step:
                    slots.append((rank, slot, path, found[0]))
        if sum(h.payload_bytes for *_, h in slots) > self.verify_max_bytes:
            return True
        ok = True
        for rank, slot, path, header in slots:
            problem = payload_problem(path, header, self.root)
            if problem is not None:
                self.problems.append(f"rank {rank} slot {slot} of step {step}: {problem}")
                mark_empty(path, self.root)
                ok = False
        return ok

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
            header = read_header(path, self.root)
            if header is None or header.state != DONE or header.step != step:
                mark_empty(path, self.root)

    def clear(self) -> None:
        """No slot may be restored (the job goes on from something older, or is gone)."""
        for path in self._slot_files():
            mark_empty(path, self.root)

    def remove(self) -> None:
        """Remove the job's snapshot directory; a symlink anywhere on the way (``.snapshots``
        itself, the job's directory) is removed as a link or refused, never followed."""
        rmtree_beneath(self.root, self.dir)

    def prepare(self, owner: tuple[int, int] | None = None) -> None:
        """Make the job's snapshot directory (its ranks' user's, ``owner``) before they start."""
        with dir_fd(self.root, self.dir.parent, create=True, mode=0o755) as parent:
            os.close(open_dir_at(parent, [self.dir.name], create=True, mode=0o755, owner=owner))

    def _slot_files(self) -> list[Path]:
        """The job's slot files: regular files only, listed through the directory's fd."""
        try:
            with dir_fd(self.root, self.dir) as fd:
                names = [n for n in os.listdir(fd) if n.startswith("rank") and n.rsplit(".", 1)[-1] in SLOTS
                         and stat.S_ISREG(os.lstat(n, dir_fd=fd).st_mode)]
        except OSError:
            return []
        return sorted(self.dir / n for n in names)
