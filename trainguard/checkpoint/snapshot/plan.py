"""What a snapshot of one state copies (``CopyPlan``): its tensors found once, the checks that they
are still in place, which of them an optimizer's step alone changes, and which a replica's share
keeps elsewhere."""

from __future__ import annotations

import operator
import pickle
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from trainguard.checkpoint.snapshot.replicas import holders, replicated_ids
from trainguard.checkpoint.snapshot.skeleton import TensorRef, signature_of, tensor_ref


def _owners(module: nn.Module) -> dict[int, tuple[dict[str, Any], str]]:
    """Where each parameter and buffer object of ``module`` is held (its submodule's dict, name)."""
    out: dict[int, tuple[dict[str, Any], str]] = {}
    for sub in module.modules():
        for table in (sub._parameters, sub._buffers):
            for name, t in table.items():
                if t is not None:
                    out[id(t)] = (table, name)
    return out


class CopyPlan:
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
        self.signature = signature_of(self.tensors)
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
        self.static[key] = ("module", {name: tensor_ref(t, self.tensors) for name, t in entries.items()})
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
            state[index] = {name: tensor_ref(v, self.tensors) for name, v in entry.items()}
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
            return self.holds_tensors() and data_ptrs(self.kept_tensors) == ptrs
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


def data_ptrs(tensors: list[torch.Tensor]) -> list[int]:
    """Where each tensor's bytes are: a tensor given new storage (``.data = ...``) moves."""
    return list(map(torch.Tensor.data_ptr, tensors))
