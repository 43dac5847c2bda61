"""Checkpoints of a running trainer through ``torch.distributed.checkpoint`` (DCP).

Layout of one checkpoint directory (``<ckpt_dir>/step_00000040``):

* DCP files: ``model`` (parameters by layout-independent name, ``layers.3.mlp.up.weight``) and
  ``optim`` (flattened AdamW state, ``state.layers.3.mlp.up.weight.exp_avg``), written sharded by
  every rank and loadable into another layout (a different dp degree: DCP reshards);
* ``meta.json`` (rank 0): step, sampler position, the plan in force, the config it was saved with;
* ``rng/rank<N>.pt``: each rank's torch RNG state (restored when the same rank exists on load).

Writes go to ``<dir>.tmp`` and are renamed into place by rank 0 after every rank finished, so a
directory without the ``.tmp`` suffix is always complete. Assumes all ranks see one filesystem.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from agent.wire import Plan

if TYPE_CHECKING:
    from trainer.train import Trainer

_OPTS = StateDictOptions(flatten_optimizer_state_dict=True)
META = "meta.json"


def step_dir(ckpt_dir: str, step: int) -> str:
    return os.path.join(ckpt_dir, f"step_{step:08d}")


def latest_checkpoint(ckpt_dir: str) -> str | None:
    """The newest complete checkpoint directory under ``ckpt_dir`` (None when there is none)."""
    root = Path(ckpt_dir)
    if not root.is_dir():
        return None
    done = sorted(p for p in root.glob("step_*") if not p.name.endswith(".tmp") and (p / META).exists())
    return str(done[-1]) if done else None


def _state(trainer: Trainer) -> tuple[dict[str, Any], list[tuple[dict[str, Any], dict[str, Any]]]]:
    """The DCP state over this rank's stages, and the per-stage dicts it was merged from.

    Stage names are disjoint (global layer indices), so the union is the whole model's state.
    ``get_state_dict`` returns tensors that share storage with the live model (FACTS pitfall 4):
    DCP reads and writes them in place, which is what saving and loading need here.
    """
    parts = [get_state_dict(chunk, opt, options=_OPTS) for chunk, opt in zip(trainer.chunks, trainer.optimizers,
                                                                              strict=True)]
    model: dict[str, Any] = {}
    optim: dict[str, Any] = {}
    for msd, osd in parts:
        model.update(msd)
        optim.update(osd)
    return {"model": model, "optim": optim}, parts


def save_checkpoint(trainer: Trainer, path: str) -> str:
    """Save the trainer's full state to directory ``path`` (collective: every rank calls it)."""
    rank = dist.get_rank()
    tmp = f"{path}.tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(os.path.join(tmp, "rng"), exist_ok=True)
    dist.barrier()
    state, _ = _state(trainer)
    dcp.save(state, checkpoint_id=tmp)
    torch.save({"torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state() if trainer.device.type == "cuda" else None},
               os.path.join(tmp, "rng", f"rank{rank}.pt"))
    dist.barrier()
    if rank == 0:
        meta = {"step": trainer.step, "sampler": trainer.sampler.state(), "plan": json.loads(trainer.plan.encode()),
                "ckpt_id_seen": trainer._ckpt_id_seen, "world_size": dist.get_world_size(),
                "config": trainer.cfg.to_dict()}
        with open(os.path.join(tmp, META), "w") as fh:
            json.dump(meta, fh)
            fh.flush()
            os.fsync(fh.fileno())
        if os.path.exists(path):
            shutil.rmtree(path)
        os.replace(tmp, path)
    dist.barrier()
    return path


def load_checkpoint(trainer: Trainer, path: str) -> dict[str, Any]:
    """Load ``path`` into the trainer (collective). The saving layout may differ in dp degree."""
    with open(os.path.join(path, META)) as fh:
        meta: dict[str, Any] = json.load(fh)
    state, parts = _state(trainer)
    dcp.load(state, checkpoint_id=path)
    for chunk, opt, (msd, osd) in zip(trainer.chunks, trainer.optimizers, parts, strict=True):
        set_state_dict(chunk, opt, model_state_dict=msd, optim_state_dict=osd, options=_OPTS)
    rng_file = os.path.join(path, "rng", f"rank{dist.get_rank()}.pt")
    if os.path.exists(rng_file):
        rng = torch.load(rng_file, weights_only=True)  # never unpickle arbitrary objects
        torch.set_rng_state(rng["torch"])
        if rng.get("cuda") is not None and trainer.device.type == "cuda":
            torch.cuda.set_rng_state(rng["cuda"])
    trainer.step = int(meta["step"])
    trainer.sampler.load_state(meta["sampler"])
    trainer.plan = Plan.from_dict(meta["plan"])
    trainer._ckpt_id_seen = int(meta.get("ckpt_id_seen", 0))
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
