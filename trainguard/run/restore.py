"""What a restarted rank loads: every rank's snapshot of the same step where all of them can; in a
new world across nodes, the whole checkpoint the nodes agreed on, sent to the ranks without it;
else the memory-tier checkpoint the agent picked (or, for a job the agent did not start, the newest
one).

torch is imported only here, inside the functions: the node agent imports this package."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from trainguard.run.environment import RunEnvironment

Warn = Callable[..., None]
"""``Run._warn``: ``warn(text, any_rank=False)``."""


@dataclass(frozen=True)
class Restored:
    step: int = 0
    """The step to resume at (0: nothing was restored)."""
    source: str = ""
    """"snapshot", "checkpoint" or "" (nothing)."""
    meta: dict[str, Any] = field(default_factory=dict)
    """What the snapshot or checkpoint carried besides the state (``Run.checkpoint_meta``)."""


def restore(env: RunEnvironment, state: Mapping[str, Any], warn: Warn) -> Restored:
    """Load what this attempt restores into ``state`` (in place); collective when there is
    something to restore."""
    if env.snapshot_step >= 0 and env.snapshot_dir:
        restored = _restore_snapshot(env, state, warn)
        if restored is not None:
            return restored
    if env.restore_step >= 0 and _distributed(env.world_size):
        return _restore_shared(env, state, warn)
    from_env = env.restore_path
    path = from_env if from_env and os.path.isdir(from_env) else None
    if path is None and env.memory_root and not env.launched_by_agent:
        # A job the agent did not start (torchrun's own restarts): the newest memory checkpoint.
        # Imported here, not at the top: it imports torch, which the agent never loads.
        from trainguard.checkpoint.dcpstate import newest_memory_checkpoint

        path = newest_memory_checkpoint(env.memory_root, env.job)
    if path is None:
        return Restored()
    from trainguard.checkpoint.dcpstate import load  # imports torch: not at the top (see above)

    meta = load(path, state, rank=env.rank)
    return Restored(int(meta.get("step", 0)), "checkpoint", meta)


def _restore_shared(env: RunEnvironment, state: Mapping[str, Any], warn: Warn) -> Restored:
    """A job spanning nodes in a new world: the whole checkpoint the nodes agreed on, which the
    ranks of the nodes that hold it send to the others (``trainguard.checkpoint.share``)."""
    # Imported here, not at the top: they import torch, which the agent never loads.
    from trainguard.checkpoint.dcpstate import load
    from trainguard.checkpoint.share import ShareError, share

    held = env.restore_path if env.restore_path and os.path.isdir(env.restore_path) else None
    try:
        path, done = share(held, rank=env.rank, world=env.world_size, node=env.group_rank,
                           local_rank=env.local_rank)
    except ShareError as exc:
        warn(f"the checkpoint of step {env.restore_step} could not reach every node ({exc}): "
             "training starts afresh")
        return Restored()
    if path is None:
        warn(f"no rank holds the checkpoint of step {env.restore_step}: training starts afresh")
        return Restored()
    try:
        meta = load(path, state, rank=env.rank)
    finally:
        done()
    return Restored(int(meta.get("step", 0)), "checkpoint", meta)


def _restore_snapshot(env: RunEnvironment, state: Mapping[str, Any], warn: Warn) -> Restored | None:
    # Imported here, not at the top: they import torch, which the agent never loads.
    from trainguard.checkpoint.snapshot.errors import SnapshotError
    from trainguard.checkpoint.snapshot.load import load_snapshot

    step = env.snapshot_step
    meta: dict[str, Any] = {}
    try:
        meta = load_snapshot(env.snapshot_dir, env.rank, env.world_size, step, state)
        ok = True
    except (SnapshotError, OSError) as exc:
        ok = False
        warn(f"rank {env.rank} cannot restore the snapshot of step {step}: {exc}", any_rank=True)
    if not _all_ranks_agree(ok, env.world_size):
        warn(f"not every rank could restore the snapshot of step {step}: restoring the checkpoint instead")
        return None
    return Restored(step, "snapshot", meta)


def _all_ranks_agree(ok: bool, world_size: int) -> bool:
    """True when every rank's ``ok`` is True (one all-reduce when torch.distributed is up)."""
    dist = sys.modules.get("torch.distributed")
    if world_size <= 1 or dist is None or not dist.is_available() or not dist.is_initialized():
        return ok
    torch = sys.modules["torch"]
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(int(flag.item()))


def _distributed(world_size: int) -> bool:
    dist = sys.modules.get("torch.distributed")
    return world_size > 1 and dist is not None and dist.is_available() and dist.is_initialized()
