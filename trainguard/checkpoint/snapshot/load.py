"""Restoring a rank's per-step snapshot (``trainguard.checkpoint.snapshot.writer`` takes them).

A restore reads the rank's slot of the step the agent picked into fresh memory, and from the slot
of each rank that kept a share of the replicated tensors (``trainguard.checkpoint.snapshot.replicas``) that share, and
loads it into the same objects the snapshot was taken of: modules and optimizers through their
``load_state_dict``, a DTensor's local shard onto the layout of the live parameter it goes into,
plain values written back into the mapping, then the RNG. The skeleton is read by an unpickler
that admits plain values and tensor placeholders only.
"""

from __future__ import annotations

import os
import pickle
import zlib
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from trainguard.agent.checkpoint.snapshots import HEADER_BYTES, SLOTS, open_slot, read_done, slot_path
from trainguard.checkpoint.rng import set_rng_states
from trainguard.checkpoint.snapshot.errors import SnapshotError
from trainguard.checkpoint.snapshot.skeleton import (
    TensorRef,
    TensorSpec,
    loads_skeleton,
    map_leaves,
    skeleton_parts,
    snapshot_view,
    spec_nbytes,
)


@dataclass(frozen=True)
class _Shard:
    """A DTensor's local shard as loaded, until the live object it goes into says its layout."""

    local: torch.Tensor


def _fill(value: Any, tensors: list[torch.Tensor], own: bool = False) -> Any:
    """The inverse of ``_StrippingPickler``: a DTensor's shard comes back as a ``_Shard`` until
    placed. ``own``: each tensor in memory of its own, not a view into the payload (code that reads
    a tensor's storage, as ``Generator.set_state`` does, reads it from the payload's start)."""
    def placed(ref: TensorRef) -> Any:
        tensor = tensors[ref.index].clone() if own else tensors[ref.index]
        return _Shard(tensor) if ref.dtensor else tensor
    return map_leaves(value, lambda v: placed(v) if isinstance(v, TensorRef) else v)


def _as_dtensor(shard: Any, like: Any, where: str) -> Any:
    if not isinstance(shard, _Shard):
        return shard
    if not isinstance(like, DTensor) or tuple(like.to_local().shape) != tuple(shard.local.shape):
        raise SnapshotError(f"{where}: a DTensor shard with no DTensor of its layout to go into")
    return DTensor.from_local(shard.local, like.device_mesh, like.placements, run_check=False,
                              shape=like.shape, stride=like.stride())


def _with_layouts(target: Any, loaded: Any, key: str) -> Any:
    """``loaded`` with every DTensor shard made a DTensor again, on the layout of the live
    module's parameters (an optimizer's state: of the parameter it belongs to)."""
    if isinstance(target, nn.Module) and isinstance(loaded, dict):
        live = target.state_dict()
        return {k: _as_dtensor(v, live.get(k), f"{key}.{k}") for k, v in loaded.items()}
    if isinstance(target, torch.optim.Optimizer) and isinstance(loaded, dict):
        params = [p for group in target.param_groups for p in group["params"]]
        state = {}
        for idx, entry in loaded.get("state", {}).items():
            param = params[idx] if isinstance(idx, int) and 0 <= idx < len(params) else None
            state[idx] = {n: _as_dtensor(v, param, f"{key}.state.{idx}.{n}") for n, v in entry.items()}
        return {**loaded, "state": state}
    if _holds_shard(loaded):
        raise SnapshotError(f"{key}: holds DTensor shards, restorable only into modules and optimizers")
    return loaded


def _holds_shard(value: Any) -> bool:
    found: list[bool] = []
    map_leaves(value, lambda v: found.append(isinstance(v, _Shard)))
    return any(found)


def _assemble(static: dict[str, Any], dynamic: dict[str, Any]) -> dict[str, Any]:
    """Each key's ``state_dict`` (or plain value) as its object's ``load_state_dict`` takes it."""
    out: dict[str, Any] = {}
    for key, entry in static.items():
        if entry[0] == "module":
            out[key] = entry[1]
        else:
            _, state, groups = entry
            out[key] = {"state": state, "param_groups": [{**hyper, "params": params}
                                                         for hyper, params in zip(dynamic[key], groups, strict=True)]}
    for key, value in dynamic.items():
        out.setdefault(key, value)
    return out


@dataclass
class _SlotRead:
    """One rank's complete slot of a step, read into memory."""

    specs: list[TensorSpec]
    parts: list[bytes]
    payload: torch.Tensor

    def tensor(self, index: int) -> torch.Tensor:
        spec = self.specs[index]
        return self.payload.narrow(0, spec.offset, spec_nbytes(spec)).view(getattr(torch, spec.dtype)).view(spec.shape)


def _read_slot(directory: str, rank: int, world_size: int, step: int) -> _SlotRead:
    for name in SLOTS:
        path = slot_path(directory, rank, name)
        found = read_done(path)
        if found is not None and found[0].step == step:
            break
    else:
        raise SnapshotError(f"rank {rank} has no complete snapshot of step {step} in {directory}")
    header, raw = found
    if header.world_size != world_size or header.rank != rank:
        raise SnapshotError(f"the snapshot of step {step} is of rank {header.rank} of {header.world_size}, "
                            f"not rank {rank} of {world_size}")
    try:
        parts = skeleton_parts(raw)
        specs: list[TensorSpec] = loads_skeleton(parts[0])
    except (pickle.UnpicklingError, AttributeError, ImportError, EOFError) as exc:
        raise SnapshotError(f"snapshot skeleton unreadable: {exc}") from exc
    payload = torch.empty(header.payload_bytes, dtype=torch.uint8)
    with os.fdopen(open_slot(path), "rb") as fh:
        fh.seek(HEADER_BYTES)
        if fh.readinto(payload.numpy().data) != header.payload_bytes:
            raise SnapshotError(f"snapshot of step {step} is short")
    # The bytes as the writer summed them when the slot was complete: damage in the slot since (a
    # flipped bit in shared memory, a stray write) makes the rank restore the checkpoint instead.
    if header.payload_summed and zlib.crc32(payload.numpy().data) != header.payload_crc:
        raise SnapshotError(f"rank {rank}'s snapshot of step {step} is damaged: its tensor bytes do not "
                            "match their crc32")
    return _SlotRead(specs, parts, payload)


def _slot_tensors(directory: str, mine: _SlotRead, world_size: int, step: int) -> list[torch.Tensor]:
    """Every tensor of this rank's snapshot: from its own slot, or a replica's share from the slot
    of the rank that kept it, which must hold the same structure and that tensor's layout."""
    shares: dict[int, _SlotRead] = {}
    tensors = []
    for index, spec in enumerate(mine.specs):
        if spec.holder < 0:
            tensors.append(mine.tensor(index))
            continue
        share = shares.get(spec.holder)
        if share is None:
            share = shares[spec.holder] = _read_slot(directory, spec.holder, world_size, step)
            if share.parts[1] != mine.parts[1]:
                raise SnapshotError(f"rank {spec.holder}'s snapshot of step {step} holds another structure")
        theirs = share.specs[index] if index < len(share.specs) else None
        if theirs is None or theirs.holder >= 0 or (theirs.dtype, theirs.shape) != (spec.dtype, spec.shape):
            raise SnapshotError(f"rank {spec.holder}'s snapshot of step {step} does not hold tensor {index} as kept")
        tensors.append(share.tensor(index))
    return tensors


def load_snapshot(directory: str, rank: int, world_size: int, step: int, state: Mapping[str, Any]) -> dict[str, Any]:
    """Load this rank's snapshot of ``step`` into ``state`` (in place; plain values are written back
    into the mapping) and set the RNG; returns the meta saved with it. Replicated tensors another
    rank kept come from that rank's slot of the same step. Raises SnapshotError."""
    mine = _read_slot(directory, rank, world_size, step)
    try:
        static, per_step = loads_skeleton(mine.parts[1]), loads_skeleton(mine.parts[2])
    except (pickle.UnpicklingError, AttributeError, ImportError, EOFError) as exc:
        raise SnapshotError(f"snapshot skeleton unreadable: {exc}") from exc
    tensors = _slot_tensors(directory, mine, world_size, step)
    # Modules and optimizers copy out of what they are given; a user's own state_dict may keep it.
    tree = {"state": _assemble(_fill(static, tensors), _fill(per_step["dynamic"], tensors, own=True)),
            "rng": _fill(per_step["rng"], tensors, own=True)}
    view = snapshot_view(state)
    missing = sorted(set(view) - set(tree["state"]))
    if missing:
        raise SnapshotError(f"the snapshot lacks {', '.join(missing)} (the script's state changed)")
    for key, target in view.items():
        loaded = _with_layouts(target, tree["state"][key], key)
        load_into = getattr(target, "load_state_dict", None)
        if callable(load_into) and not isinstance(target, type):
            try:
                load_into(loaded)
            except (RuntimeError, KeyError, ValueError, TypeError) as exc:
                raise SnapshotError(f"{key}: {exc}") from exc
        elif isinstance(state, MutableMapping) and key in state:
            state[key] = loaded
    set_rng_states(tree["rng"])
    saved = per_step["meta"]  # pickled on its own: it changes far less often than the rest
    meta: dict[str, Any] = dict(loads_skeleton(saved) if isinstance(saved, bytes) else saved)
    return meta
