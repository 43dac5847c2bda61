"""A snapshot's skeleton: the state's structure pickled with a ``TensorRef`` in place of each
tensor, the ``TensorSpec`` of where each tensor's bytes lie, and the restricted unpickler that reads
them back (only plain Python data and these two classes)."""

from __future__ import annotations

import io
import pickle
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

PARTS = struct.Struct("<III")  # lengths of the skeleton's parts: tensor specs, static tree, per-step values
_SAFE_BUILTINS = frozenset({"dict", "list", "tuple", "set", "frozenset", "int", "float", "complex", "bool",
                            "str", "bytes", "bytearray", "slice", "range", "NoneType"})


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
    if len(raw) < PARTS.size:
        raise pickle.UnpicklingError("skeleton too short")
    lengths = PARTS.unpack_from(raw)
    if PARTS.size + sum(lengths) != len(raw):
        raise pickle.UnpicklingError("skeleton parts do not add up")
    out, at = [], PARTS.size
    for n in lengths:
        out.append(raw[at:at + n])
        at += n
    return out


def read_skeleton(raw: bytes) -> tuple[list[TensorSpec], dict[str, Any], dict[str, Any]]:
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
            ref = tensor_ref(obj, self.tensors)
            return TensorRef, (ref.index, ref.dtensor)
        for plain in (dict, list, tuple):
            if isinstance(obj, plain) and type(obj) is not plain:
                return plain, (plain(obj),)
        return NotImplemented


class ReusedPickler:
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


def tensor_ref(tensor: torch.Tensor, tensors: list[torch.Tensor]) -> TensorRef:
    if isinstance(tensor, DTensor):
        tensors.append(tensor.to_local())
        return TensorRef(len(tensors) - 1, dtensor=True)
    tensors.append(tensor)
    return TensorRef(len(tensors) - 1)


def signature_of(tensors: list[torch.Tensor]) -> tuple[tuple[torch.dtype, tuple[int, ...]], ...]:
    return tuple((t.dtype, tuple(t.shape)) for t in tensors)


def spec_nbytes(spec: TensorSpec) -> int:
    n = 1
    for d in spec.shape:
        n *= d
    return n * torch.empty((), dtype=getattr(torch, spec.dtype)).element_size()
