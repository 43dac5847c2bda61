"""The agent's plan as a rank sees it (``RunPlan``): its LR, its batch size and loss weight, whether
to checkpoint now or stop, what of the plan a script applies, and the batch sizes that keep a
restored global batch."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from trainguard.agent.wire import APPLIES_ALL, APPLIES_BATCH_SIZES, Plan, applies_mask


@dataclass(frozen=True)
class RunPlan:
    """The agent's plan as one rank sees it (every rank sees the same version at the same step)."""

    version: int = 0
    lr_scale: float = 1.0
    lr: float | None = None
    """An absolute LR that replaces the script's own (None: scale the script's by ``lr_scale``)."""
    batch_size: int | None = None
    """This rank's samples per step (None: the script's own)."""
    batch_sizes: tuple[int, ...] | None = None
    """Samples per step of every data-parallel rank (None: the script's even split)."""
    loss_weight: float = 1.0
    """Multiply the mean loss by this before ``backward()``: keeps the averaged gradient exact
    when ranks have uneven batches (dp x this rank's batch / global batch)."""
    checkpoint_now: bool = False
    stop: bool = False
    reason: str = ""

    def lr_for(self, base_lr: float) -> float:
        """The LR to use given the script's own schedule value ``base_lr``."""
        return float(self.lr) if self.lr is not None else base_lr * self.lr_scale


def plan_view(plan: Plan, *, dp_rank: int, dp_size: int, batch_size: int | None, ckpt_id_seen: int,
              kept: tuple[int, ...] | None = None, batch_lr: float = 1.0) -> RunPlan:
    """How the rank ``dp_rank`` of ``dp_size`` sees ``plan``, given its own ``batch_size``, the last
    checkpoint request it answered, the per-rank batch sizes that keep a restored global batch
    (``kept_batch``) and the LR factor of a global batch the world changed (``batch_lr``)."""
    sizes = plan.batch_sizes
    mine = batch_size
    weight = 1.0
    if sizes is not None and len(sizes) == dp_size and 0 <= dp_rank < len(sizes) and sum(sizes) > 0:
        mine = sizes[dp_rank]
        weight = dp_size * mine / sum(sizes)
    elif kept is not None:
        sizes = list(kept)  # no split for this world size: the restored global batch, kept
        mine = kept[dp_rank]
        weight = dp_size * mine / sum(kept)
    elif sizes is not None:
        sizes = None  # a split for another world size (the job shrank): the script's own
    return RunPlan(version=plan.version, lr_scale=plan.lr_scale * batch_lr, lr=plan.lr, batch_size=mine,
                   batch_sizes=tuple(sizes) if sizes is not None else None, loss_weight=weight,
                   checkpoint_now=plan.checkpoint_id > ckpt_id_seen, stop=plan.stop, reason=plan.reason)


def json_plan(plan: Plan) -> dict[str, Any]:
    body: dict[str, Any] = json.loads(plan.encode())
    return body


def default_applies(batch_size: int | None) -> int:
    """What a script that declares nothing applies: the plan's LR and stop, and its batch sizes only
    when it gave ``init`` its own batch size (it reads ``run.plan.batch_size`` then)."""
    return APPLIES_ALL if batch_size is not None else applies_mask(("lr", "stop"))


def kept_batch(global_batch: object, batch_size: int | None, dp_size: int, applies: int) -> tuple[int, ...] | None:
    """The per-rank batch sizes that keep ``global_batch`` (a restored checkpoint's) over
    ``dp_size`` ranks, as even as whole samples allow; None where the script's own batch already
    makes it, where it takes no batch sizes, or where there are fewer samples than ranks.

    >>> kept_batch(16, 8, 1, APPLIES_ALL), kept_batch(16, 8, 3, APPLIES_ALL), kept_batch(16, 8, 2, APPLIES_ALL)
    ((16,), (6, 5, 5), None)
    """
    if (not isinstance(global_batch, int) or isinstance(global_batch, bool) or not batch_size
            or not applies & APPLIES_BATCH_SIZES or global_batch == batch_size * dp_size or global_batch < dp_size):
        return None
    base, extra = divmod(global_batch, dp_size)
    return tuple(base + (1 if r < extra else 0) for r in range(dp_size))
