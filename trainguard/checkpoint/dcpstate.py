"""What DCP saves of a training state and how: modules and optimizers by parameter name, the
memory tier's recycled files, the fast planner for plain values, and the plain-directory
checkpoints (``save_dir``) and loads (``load``) that a restart goes through.

``state`` is a mapping of names to what a script wants back after a restart: ``nn.Module``s
(saved by parameter name, so a different data-parallel degree reshards on load), optimizers
(flattened by parameter name, with the modules of the same state), anything with
``state_dict``/``load_state_dict`` (LR schedulers, grad scalers, samplers) and plain values.
Restoring loads into the same objects in place and writes plain values back into the mapping.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
from collections.abc import Iterator, Mapping, MutableMapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from trainguard.agent.checkpoint.memory import MemoryTier, open_for_overwrite
from trainguard.checkpoint.dcpreplay import object_bytes
from trainguard.checkpoint.dcpsafe import SafeFileSystemReader, SafeLoadPlanner
from trainguard.checkpoint.rng import load_rng_file, write_rng_file
from trainguard.checkpoint.statedict import LearnedStateDicts, sharded

META = "meta.json"
_OPTIM_OPTS = StateDictOptions(flatten_optimizer_state_dict=True)


class ReuseFileSystem(FileSystem):
    """DCP file system that overwrites the memory tier's recycled files instead of new ones."""

    @contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[io.IOBase]:
        if mode != "wb":
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with open_for_overwrite(path) as stream:
            yield stream  # type: ignore[misc]


class ObjectsFastPlanner(DefaultSavePlanner):
    """DCP's default save planner, but each plain value (every flattened optimizer hyperparameter is
    one: 1,300 of a 1,800-item state) is written in torch's legacy format (``dcpreplay.object_bytes``:
    0.4 us for a float, against 112 us for ``torch.save``'s zip format); ``torch.load``, DCP's
    loader, reads either."""

    def transform_object(self, write_item: WriteItem, object: Any) -> Any:  # noqa: A002 - DCP's name
        if write_item.type != WriteItemType.BYTE_IO:
            return object
        return io.BytesIO(object_bytes(object))


class _ModuleState(Stateful):
    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def state_dict(self) -> dict[str, Any]:
        return get_model_state_dict(self.module)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_model_state_dict(self.module, state_dict)


class _OptimizerState(Stateful):
    def __init__(self, model: nn.Module, optim: torch.optim.Optimizer) -> None:
        self.model = model
        self.optim = optim

    def state_dict(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.model, self.optim, options=_OPTIM_OPTS)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.optim, state_dict, options=_OPTIM_OPTS)


def _dcp_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """The mapping DCP saves and loads: modules and optimizers by parameter name, the rest as is."""
    modules = [v for v in state.values() if isinstance(v, nn.Module)]
    owner: nn.Module | None = modules[0] if len(modules) == 1 else (nn.ModuleList(modules) if modules else None)
    out: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, nn.Module):
            out[key] = _ModuleState(value)
        elif isinstance(value, torch.optim.Optimizer):
            if owner is None:
                raise TypeError(f"state[{key!r}]: an optimizer needs its model in the same state")
            out[key] = _OptimizerState(owner, value)
        else:
            out[key] = value
    return out


def _resolved(state: Mapping[str, Any], learned: LearnedStateDicts | None = None) -> dict[str, Any]:
    """The state with every ``Stateful`` replaced by its state dict (what DCP would save). One
    model with one optimizer (the usual state) goes through one ``get_state_dict``: each of DCP's
    two getters works out the model's names and checks its options again (~7 -> ~5 ms for a
    160-parameter model with AdamW, on every rank at every memory-tier save); with ``learned`` (a
    writer's cache from save to save) that pair's names are worked out once
    (``trainguard.checkpoint.statedict``)."""
    models = [(k, v) for k, v in state.items() if isinstance(v, _ModuleState)]
    optims = [(k, v) for k, v in state.items() if isinstance(v, _OptimizerState)]
    both: dict[str, Any] = {}
    if len(models) == 1 and len(optims) == 1 and optims[0][1].model is models[0][1].module:
        model, optim = models[0][1].module, optims[0][1].optim
        pair = get_state_dict(model, optim, options=_OPTIM_OPTS) if learned is None else learned([(model, optim)])[0]
        both[models[0][0]], both[optims[0][0]] = pair
    return {k: both[k] if k in both else v.state_dict() if isinstance(v, Stateful) else v for k, v in state.items()}


def _layout_hash(tree: Any) -> int:
    """A 62-bit hash of a state's keys, tensor shapes and dtypes and value types. A sharded value
    (DTensor, ShardedTensor: types from torch.distributed) makes it this rank's own, so that ranks
    holding shards never agree on it."""
    h = hashlib.blake2b(digest_size=8)

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, Mapping):
            for key in sorted(node, key=str):
                walk(node[key], f"{prefix}/{key}")
        elif isinstance(node, (list, tuple)):
            for i, item in enumerate(node):
                walk(item, f"{prefix}[{i}]")
        elif sharded(node):
            h.update(f"{prefix}:sharded:{dist.get_rank()};".encode())
        elif isinstance(node, torch.Tensor):
            h.update(f"{prefix}:{tuple(node.shape)}:{node.dtype};".encode())
        else:
            h.update(f"{prefix}:{type(node).__name__};".encode())

    walk(tree, "")
    return int.from_bytes(h.digest(), "little") >> 2



def _save_alone_dcp(path: str, tree: Mapping[str, Any]) -> None:
    dcp.save(dict(tree), storage_writer=_writer(path), planner=ObjectsFastPlanner(), no_dist=True)


def _writer(path: str) -> dcp.FileSystemWriter:
    writer = dcp.FileSystemWriter(path, single_file_per_rank=True)
    writer.fs = ReuseFileSystem()
    return writer


def _write_meta(path: str, label: int, world: int, meta: Mapping[str, Any]) -> None:
    with open(os.path.join(path, META), "w") as fh:
        json.dump({"step": label, "world_size": world, **meta}, fh)


def save_dir(path: str, state: Mapping[str, Any], meta: Mapping[str, Any]) -> str:
    """Save ``state`` into the plain directory ``path`` (collective): written to ``<path>.tmp``, then
    renamed into place by rank 0 once every rank finished, so a directory without the suffix is
    complete. ``meta`` (with ``step``) goes into ``meta.json``. Assumes one shared filesystem."""
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    tmp = f"{path}.tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(os.path.join(tmp, "rng"), exist_ok=True)
    if distributed:
        dist.barrier()
    dcp.save(_dcp_state(state), checkpoint_id=tmp)
    write_rng_file(os.path.join(tmp, "rng", f"rank{rank}.pt"))
    if distributed:
        dist.barrier()
    if rank == 0:
        body = {"world_size": dist.get_world_size() if distributed else 1, **meta}
        with open(os.path.join(tmp, META), "w") as fh:
            json.dump(body, fh)
            fh.flush()
            os.fsync(fh.fileno())
        if os.path.exists(path):
            shutil.rmtree(path)
        os.replace(tmp, path)
    if distributed:
        dist.barrier()
    return path


def load(path: str, state: MutableMapping[str, Any] | Mapping[str, Any], *, rank: int) -> dict[str, Any]:
    """Load checkpoint directory ``path`` into ``state`` (collective when distributed); returns
    its ``meta.json`` (``step``: steps done, where training resumes)."""
    with open(os.path.join(path, META)) as fh:
        meta: dict[str, Any] = json.load(fh)
    target = _dcp_state(state)
    # Ranks may run as root: nothing in the checkpoint is unpickled beyond DCP metadata and plain values.
    dcp.load(target, checkpoint_id=path, storage_reader=SafeFileSystemReader(path), planner=SafeLoadPlanner())
    if isinstance(state, MutableMapping):
        for key, value in target.items():
            if not isinstance(value, Stateful) and not isinstance(state[key], Stateful):
                state[key] = value
    load_rng_file(os.path.join(path, "rng", f"rank{rank}.pt"))
    return meta


def newest_memory_checkpoint(root: str, job: str) -> str | None:
    """The newest verified memory-tier checkpoint of ``job`` (for jobs the agent did not start)."""
    tier = MemoryTier(root)
    for info in sorted(tier.list(job), key=lambda i: i.step, reverse=True):
        if tier.verify(job, info.step).ok:
            return str(tier.step_path(job, info.step))
    return None
