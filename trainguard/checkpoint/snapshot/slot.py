"""One mapped slot file of a rank's snapshots: the layout of the tensors in it, the copy into it,
the skeleton written behind them, the header that marks it complete and the payload's checksum."""

from __future__ import annotations

import mmap
import os
import pickle
import zlib
from typing import Any

import torch

from trainguard.agent.checkpoint.snapshots import (
    DONE,
    HEADER_BYTES,
    SlotHeader,
    read_header,
    write_payload_crc,
)
from trainguard.checkpoint.snapshot.skeleton import PARTS, TensorSpec

_ALIGN = 64
_SKELETON_RESERVE = 64 << 10


def unmap(mm: mmap.mmap) -> None:
    """Close a mapping tensors were made over; while a view of it is still alive the mapping goes
    when that view does."""
    try:
        mm.close()
    except BufferError:
        pass


class Slot:
    """One mapped slot file; the destination views stay while the tensors keep their layout."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o640)
        self.mm: mmap.mmap | None = None
        self.buf: torch.Tensor | None = None
        self.signature: Any = None
        """(tensor signature, holders) the layout was made for."""
        self.dsts: list[torch.Tensor] = []
        self.runs: list[tuple[int, int, torch.Tensor, bool]] = []
        """(first, end, flat destination, deferred) of each run of packed stable tensors."""
        self.stable = 0
        self.specs: list[TensorSpec] = []
        self.specs_bytes = b""
        self.payload_bytes = 0
        self.stored: list[int] = []
        """Indices of the tensors this slot keeps the bytes of (``dsts`` is theirs), in order."""
        self.stored_stable = 0
        self.all_late = False
        """Every tensor this slot keeps is in a deferred run: ``take`` copies nothing into it."""
        self.skeleton_bytes = 0
        self._prefix: tuple[int, bytes, bytes, bytes, int] | None = None
        """(offset, part lengths, specs, static tree, their crc32) of the skeleton's head as last
        written here."""
        header = read_header(path)
        self.step = header.step if header is not None and header.state == DONE else -1

    def _map(self, size: int) -> None:
        """Grow the file to ``size`` with its pages allocated and touched now (a full tmpfs fails
        here with ENOSPC, not later as a SIGBUS in the middle of a copy)."""
        self.close_map()
        self._prefix = None
        os.posix_fallocate(self.fd, 0, size)
        if os.fstat(self.fd).st_size > size:
            os.ftruncate(self.fd, size)
        self.mm = mmap.mmap(self.fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.buf = torch.frombuffer(self.mm, dtype=torch.uint8)
        self.buf[HEADER_BYTES:].zero_()  # fault the mapping's pages in once

    def layout(self, tensors: list[torch.Tensor], skeleton_hint: int, signature: Any, stable: int = 0,
               holders: tuple[int, ...] = (), deferred: tuple[bool, ...] = ()) -> None:
        """Place ``tensors``; the first ``stable`` (the plan's, the same objects every snapshot)
        are packed back to back while their dtype stays the same, so that each such run is one
        flat destination (``runs``). ``holders``: for each of the first ones, the rank whose slot
        keeps its bytes instead of this one (-1: this one). ``deferred``: for each of the first
        ones, whether it is copied later (a run holds tensors of one kind only)."""
        if (signature, holders, deferred) == self.signature and self.mm is not None and self._room(skeleton_hint):
            return
        specs: list[TensorSpec] = []
        runs: list[list[int]] = []  # [first, end, byte offset]
        stored: list[int] = []
        offset = 0
        for i, t in enumerate(tensors):
            dtype = str(t.dtype).removeprefix("torch.")
            holder = holders[i] if i < len(holders) else -1
            if holder >= 0:
                specs.append(TensorSpec(-1, dtype, tuple(t.shape), holder))
                continue
            packed = (0 < i < stable and bool(stored) and stored[-1] == i - 1 and t.dtype == tensors[i - 1].dtype
                      and _flag(deferred, i) == _flag(deferred, i - 1))
            if packed:
                runs[-1][1] = i + 1
            else:
                offset = -(-offset // _ALIGN) * _ALIGN
                if i < stable:
                    runs.append([i, i + 1, offset])
            stored.append(i)
            specs.append(TensorSpec(offset, dtype, tuple(t.shape)))
            offset += t.numel() * t.element_size()
        offset = -(-offset // _ALIGN) * _ALIGN
        need = HEADER_BYTES + offset + max(_SKELETON_RESERVE, 2 * skeleton_hint)
        if self.mm is None or len(self.mm) < need:
            self._map(need)
        assert self.buf is not None
        self.dsts = [self.buf.narrow(0, HEADER_BYTES + specs[i].offset, tensors[i].numel() * tensors[i].element_size())
                     .view(tensors[i].dtype).view(tensors[i].shape) for i in stored]
        self.runs = [(start, end, self.buf.narrow(0, HEADER_BYTES + at, sum(t.numel() * t.element_size()
                                                                            for t in tensors[start:end]))
                      .view(tensors[start].dtype), _flag(deferred, start)) for start, end, at in runs]
        self.stable, self.stored = stable, stored
        self.stored_stable = sum(1 for i in stored if i < stable)
        self.all_late = self.stored_stable == len(stored) and all(late for _, _, _, late in self.runs)
        self.specs, self.signature, self.payload_bytes = specs, (signature, holders, deferred), offset
        self.specs_bytes = pickle.dumps(specs, protocol=5)

    def finish(self, static: bytes, dynamic: bytes | bytearray, header: SlotHeader) -> None:
        """Write the skeleton behind the tensors and mark the slot complete (the tensors are in).
        The parts before the per-step values (lengths, specs, static tree) are written again only
        when they changed since this slot's last snapshot, and their checksum is kept with them:
        one snapshot after another writes and sums the few hundred bytes that change."""
        assert self.mm is not None
        start = HEADER_BYTES + self.payload_bytes
        lengths = PARTS.pack(len(self.specs_bytes), len(static), len(dynamic))
        prefix = self._prefix
        if prefix is None or prefix[0] != start or prefix[1] != lengths or prefix[2] is not self.specs_bytes \
                or prefix[3] is not static:
            head = lengths + self.specs_bytes + static
            self.mm[start:start + len(head)] = head
            prefix = self._prefix = (start, lengths, self.specs_bytes, static, _crc32(head))
        at = start + PARTS.size + len(self.specs_bytes) + len(static)
        self.mm[at:at + len(dynamic)] = dynamic
        size = at + len(dynamic) - start
        self.write_header(SlotHeader(DONE, header.step, header.attempt, header.world_size, header.rank,
                                     self.payload_bytes, size, _crc32(dynamic, prefix[4])))
        self.step = header.step
        self.skeleton_bytes = size

    def _room(self, skeleton_bytes: int) -> bool:
        return self.mm is not None and HEADER_BYTES + self.payload_bytes + skeleton_bytes <= len(self.mm)

    def write_header(self, header: SlotHeader) -> None:
        assert self.mm is not None
        raw = header.pack()
        self.mm[0:len(raw)] = raw

    def copy_in(self, tensors: list[torch.Tensor], flats: list[torch.Tensor] | None,
                deferred: bool | None = None) -> None:
        """Copy ``tensors`` into their places; ``flats``: flat views of the stable ones (None when
        they cannot go by runs: not all on the CPU, or not contiguous). ``deferred``: only the
        runs laid out as deferred (True) or all but those (False); None: everything."""
        if flats is None or len(flats) != self.stable:
            with torch.no_grad():
                torch._foreach_copy_(self.dsts, [tensors[i] for i in self.stored])
            return
        for start, end, dst, late in self.runs:
            if deferred is None or late == deferred:
                torch.cat(flats[start:end], out=dst)  # detached views: nothing for autograd to record
        if deferred is not True and len(tensors) > self.stable:
            with torch.no_grad():
                torch._foreach_copy_(self.dsts[self.stored_stable:], tensors[self.stable:])

    def close_map(self) -> None:
        self.dsts, self.runs, self.buf, self.signature, self.stored = [], [], None, None, []
        self.all_late = False
        if self.mm is not None:
            unmap(self.mm)
            self.mm = None

    def close(self) -> None:
        self.close_map()
        os.close(self.fd)


_CRC_PIECE = 4096


def _crc32(data: bytes | bytearray, value: int = 0) -> int:
    """``zlib.crc32`` in pieces short enough that zlib keeps the GIL (it lets go above 5 KiB): the
    helper thread sums a skeleton (~5.5 KB with the RNG state) while the training thread runs, and
    each time it lets go of the GIL it waits for it again, a wake-up the training thread pays for
    at its next release (~20-50 us each on this machine kind's VMs)."""
    view = memoryview(data)
    for at in range(0, len(view), _CRC_PIECE):
        value = zlib.crc32(view[at:at + _CRC_PIECE], value)
    return value


def sum_payload(slot: Slot, step: int) -> None:
    """Record the crc32 of a ``done`` slot's tensor bytes in its header, from the slot itself, on
    the summing thread: a restore checks them before it uses them. One ``zlib.crc32`` call (it lets
    go of the GIL for the whole sum)."""
    mm = slot.mm
    if mm is None or slot.step != step:
        return
    with memoryview(mm) as view:
        crc = zlib.crc32(view[HEADER_BYTES:HEADER_BYTES + slot.payload_bytes])
        if slot.step == step and slot.mm is mm:
            write_payload_crc(view, crc)


def _flag(flags: tuple[bool, ...], i: int) -> bool:
    return i < len(flags) and flags[i]
