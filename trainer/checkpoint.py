"""What a checkpoint of the embedded trainer holds, and its own checkpoint directories.

The state goes through the same code as any script's (``trainguard.checkpoint.dcpstate``):

* ``model`` / ``optim``: every local pipeline stage's parameters (``layers.3.mlp.up.weight``) and
  flattened AdamW state (``state.layers.3.mlp.up.weight.exp_avg``) by layout-independent name,
  written sharded by every rank and loadable into another layout (a different dp degree: DCP
  reshards);
* ``sampler``: the data position (epoch, cursor);
* ``meta.json`` (rank 0): the step, the plan in force; ``rng/rank<N>.pt``: each rank's RNG state.

Checkpoints into the agent's memory tier go through ``run.checkpoint``. With ``ckpt_dir`` set the
trainer also writes plain directories (``<ckpt_dir>/step_00000040``): written to ``<dir>.tmp`` and
renamed into place by rank 0 after every rank finished, so a directory without the ``.tmp`` suffix
is always complete. Assumes all ranks see one filesystem.
"""

from __future__ import annotations

import operator
import os
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from trainguard.checkpoint.dcpstate import META, load, save_dir
from trainguard.checkpoint.statedict import LearnedStateDicts

if TYPE_CHECKING:
    from trainguard.trainer.train import Trainer

_OPTS = StateDictOptions(flatten_optimizer_state_dict=True)


def step_dir(ckpt_dir: str, step: int) -> str:
    return os.path.join(ckpt_dir, f"step_{step:08d}")


def latest_checkpoint(ckpt_dir: str) -> str | None:
    """The newest complete checkpoint directory under ``ckpt_dir`` (None when there is none)."""
    root = Path(ckpt_dir)
    if not root.is_dir():
        return None
    done = sorted(p for p in root.glob("step_*") if not p.name.endswith(".tmp") and (p / META).exists())
    return str(done[-1]) if done else None


class _Stages:
    """Parameters and optimizer state of every local pipeline stage, computed once per save or load.

    Stage names are disjoint (global layer indices), so the union is the whole model's state.
    ``get_state_dict`` returns tensors that share storage with the live model:
    DCP reads and writes them in place, which is what saving and loading need here; the loaded
    dicts then go back through ``set_state_dict`` per stage once both halves arrived.
    """

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self._parts: list[tuple[dict[str, Any], dict[str, Any]]] | None = None
        self._loaded: dict[str, dict[str, Any]] = {}

    def parts(self) -> list[tuple[dict[str, Any], dict[str, Any]]]:
        if self._parts is None:
            t = self.trainer
            learned = _LEARNED.setdefault(t, LearnedStateDicts(_OPTS))
            self._parts = learned(list(zip(t.chunks, t.optimizers, strict=True)))
        return self._parts

    def merged(self, half: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for part in self.parts():
            out.update(part[half])
        return out

    def loaded(self, name: str, state_dict: dict[str, Any]) -> None:
        self._loaded[name] = state_dict
        if len(self._loaded) < 2:
            return
        t = self.trainer
        model, optim = self._loaded["model"], self._loaded["optim"]
        for chunk, opt, (msd, osd) in zip(t.chunks, t.optimizers, self.parts(), strict=True):
            set_state_dict(chunk, opt, model_state_dict={k: model[k] for k in msd},
                           optim_state_dict={k: optim[k] for k in osd}, options=_OPTS)


_LEARNED: weakref.WeakKeyDictionary[Trainer, LearnedStateDicts] = weakref.WeakKeyDictionary()
"""Each trainer's stages' state dicts, learned at its first save and kept from save to save
(``trainguard.checkpoint.statedict``: ~1.5 ms of DCP's per stage and save on every rank, ~0.15 ms built)."""


class _Half(Stateful):
    def __init__(self, stages: _Stages, name: str) -> None:
        self.stages = stages
        self.name = name

    def state_dict(self) -> dict[str, Any]:
        return self.stages.merged(0 if self.name == "model" else 1)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.stages.loaded(self.name, state_dict)


class _SamplerState(Stateful):
    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        return dict(self.trainer.sampler.state())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.trainer.sampler.load_state(dict(state_dict))


class TrainerState(dict[str, Any]):
    """The trainer's state by layout-independent name (for DCP, which reshards it), and, for the
    per-step snapshots of the same layout, as the raw stages and optimizers (``snapshot_state``:
    their own ``state_dict``s cost microseconds where DCP's ``get_state_dict`` costs milliseconds)."""

    def __init__(self, trainer: Trainer) -> None:
        stages = _Stages(trainer)
        super().__init__(model=_Half(stages, "model"), optim=_Half(stages, "optim"), sampler=_SamplerState(trainer))
        self.trainer = trainer
        self._snapshot_view: tuple[list[Any], dict[str, Any]] | None = None

    def snapshot_state(self) -> dict[str, Any]:
        """The same mapping while the trainer keeps its stages and optimizers (a snapshot reads
        it between two steps; made anew it cost ~8 us there)."""
        t = self.trainer
        objects = [*t.chunks, *t.optimizers]
        kept = self._snapshot_view
        if kept is not None and len(kept[0]) == len(objects) and all(map(operator.is_, kept[0], objects)):
            return kept[1]
        out: dict[str, Any] = {f"stage{i}": chunk for i, chunk in enumerate(t.chunks)}
        out.update({f"optim{i}": opt for i, opt in enumerate(t.optimizers)})
        out["sampler"] = self["sampler"]
        self._snapshot_view = (objects, out)
        return out


def checkpoint_state(trainer: Trainer) -> TrainerState:
    return TrainerState(trainer)


def save_checkpoint(trainer: Trainer, path: str) -> str:
    """Save the trainer's full state to directory ``path`` (collective: every rank calls it)."""
    run = trainer.run_handle
    meta = run.checkpoint_meta() if run is not None else {}
    save_dir(path, checkpoint_state(trainer), {"step": trainer.step, **meta})
    return path


def load_checkpoint(trainer: Trainer, path: str) -> dict[str, Any]:
    """Load ``path`` into the trainer (collective). The saving layout may differ in dp degree."""
    meta = load(path, checkpoint_state(trainer), rank=dist.get_rank())
    trainer.step = int(meta["step"])
    if trainer.run_handle is not None:
        trainer.run_handle.take_meta(meta)
    return meta


def load_full_model_state(path: str) -> dict[str, torch.Tensor]:
    """Every parameter of a checkpoint as full (unsharded) CPU tensors, in one process with no
    process group (for tests and tools)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    out = f"{path.rstrip('/')}.full.pt"
    dcp_to_torch_save(path, out)
    full = torch.load(out, weights_only=False)
    os.remove(out)
    return {k: v for k, v in full["model"].items()}
