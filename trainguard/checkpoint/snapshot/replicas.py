"""Snapshots of data-parallel replicas, shared out among the ranks that hold them.

In a DDP job every rank holds the same parameters and the same optimizer state for them, so a
snapshot of each rank's whole state keeps W copies of those bytes: W times the host memory and W
times the copy (on an 8-GPU node, eight device-to-host copies of the model at every snapshot, and
sixteen slots of it in /dev/shm). Instead each rank's snapshot keeps 1/W of them, contiguous runs
of the snapshot plan's tensors balanced by bytes (``holders``), and a restore reads the other
ranks' shares of the same step from their slots (``trainguard.checkpoint.snapshot.load``). Every rank
restores the same step, and the agent picks only a step whose slot every rank holds complete.

What counts as replicated (``replicated_ids``): the parameters of a ``DistributedDataParallel``
module whose process group is the whole world (less those DDP was told to ignore), and the
tensors a ``torch.optim`` optimizer keeps for those parameters. Not buffers (BatchNorm statistics
move on each rank's own batch after DDP broadcast them), not sharded tensors (DTensors), not an
optimizer of another kind (ZeroRedundancyOptimizer keeps a different part on each rank), and
nothing else of the state: those stay whole in each rank's own slot. Only within one node: a
rank restores from the slots on its own node's tmpfs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def replicated_ids(view: Mapping[str, Any]) -> set[int]:
    """``id()`` of each tensor of ``view`` (a snapshot's objects) that every rank holds alike."""
    params: set[int] = set()
    for value in view.values():
        if isinstance(value, DistributedDataParallel):
            params |= _ddp_parameters(value)
    out = set(params)
    for value in view.values():
        if not isinstance(value, torch.optim.Optimizer) or not type(value).__module__.startswith("torch.optim"):
            continue
        for group in value.param_groups:
            for param in group["params"]:
                if id(param) in params:
                    out |= {id(t) for t in value.state.get(param, {}).values() if isinstance(t, torch.Tensor)}
    return out


def _ddp_parameters(ddp: DistributedDataParallel) -> set[int]:
    group = getattr(ddp, "process_group", None)
    if group is None or not dist.is_available() or not dist.is_initialized():
        return set()
    if dist.get_world_size(group) != dist.get_world_size():
        return set()  # replicas of a sub-group (dp within tp or pp): each group holds other tensors
    ignored = set(getattr(ddp, "parameters_to_ignore", ()) or ())
    return {id(p) for name, p in ddp.module.named_parameters() if name not in ignored}


def holders(sizes: list[int | None], world: int, rank: int) -> tuple[int, ...]:
    """For each tensor, by its bytes (None: not replicated), the rank whose slot keeps it, or -1
    for this rank's own slot (``rank``'s share, and every tensor that is not replicated). Each
    rank's share is one contiguous run of the replicated tensors, the shares about equal in bytes:
    a tensor goes to the rank whose part of the bytes its middle falls in."""
    total = sum(s for s in sizes if s is not None)
    out: list[int] = []
    before = 0
    for size in sizes:
        if size is None:
            out.append(-1)
            continue
        owner = min(world - 1, (2 * before + size) * world // (2 * total)) if total else 0
        out.append(-1 if owner == rank else owner)
        before += size
    return tuple(out)
