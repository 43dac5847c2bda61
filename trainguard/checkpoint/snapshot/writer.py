"""Per-step snapshots of a rank's state into pre-faulted shared memory (``trainguard.checkpoint.snapshot.load``
restores them).

The file format and the agent's side are in ``trainguard.agent.checkpoint.snapshots``. Here a
snapshot is: the state's ``state_dict()``s walked into a list of tensors and a skeleton (the
structure with a placeholder per tensor), the tensors copied into views of a mapped slot file whose
layout is kept while the tensors' shapes stay the same, and the skeleton pickled behind them. CPU
tensors of one dtype lie back to back in the slot and go in with one ``torch.cat(out=)`` per dtype
(``torch._foreach_copy_`` on the CPU copies tensor by tensor: 0.2-0.9 ms for the bench model's 100
tensors, 1.6 MB, against 0.06 ms for one cat); device tensors go with ``_foreach_copy_``. The training thread is blocked for that copy and the walk, nothing
else: no collective, no planning, no file creation after the first snapshot.

With ``overlap`` (what ``Run`` uses where the node has a core for each rank's helper thread:
``overlap_pays``), the tensors that only an optimizer's ``step`` changes (the
parameters of a built-in ``torch.optim`` optimizer in the state, and its state) are copied by a
helper thread while the next step's forward and backward run (CheckFreq's pipelined snapshot): torch
releases the GIL for the copy, and the optimizer's step pre-hook waits for it, so the copy still sees
the state of the step it is labelled with. Everything else (buffers, which a forward may update in
place, other tensors, the skeleton's values) is copied before ``take`` returns (the RNG states are
read then, and their bytes put into the skeleton by the helper), and the slot is marked complete only
once the helper is done. Also waited for: the next snapshot, a
``load_state_dict`` of a module or optimizer in the state, a ``fork`` of the rank, ``wait``,
``close``. Not seen: a script writing parameters in place outside its optimizer between a
checkpoint and the next optimizer step (``wait()`` first). The stall it costs is the time ``take``
blocks plus the time a step waits for the copy (``SnapshotStats.last_stall_s``).

``state`` is what ``Run.checkpoint`` takes. A mapping with a ``snapshot_state()`` method gives the
snapshot that instead: the same state as raw modules and optimizers (the embedded trainer's
checkpoint state is built for DCP resharding, whose ``state_dict`` costs milliseconds).

Data-parallel replicas on one node share out the tensors they hold alike (``share``): each rank's
slot keeps its part of them and says which rank's slot keeps each of the others
(``trainguard.checkpoint.snapshot.replicas``), so the ranks together copy and keep one copy, not one each.
"""

from __future__ import annotations

import ctypes
import io
import mmap
import operator
import os
import pickle
import queue
import struct
import threading
import time
import weakref
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from trainguard.agent.checkpoint.snapshots import (
    DONE,
    HEADER_BYTES,
    SLOTS,
    WRITING,
    SlotHeader,
    read_done,
    read_header,
    slot_path,
    write_payload_crc,
)
from trainguard.agent.lifecycle.cgroups import cpu_limit
from trainguard.checkpoint.snapshot.replicas import holders, replicated_ids

_ALIGN = 64
_SKELETON_RESERVE = 64 << 10
_PARTS = struct.Struct("<III")  # lengths of the skeleton's parts: tensor specs, static tree, per-step values
_SAFE_BUILTINS = frozenset({"dict", "list", "tuple", "set", "frozenset", "int", "float", "complex", "bool",
                            "str", "bytes", "bytearray", "slice", "range", "NoneType"})


def usable_cpus() -> float:
    """The CPUs this process may run on: its affinity mask, or its cgroup's CPU quota where that is
    lower (``cpu_limit``)."""
    cpus = float(len(os.sched_getaffinity(0)))
    limit = cpu_limit()
    return min(cpus, limit) if limit is not None else cpus


def overlap_pays(local_ranks: int, *, cpus: float | None = None, threads: int | None = None) -> bool:
    """Whether a rank's snapshots should copy in a helper thread while the next step runs: only
    where the cores it may use (``usable_cpus``) leave one for each rank's helper besides its
    ``threads`` compute threads. Where the ranks fill the cores the helper takes its CPU from
    training all the same, and the hand-off, the thread switches and the GIL between them cost
    more than the copy saves: on the recovery bench's 4 ranks on 2 cores a snapshot cost 0.35 ms
    overlapped against 0.26 ms copied in ``take``, and the job ran no faster for the overlap
    (BENCHMARKS.md)."""
    cpus = usable_cpus() if cpus is None else cpus
    threads = torch.get_num_threads() if threads is None else threads
    return cpus >= max(1, local_ranks) * (threads + 1)


def cost_scale(local_ranks: int, *, cpus: float | None = None) -> float:
    """How many times a rank's snapshot work costs the job its own length, where the node's ranks
    outnumber its cores: there every CPU second is taken from ranks that all wait for the slowest
    at the next collective, and the job's step grows by the ranks' snapshot work shared over the
    cores (``local_ranks / cpus`` times one rank's). 1 where each rank has a core: the snapshot
    holds up its own rank only. On the recovery bench's 4 ranks on 2 cores a snapshot measured
    0.23-0.25 ms in ``take`` (0.9-1 % of a 25-28 ms step) and the time between its steps grew by
    0.43 ms a step with snapshots on (bench/BENCHMARKS.md)."""
    cpus = usable_cpus() if cpus is None else cpus
    return max(1.0, local_ranks / max(1.0, cpus))


class SnapshotError(Exception):
    """A snapshot that cannot be taken or restored (the caller falls back to DCP checkpoints)."""


@dataclass(frozen=True)
class TensorRef:
    index: int
    dtensor: bool = False
    """The tensor was this rank's shard of a DTensor (restored through the live object's mesh)."""


@dataclass(frozen=True)
class TensorSpec:
    offset: int
    dtype: str
    shape: tuple[int, ...]
    holder: int = -1
    """-1: the bytes are in this slot at ``offset``; else the rank whose slot of the same step holds
    them (a data-parallel replica's share, ``trainguard.checkpoint.snapshot.replicas``; ``offset`` is -1 then)."""


class _SkeletonUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == "builtins" and name in _SAFE_BUILTINS:
            return super().find_class(module, name)
        if module == __name__ and name in ("TensorRef", "TensorSpec"):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"a snapshot skeleton may not hold {module}.{name}")


def loads_skeleton(raw: bytes) -> Any:
    return _SkeletonUnpickler(io.BytesIO(raw)).load()


def skeleton_parts(raw: bytes) -> list[bytes]:
    """The pickled parts of a slot's skeleton: tensor specs, static tree, per-step values."""
    if len(raw) < _PARTS.size:
        raise pickle.UnpicklingError("skeleton too short")
    lengths = _PARTS.unpack_from(raw)
    if _PARTS.size + sum(lengths) != len(raw):
        raise pickle.UnpicklingError("skeleton parts do not add up")
    out, at = [], _PARTS.size
    for n in lengths:
        out.append(raw[at:at + n])
        at += n
    return out


def _read_skeleton(raw: bytes) -> tuple[list[TensorSpec], dict[str, Any], dict[str, Any]]:
    """(tensor specs, static tree, per-step values) of a slot's skeleton."""
    specs, static, per_step = map(loads_skeleton, skeleton_parts(raw))
    return specs, static, per_step


def snapshot_view(state: Mapping[str, Any]) -> Mapping[str, Any]:
    fast = getattr(state, "snapshot_state", None)
    return fast() if callable(fast) else state


def map_leaves(value: Any, leaf: Any) -> Any:
    """``value`` with ``leaf`` applied to everything but the dicts, lists and tuples holding it."""
    if isinstance(value, dict):
        return {k: map_leaves(v, leaf) for k, v in value.items()}
    if isinstance(value, list):
        return [map_leaves(v, leaf) for v in value]
    if isinstance(value, tuple):
        return tuple(map_leaves(v, leaf) for v in value)
    return leaf(value)


class _StrippingPickler(pickle.Pickler):
    """Pickles a tree with every tensor replaced by a TensorRef into ``tensors`` and dict, list and
    tuple subclasses (an OrderedDict ``state_dict``, a namedtuple) as the plain ones, as
    ``map_leaves`` would give them, in one pass: the pickler calls ``reducer_override`` for none
    of the plain containers and values, which a Python walk visits one by one (a quarter of a
    small state's snapshot stall)."""

    def __init__(self, file: io.BytesIO, tensors: list[torch.Tensor]) -> None:
        super().__init__(file, protocol=5)
        self.tensors = tensors

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            ref = _ref(obj, self.tensors)
            return TensorRef, (ref.index, ref.dtensor)
        for plain in (dict, list, tuple):
            if isinstance(obj, plain) and type(obj) is not plain:
                return plain, (plain(obj),)
        return NotImplemented


class _ReusedPickler:
    """One ``_StrippingPickler`` and its buffer for every snapshot of a writer (making them anew
    costs a snapshot ~5 us between two steps)."""

    def __init__(self) -> None:
        self._out = io.BytesIO()
        self._pickler = _StrippingPickler(self._out, [])

    def dumps(self, value: Any, tensors: list[torch.Tensor]) -> bytes:
        out, pickler = self._out, self._pickler
        out.seek(0)
        out.truncate()
        pickler.clear_memo()  # an object of the last snapshot may be gone and its id reused
        pickler.tensors = tensors
        try:
            pickler.dump(value)
        except BaseException:
            self._pickler = _StrippingPickler(self._out, [])  # no half-written state carried over
            raise
        finally:
            pickler.tensors = []
        return out.getvalue()


_CUDA_BUILT = torch.backends.cuda.is_built()


def rng_states() -> dict[str, Any]:
    """This process's RNG states, as snapshots and checkpoints keep them (copies: the generators go on)."""
    return {"torch": torch.default_generator.get_state(),
            "cuda": torch.cuda.get_rng_state() if _CUDA_BUILT and torch.cuda.is_initialized() else None}


def _rng_bytes() -> dict[str, bytes | None]:
    """``rng_states`` as bytes, which a snapshot pickles into its skeleton: as a tensor of the slot
    it went through the copy of the state's tensors and its layout's signature (~20 us more). Read
    straight from the state tensor's memory (through numpy: ~3 us more between two steps)."""
    return {name: _tensor_bytes(t) if t is not None else None for name, t in rng_states().items()}


_STAND_INS: dict[int, bytes] = {}


def _stand_in(length: int) -> bytes:
    """Random bytes of ``length``, the same all along: what a pickle holds in place of an RNG
    state until ``_fill_stand_ins`` finds and overwrites them."""
    found = _STAND_INS.get(length)
    if found is None:
        found = _STAND_INS[length] = os.urandom(length)
    return found


def _stand_ins(states: Mapping[str, torch.Tensor | None]) -> dict[str, bytes | None]:
    return {name: _stand_in(t.numel()) if t is not None else None for name, t in states.items()}


def _fill_stand_ins(raw: bytes, states: Mapping[str, torch.Tensor | None]) -> bytearray:
    """``raw`` (a pickle whose first values are ``_stand_ins(states)``, in their order) with each
    stand-in overwritten by its state's bytes. Random bytes (5,056 for the CPU generator, 16 for
    CUDA's), a stand-in is not found before its own place, the first after the one before it."""
    out = bytearray(raw)
    at = 0
    for state in states.values():
        if state is None:
            continue
        n = state.numel()
        at = out.find(_stand_in(n), at)
        if at < 0:
            raise SnapshotError("an RNG state's place in the snapshot's skeleton was not found")
        out[at:at + n] = _tensor_bytes(state)
        at += n
    return out


def _tensor_bytes(tensor: torch.Tensor) -> bytes:
    """A contiguous CPU uint8 tensor's bytes (an RNG state)."""
    return ctypes.string_at(tensor.data_ptr(), tensor.numel())


def _rng_tensor(value: Any) -> Any:
    return torch.frombuffer(bytearray(value), dtype=torch.uint8) if isinstance(value, (bytes, bytearray)) else value


def set_rng_states(rng: Mapping[str, Any]) -> None:
    """Put back what ``rng_states`` (or a snapshot's ``_rng_bytes``) gave (CUDA's only where CUDA
    is in use)."""
    torch.set_rng_state(_rng_tensor(rng["torch"]))
    if rng.get("cuda") is not None and torch.cuda.is_initialized():
        torch.cuda.set_rng_state(_rng_tensor(rng["cuda"]))


def _ref(tensor: torch.Tensor, tensors: list[torch.Tensor]) -> TensorRef:
    if isinstance(tensor, DTensor):
        tensors.append(tensor.to_local())
        return TensorRef(len(tensors) - 1, dtensor=True)
    tensors.append(tensor)
    return TensorRef(len(tensors) - 1)


def _owners(module: nn.Module) -> dict[int, tuple[dict[str, Any], str]]:
    """Where each parameter and buffer object of ``module`` is held (its submodule's dict, name)."""
    out: dict[int, tuple[dict[str, Any], str]] = {}
    for sub in module.modules():
        for table in (sub._parameters, sub._buffers):
            for name, t in table.items():
                if t is not None:
                    out[id(t)] = (table, name)
    return out


class _Plan:
    """What a snapshot of one state copies, worked out once and kept while it still holds.

    Modules and optimizers keep their tensor objects from step to step (an optimizer updates its
    state in place): their tensors are found once, and each later snapshot only checks that the
    same objects are still in place (a dictionary lookup each) before copying from them. What
    changes every step is read every step: optimizer hyperparameters (the LR), other
    ``state_dict()``s (a sampler's position), plain values, the RNG.
    """

    def __init__(self, view: Mapping[str, Any], share: tuple[int, int] | None = None) -> None:
        """``share``: (rank, world size) of a job whose replicated tensors the ranks share out."""
        self.objects = dict(view)
        self.tensors: list[torch.Tensor] = []
        self.static: dict[str, Any] = {}
        self.dynamic_keys: list[str] = []
        self.optimizers: dict[str, torch.optim.Optimizer] = {}
        self._checks: list[tuple[dict[Any, Any], Any, Any]] = []
        """(table, key, object): each plan tensor where it must still be held."""
        self._optimizer_states: list[tuple[torch.optim.Optimizer, Any, int]] = []
        """(optimizer, its ``state`` mapping, that mapping's size) as found."""
        for key, value in view.items():
            if isinstance(value, nn.Module) and self._module(key, value):
                continue
            if isinstance(value, torch.optim.Optimizer) and self._optimizer(key, value):
                continue
            self.dynamic_keys.append(key)
        self.static_bytes = pickle.dumps(self.static, protocol=5)
        self.signature = _signature(self.tensors)
        self.holders: tuple[int, ...] = ()
        """Per plan tensor, whose slot keeps it (-1: this rank's; ``trainguard.checkpoint.snapshot.replicas.holders``)."""
        if share is not None:
            ids = replicated_ids(view)
            sizes = [t.numel() * t.element_size() if id(t) in ids else None for t in self.tensors]
            if any(s is not None for s in sizes):
                self.holders = holders(sizes, share[1], share[0])
        self.deferred = self._deferred(view)
        self.kept = [i for i in range(len(self.tensors)) if i >= len(self.holders) or self.holders[i] < 0]
        """The plan tensors this rank's slot keeps the bytes of. Only these are checked before a
        copy: a tensor another rank's slot keeps is a replica, replaced alike on every rank, and
        its keeper sees that (a restore refuses shares whose shapes disagree)."""
        self.kept_tensors = [self.tensors[i] for i in self.kept]
        assert len(self._checks) == len(self.tensors), "each plan tensor has its check at its index"
        # The checks as columns, so that holds() runs them in C (~100 per snapshot).
        checks = [self._checks[i] for i in self.kept]
        self._tables = [table for table, _, _ in checks]
        self._keys = [key for _, key, _ in checks]
        self._held = [t for _, _, t in checks]
        self._sharded = any(isinstance(t, DTensor) for t in self._held)

    def _module(self, key: str, module: nn.Module) -> bool:
        entries = module.state_dict(keep_vars=True)
        owners = _owners(module)
        if not all(isinstance(t, torch.Tensor) and id(t) in owners for t in entries.values()):
            return False  # extra state of its own making: its state_dict every time
        self.static[key] = ("module", {name: _ref(t, self.tensors) for name, t in entries.items()})
        self._checks += [(*owners[id(t)], t) for t in entries.values()]
        return True

    def _optimizer(self, key: str, optim: torch.optim.Optimizer) -> bool:
        params = [p for group in optim.param_groups for p in group["params"]]
        state: dict[int, dict[str, TensorRef]] = {}
        # Each plan tensor has its check at the same index (``kept``): refuse before any ref.
        if not all(isinstance(v, torch.Tensor) for entry in optim.state.values() for v in entry.values()):
            return False
        for index, param in enumerate(params):
            entry = optim.state.get(param)
            if entry is None:
                continue
            state[index] = {name: _ref(v, self.tensors) for name, v in entry.items()}
            self._checks += [(entry, name, v) for name, v in entry.items()]
        groups, start = [], 0
        for group in optim.param_groups:
            groups.append(list(range(start, start + len(group["params"]))))
            start += len(group["params"])
        self.static[key] = ("optimizer", state, groups)
        self.optimizers[key] = optim
        self._optimizer_states.append((optim, optim.state, len(optim.state)))
        return True

    def _deferred(self, view: Mapping[str, Any]) -> tuple[bool, ...]:
        """Per plan tensor: whether only an optimizer's ``step`` changes it (a parameter of a
        built-in ``torch.optim`` optimizer of the state, or that optimizer's state), so that its
        copy may wait until that step. () when none is."""
        ours = [o for o in self.optimizers.values() if type(o).__module__.startswith("torch.optim.")]
        if not ours:
            return ()
        owned: set[int] = set()
        for optim in ours:
            for group in optim.param_groups:
                for param in group["params"]:
                    owned.add(id(param))
                    owned.update(id(v) for v in optim.state.get(param, {}).values())
        for other in view.values():  # a parameter another optimizer steps too is copied at once
            if isinstance(other, torch.optim.Optimizer) and not any(other is o for o in ours):
                owned.difference_update(id(p) for group in other.param_groups for p in group["params"])
        flags = tuple(id(t) in owned and t.device.type == "cpu" for t in self.tensors)
        return flags if any(flags) else ()

    def guarded(self) -> list[Any]:
        """The modules (every submodule) and optimizers whose ``load_state_dict`` must wait for a
        deferred copy, and the optimizers whose ``step`` must."""
        objects: list[Any] = list(self.optimizers.values())
        for value in self.objects.values():
            if isinstance(value, nn.Module):
                objects += list(value.modules())
        return objects

    def holds_objects(self, view: Mapping[str, Any]) -> bool:
        # Modules and optimizers must be the same objects, and each optimizer's state the same
        # mapping of the same size: its ``load_state_dict`` (a rollback in the script) gives it a
        # new one, whose tensors are not those checked by ``holds_tensors``. The rest is read
        # afresh every time (a state mapping built per step may wrap its sampler anew).
        if view.keys() != self.objects.keys() or any(view[k] is not self.objects[k] for k in self.static):
            return False
        return all(optim.state is state and len(state) == n for optim, state, n in self._optimizer_states)

    def holds_tensors(self) -> bool:
        """Each plan tensor this rank keeps is still held where it was found."""
        return all(map(operator.is_, map(dict.get, self._tables, self._keys), self._held))

    def holds_memory(self, ptrs: list[int]) -> bool:
        """Where each kept plan tensor was found, a tensor still starts at its address in ``ptrs``: one
        pass for both ways a deferred copy could read memory training no longer uses (a tensor
        replaced in its module or optimizer, or given new memory by ``.data =``). The plan keeps
        the tensors it found alive, so a new tensor cannot start at an old one's address unless it
        is a view of the very same memory, which then holds the values to copy."""
        if self._sharded:  # what is held is a DTensor, what is copied its local shard
            return self.holds_tensors() and _data_ptrs(self.kept_tensors) == ptrs
        try:
            held: Any = map(dict.get, self._tables, self._keys)
            return list(map(torch.Tensor.data_ptr, held)) == ptrs
        except TypeError:  # an entry removed (None) or no longer a tensor
            return False

    def dynamic(self, view: Mapping[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, optim in self.optimizers.items():
            out[key] = groups = [dict(group) for group in optim.param_groups]
            for group in groups:
                group.pop("params", None)
        for key in self.dynamic_keys:
            value = view[key]
            to_dict = getattr(value, "state_dict", None)
            out[key] = to_dict() if callable(to_dict) and not isinstance(value, type) else value
        return out


def _signature(tensors: list[torch.Tensor]) -> tuple[tuple[torch.dtype, tuple[int, ...]], ...]:
    return tuple((t.dtype, tuple(t.shape)) for t in tensors)


def unmap(mm: mmap.mmap) -> None:
    """Close a mapping tensors were made over; while a view of it is still alive the mapping goes
    when that view does."""
    try:
        mm.close()
    except BufferError:
        pass


class _Slot:
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
        lengths = _PARTS.pack(len(self.specs_bytes), len(static), len(dynamic))
        prefix = self._prefix
        if prefix is None or prefix[0] != start or prefix[1] != lengths or prefix[2] is not self.specs_bytes \
                or prefix[3] is not static:
            head = lengths + self.specs_bytes + static
            self.mm[start:start + len(head)] = head
            prefix = self._prefix = (start, lengths, self.specs_bytes, static, _crc32(head))
        at = start + _PARTS.size + len(self.specs_bytes) + len(static)
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


def _sum_payload(slot: _Slot, step: int) -> None:
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


def _data_ptrs(tensors: list[torch.Tensor]) -> list[int]:
    """Where each tensor's bytes are: a tensor given new storage (``.data = ...``) moves."""
    return list(map(torch.Tensor.data_ptr, tensors))


def _flag(flags: tuple[bool, ...], i: int) -> bool:
    return i < len(flags) and flags[i]


@dataclass
class SnapshotStats:
    taken: int = 0
    last_step: int = -1
    last_stall_s: float = 0.0
    """What the newest finished snapshot blocked training: ``take`` and a step's wait for its copy."""
    total_stall_s: float = 0.0
    state_bytes: int = 0
    last_cost_s: float = 0.0
    """What the newest finished snapshot cost this rank's CPU: ``take`` and the helper thread's
    copy (on a node whose cores the ranks fill, the helper's copy comes out of training too)."""
    overlapped: int = 0
    """Snapshots whose optimizer-owned tensors the helper thread copied."""
    skipped: int = 0
    """Overlapped snapshots not completed: their copy failed or found the state's tensors changed."""


class _LateCopy:
    """A snapshot's deferred part, run by the helper thread: check that the plan's tensors are
    still the ones it found (identity, data pointers), copy the deferred runs, write the skeleton
    and mark the slot complete. A plan that no longer holds skips the snapshot (the slot keeps
    what it had, or stays incomplete) and makes the next one work its plan out again."""

    def __init__(self, writer: SnapshotWriter, plan: _Plan, slot: _Slot, flats: list[torch.Tensor],
                 tensors: list[torch.Tensor], dynamic: bytes, step: int, header: SlotHeader | None,
                 rng_states: dict[str, torch.Tensor | None] | None = None) -> None:
        """``header``: what ``take`` wrote into the slot before copying into it there; None: it
        copied nothing into it, the slot still says what it held, and the header is written here."""
        self.writer, self.plan, self.slot, self.flats = writer, plan, slot, flats
        self.tensors, self.dynamic, self.step, self.header = tensors, dynamic, step, header
        self.rng_states = rng_states
        self.done = False
        self.cpu_s = 0.0

    def run(self) -> None:
        c0 = time.thread_time()
        try:
            self._run()
        finally:
            self.cpu_s = time.thread_time() - c0

    def _run(self) -> None:
        writer, slot = self.writer, self.slot
        if not self.plan.holds_memory(writer._flat_ptrs):
            writer._stale = True
            return
        header = self.header
        if header is None:
            header = writer._header(self.step)
            slot.write_header(header)
        slot.copy_in(self.tensors, self.flats, True)
        dynamic = _fill_stand_ins(self.dynamic, self.rng_states) if self.rng_states is not None else self.dynamic
        slot.finish(self.plan.static_bytes, dynamic, header)
        writer._last_skeleton = slot.skeleton_bytes
        self.done = True
        writer._sum(slot, header.step)


class _Copier:
    """One helper thread running one job at a time (a snapshot's deferred copy). A queue and a
    lock rather than a condition variable: each hand-off is a snapshot's cost, and
    ``Condition.wait`` makes a lock of its own every time in Python."""

    def __init__(self, name: str = "trainguard-snapshot-copy") -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._running = threading.Lock()
        """Held from a job's submission until it is done."""
        self.busy = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], None]) -> None:
        self._running.acquire()  # the previous job is done (``SnapshotWriter.take`` waited for it)
        self.busy = True
        self._jobs.put(job)

    def wait(self) -> None:
        if self.busy:
            with self._running:
                pass

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                job()
            except BaseException as exc:  # noqa: BLE001 - told to the rank at its next snapshot
                self.error = exc
            self.busy = False
            self._running.release()


_WRITERS: weakref.WeakSet[SnapshotWriter] = weakref.WeakSet()
_AT_FORK: list[bool] = []


def _wait_all_before_fork() -> None:
    # A child forked in the middle of a copy would inherit whatever the helper thread held.
    for writer in list(_WRITERS):
        writer.wait_summed()


class SnapshotWriter:
    """One rank's snapshots (see the module docstring). ``share``: the ranks of this job share out
    the tensors they hold alike (data-parallel replicas on one node: ``trainguard.checkpoint.snapshot.replicas``)."""

    def __init__(self, directory: str, rank: int, world_size: int, attempt: int, *, share: bool = False,
                 overlap: bool = False, checksum: bool = True) -> None:
        """``checksum``: record each slot's payload crc32 (a thread of its own sums it after the slot
        is complete, off the training thread and off the copy a step waits for)."""
        self.directory = directory
        self.checksum = checksum
        self._summer: _Copier | None = None
        self.rank, self.world_size, self.attempt = rank, world_size, attempt
        self.share = share and world_size > 1
        self.overlap = overlap
        self.stats = SnapshotStats()
        self._copier: _Copier | None = None
        self._pending: tuple[int, float, _LateCopy] | None = None
        """(step, seconds ``take`` blocked, its copy) of the snapshot whose deferred copy is in flight."""
        self._stale = False
        """The helper found the plan's tensors changed: work it out again."""
        self._hooks: list[Any] = []
        self._hooked: tuple[int, ...] = ()
        self._guarded_plan: _Plan | None = None
        os.makedirs(directory, exist_ok=True)
        self._slots = [_Slot(str(slot_path(directory, rank, s))) for s in SLOTS]
        self._last_skeleton = 0
        self._plan: _Plan | None = None
        self._flats: list[torch.Tensor] | None = None
        self._flat_ptrs: list[int] = []
        self._meta_cache: tuple[dict[str, Any], bytes] | None = None
        self._pickler = _ReusedPickler()

    def _target(self) -> _Slot:
        """The slot not holding the newest complete snapshot."""
        first, second = self._slots
        return second if first.step >= second.step else first

    def take(self, step: int, state: Mapping[str, Any], meta: Mapping[str, Any]) -> float:
        """Snapshot ``state`` as of ``step`` steps done; returns the seconds this call blocked
        (with ``overlap``, a copy may go on after it: ``wait``). Raises SnapshotError (nothing
        newer was recorded, the previous snapshot stays)."""
        self.wait()
        if self._copier is not None and self._copier.error is not None:
            error, self._copier.error = self._copier.error, None
            raise SnapshotError(f"the copy of the previous snapshot failed: {type(error).__name__}: {error}")
        t0 = time.perf_counter()
        if self._summer is not None and self._summer.busy:
            self._summer.wait()  # the slot written now may be the one still being summed
        view = snapshot_view(state)
        plan = self._plan
        # With the copy deferred, the helper checks the plan's tensors (identity, data pointers)
        # when it copies them: nothing may change them before the optimizer step it waits for.
        late_ok = self.overlap and plan is not None and bool(plan.deferred) and self._flats is not None
        flats_ok = False
        if plan is not None and not self._stale and plan.holds_objects(view):
            # The kept tensors still where they were found, at the same addresses: the plan and
            # its flat views hold. One pass; a tensor given new memory keeps the plan, not the
            # views. With the copy deferred the helper runs that check when it copies.
            flats_ok = late_ok or plan.holds_memory(self._flat_ptrs)
            if not flats_ok and not plan.holds_tensors():
                plan = None
        else:
            plan = None
        if plan is None:
            plan = self._plan = _Plan(view, (self.rank, self.world_size) if self.share else None)
            self._stale = False
        tensors = list(plan.tensors)
        flats = self._flats if flats_ok else self._flat_sources(plan)
        late = self.overlap and flats is not None and bool(plan.deferred)
        # With a helper to finish the skeleton, the RNG states' bytes are read there (~30 us on a
        # cache a step has just gone through): the pickle gets stand-ins of their length, the first
        # thing in it, which the helper overwrites.
        rng_now = rng_states() if late else None
        try:
            dynamic = self._pickler.dumps({"rng": _stand_ins(rng_now) if rng_now is not None else _rng_bytes(),
                                           "dynamic": plan.dynamic(view), "meta": self._meta_bytes(meta)}, tensors)
        except (pickle.PicklingError, AttributeError, TypeError) as exc:
            self._plan = None
            raise SnapshotError(f"the state holds something snapshots cannot carry: {exc}") from exc
        slot = self._target()
        signature = plan.signature if len(tensors) == len(plan.tensors) else \
            plan.signature + _signature(tensors[len(plan.tensors):])
        deferred = plan.deferred if late else ()
        # The specs' pickle is ~40 bytes a tensor: a first layout with room for it maps the slot once.
        skeleton_bytes = _PARTS.size + len(plan.static_bytes) + len(dynamic) + 64 * len(tensors) + 4096
        try:
            slot.layout(tensors, max(self._last_skeleton, skeleton_bytes), signature, len(plan.tensors), plan.holders,
                        deferred)
            if not slot._room(_PARTS.size + len(slot.specs_bytes) + len(plan.static_bytes) + len(dynamic)):
                # a skeleton that outgrew its reserve: a new layout
                slot.layout(tensors, 2 * (len(slot.specs_bytes) + skeleton_bytes), signature, len(plan.tensors),
                            plan.holders, deferred)
        except OSError as exc:
            raise SnapshotError(f"no room for a snapshot of {sum(t.numel() * t.element_size() for t in tensors)} "
                                f"bytes in {self.directory}: {exc}") from exc
        st = self.stats
        st.taken += 1
        st.state_bytes = slot.payload_bytes
        header = None  # the helper writes it where this copies nothing
        if not late or not slot.all_late:  # bytes copied here: the slot is no longer the complete one it was
            header = self._header(step)
            slot.write_header(header)
            slot.copy_in(tensors, flats, False if late else None)
        if late:
            assert flats is not None
            self._guard(plan)
            if self._copier is None:
                self._copier = _Copier()
            job = _LateCopy(self, plan, slot, flats, tensors, dynamic, step, header, rng_now)
            self._copier.submit(job.run)
            blocked = time.perf_counter() - t0
            self._pending = (step, blocked, job)
            st.overlapped += 1
            st.total_stall_s += blocked
            return blocked
        assert header is not None
        slot.finish(plan.static_bytes, dynamic, header)
        self._last_skeleton = slot.skeleton_bytes
        self._sum(slot, step)
        stall = time.perf_counter() - t0
        st.last_step, st.last_stall_s = step, stall
        st.last_cost_s = stall
        st.total_stall_s += stall
        return stall

    def _sum(self, slot: _Slot, step: int) -> None:
        """Hand the complete slot's payload to the summing thread (``checksum``)."""
        if not self.checksum:
            return
        if self._summer is None:
            self._summer = _Copier("trainguard-snapshot-sum")
            _WRITERS.add(self)
            if not _AT_FORK:
                os.register_at_fork(before=_wait_all_before_fork)
                _AT_FORK.append(True)
        self._summer.submit(lambda: _sum_payload(slot, step))

    def wait_summed(self) -> None:
        """Wait until the newest complete slot's crc32 is recorded (before it may be restored)."""
        self.wait()
        if self._summer is not None:
            self._summer.wait()

    def _header(self, step: int) -> SlotHeader:
        """The header of a slot being written with ``step``."""
        return SlotHeader(WRITING, step, self.attempt, self.world_size, self.rank, 0, 0, 0)

    def _meta_bytes(self, meta: Mapping[str, Any]) -> bytes:
        """``meta`` pickled, once while it stays equal (a run's checkpoint meta changes with its plan)."""
        cached = self._meta_cache
        try:
            same = cached is not None and bool(cached[0] == meta)
        except Exception:  # noqa: BLE001 - a value whose == is no plain answer (an array): pickled anew
            same = False
        if cached is None or not same:
            cached = self._meta_cache = (dict(meta), self._pickler.dumps(dict(meta), []))
        return cached[1]

    def wait(self) -> float:
        """Wait for the deferred copy in flight (none: at once); the seconds waited, which count
        as that snapshot's stall."""
        pending = self._pending
        if pending is None:
            return 0.0
        t0 = time.perf_counter()
        assert self._copier is not None
        if self._copier.busy:
            self._copier.wait()
        waited = time.perf_counter() - t0
        self._pending = None
        st = self.stats
        st.total_stall_s += waited
        if pending[2].done:
            st.last_step, st.last_stall_s = pending[0], pending[1] + waited
            st.last_cost_s = pending[1] + pending[2].cpu_s
        else:
            st.skipped += 1
        return waited

    def _guard(self, plan: _Plan) -> None:
        """Hooks that wait for a deferred copy before anything changes what it copies: each
        optimizer's step, each module's and optimizer's ``load_state_dict``, a fork."""
        if plan is self._guarded_plan:
            return
        objects = plan.guarded()
        ids = tuple(map(id, objects))
        self._guarded_plan = plan
        if ids == self._hooked:
            return
        self._unhook()
        me = weakref.ref(self)

        def wait_for_copy(*_: Any, **__: Any) -> None:
            writer = me()
            if writer is not None:
                writer.wait()

        for obj in objects:
            if isinstance(obj, torch.optim.Optimizer):
                self._hooks.append(obj.register_step_pre_hook(wait_for_copy))
            on_load = getattr(obj, "register_load_state_dict_pre_hook", None)  # public on modules since torch 2.5
            if on_load is not None:
                self._hooks.append(on_load(wait_for_copy))
        self._hooked = ids
        _WRITERS.add(self)
        if not _AT_FORK:
            os.register_at_fork(before=_wait_all_before_fork)
            _AT_FORK.append(True)

    def _unhook(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks, self._hooked, self._guarded_plan = [], (), None

    def _flat_sources(self, plan: _Plan) -> list[torch.Tensor] | None:
        """Per plan tensor, a flat view of it where this rank's slot keeps it (the tensor itself
        elsewhere: no copy here reads it), and the kept ones' addresses, against which ``take``
        checks them before it reuses the views (a view costs ~1 us, a pointer read ~0.1 us; the
        views hold the old storage, so a replaced tensor's memory cannot come back at the same
        address). None: they go one by one."""
        kept = plan.kept_tensors
        self._flat_ptrs = _data_ptrs(kept)
        self._flats = None
        if all(t.device.type == "cpu" and t.is_contiguous() for t in kept):
            flats = list(plan.tensors)
            for i in plan.kept:
                flats[i] = plan.tensors[i].detach().view(-1)
            self._flats = flats
        return self._flats

    def check_restorable(self) -> None:
        """Raise SnapshotError when the newest snapshot's skeleton could not be read back (the
        state holds values other than tensors and plain Python data)."""
        self.wait_summed()
        newest = max(self._slots, key=lambda s: s.step)
        found = read_done(newest.path)
        if found is None:
            raise SnapshotError("the snapshot just written cannot be read back")
        try:
            _read_skeleton(found[1])
        except (pickle.UnpicklingError, AttributeError, ImportError) as exc:
            raise SnapshotError(f"the state holds something snapshots cannot carry: {exc}") from exc

    def close(self) -> None:
        self.wait_summed()
        self._unhook()
        _WRITERS.discard(self)
        # What the plan found (the script's modules and optimizers) is the script's to let go.
        self._plan = self._flats = None
        self._flat_ptrs = []
        for slot in self._slots:
            slot.close()


def spec_nbytes(spec: TensorSpec) -> int:
    n = 1
    for d in spec.shape:
        n *= d
    return n * torch.empty((), dtype=getattr(torch, spec.dtype)).element_size()
