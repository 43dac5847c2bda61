"""DCP's ``get_state_dict`` of one model and its optimizer, learned once and then built directly.

Every memory-tier save needs the state as DCP names it (parameters by fully qualified name, the
optimizer flattened by those names). DCP's ``get_state_dict`` works those names out again on every
call, and checks its options against the model's wrappers: ~1.5 ms for the recovery bench's
25-parameter model with AdamW, on every rank at every save, against ~0.1 ms for the model's and
the optimizer's own ``state_dict`` (``bench/BENCHMARKS.md``).

For a model whose tensors are its own (no sharded parameter), the names do not change from save to
save: the first call takes DCP's answer and learns, by position, which name DCP gives each of the
model's ``state_dict`` keys. Later calls build the same mapping from the model's and the
optimizer's current tensors and values with those names. Every ``VERIFY_EVERY``-th call, and any
call where the model's keys or the optimizer's parameters changed, is DCP's own again, compared
with what the learned names would have built: a difference (a wrapper, a hook, a new kind of
state) turns the fast path off for good.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

VERIFY_EVERY = 16
"""Calls between two checks of the built state against DCP's own."""


class LearnedStateDict:
    """``get_state_dict(model, optim, options=flattened)`` for one model and optimizer pair."""

    def __init__(self, model: nn.Module, optim: torch.optim.Optimizer, options: StateDictOptions) -> None:
        self.model = model
        self.optim = optim
        self.options = options
        self.enabled = options.flatten_optimizer_state_dict and not options.full_state_dict and not options.cpu_offload
        self._keys: tuple[str, ...] = ()
        self._names: dict[str, str] = {}  # the model's state_dict key -> DCP's name
        self._params: tuple[int, ...] = ()  # the optimizer's parameters, by id, in group order
        self._calls = 0
        self.built = 0
        """Calls answered without DCP (for tests and stats)."""

    def __call__(self) -> tuple[dict[str, Any], dict[str, Any]]:
        self._calls += 1
        if self.enabled and self._names:
            model_sd = self.model.state_dict()
            params = tuple(id(p) for g in self.optim.param_groups for p in g["params"])
            if tuple(model_sd) == self._keys and params == self._params and self._calls % VERIFY_EVERY:
                built = self._build(model_sd)
                if built is not None:
                    self.built += 1
                    return built
        reference = get_state_dict(self.model, self.optim, options=self.options)
        if self.enabled:
            self._learn(reference)
        return reference

    def _learn(self, reference: tuple[dict[str, Any], dict[str, Any]]) -> None:
        """Names by position, then the state they build must equal DCP's (else off for good)."""
        ref_model, ref_optim = reference
        if any(sharded(v) for v in ref_model.values()):
            self.enabled = False  # before asking the model: an FSDP module's own state_dict may gather
            return
        model_sd = self.model.state_dict()
        if len(model_sd) != len(ref_model):
            self.enabled = False
            return
        self._names = dict(zip(model_sd, ref_model, strict=True))
        self._keys = tuple(model_sd)
        self._params = tuple(id(p) for g in self.optim.param_groups for p in g["params"])
        built = self._build(model_sd)
        if built is None or not _same(built[0], ref_model) or not _same(built[1], ref_optim):
            self.enabled = False
            self._names = {}

    def _build(self, model_sd: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]] | None:
        names = self._names
        model_out = {names[k]: v for k, v in model_sd.items()}
        by_param: dict[int, str] = {}
        for key, tensor in self.model.named_parameters(remove_duplicate=False):
            name = names.get(key)
            if name is None:
                return None
            by_param.setdefault(id(tensor), name)
        state: dict[str, Any] = {}
        groups: dict[str, Any] = {}
        for group in self.optim.param_groups:
            for p in group["params"]:
                name = by_param.get(id(p))
                if name is None:
                    return None
                for key, value in self.optim.state.get(p, {}).items():
                    state[f"state.{name}.{key}"] = value
                for key, value in group.items():
                    if key != "params":
                        groups[f"param_groups.{name}.{key}"] = value
        return model_out, state | groups


class LearnedStateDicts:
    """The ``LearnedStateDict`` of each (model, optimizer) pair a saver passes, kept from save to
    save while the same pairs come back; other pairs (a rebuilt model) replace them all, so no
    model that was let go is kept alive here."""

    def __init__(self, options: StateDictOptions) -> None:
        self.options = options
        self.kept: list[LearnedStateDict] = []

    def __call__(self, pairs: list[tuple[nn.Module, torch.optim.Optimizer]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
        """``get_state_dict(model, optim)`` of each pair, in order."""
        if len(self.kept) != len(pairs) or any(g.model is not m or g.optim is not o
                                               for g, (m, o) in zip(self.kept, pairs, strict=True)):
            self.kept = [LearnedStateDict(m, o, self.options) for m, o in pairs]
        return [getter() for getter in self.kept]

    def forget(self) -> None:
        """Let go of the models and optimizers (the saver is closing): a script that drops its DDP
        model before ``destroy_process_group`` must be able to, or the model's reducer dies with the
        last reference, after the group, and can hang the rank's exit (torch: its destructor joins
        gloo's threads while holding the GIL, which one of them may need)."""
        self.kept = []


def sharded(value: Any) -> bool:
    """A tensor type of torch.distributed (DTensor, ShardedTensor): a part of a larger value."""
    return type(value).__module__.startswith("torch.distributed")


def _same(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """The same keys in the same order, the same tensors (storage, shape, strides, dtype) and equal
    plain values."""
    if list(a) != list(b):
        return False
    for key, x in a.items():
        y = b[key]
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)) or sharded(x) or sharded(y):
                return False
            if (x.data_ptr(), x.shape, x.stride(), x.dtype, x.device) != (y.data_ptr(), y.shape, y.stride(), y.dtype, y.device):
                return False
        elif type(x) is not type(y) or x != y:
            return False
    return True
