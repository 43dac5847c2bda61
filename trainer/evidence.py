"""The rank's side of the agent's evidence controller (``controller.strategy = "evidence"``).

The agent asks through the plan's ``extra["evidence"]``: ``{"window": W, "snapshot": n, "restore": m}``.
* ``window``: the controller's window in steps. The reference parameters theta_ref are reset where
  ``(step - anchor) % W == 0`` and the trajectory cosine cos(g, -(theta - theta_ref)) is measured on
  the steps the controller reads (the second half of each window and its last step), nowhere else.
* ``snapshot`` grows: copy the model and optimizer state in memory before this step (a tentative
  move's LR change comes with the same plan); ``restore`` grows: load that copy back. Either one
  sets ``anchor`` to this step, so the window restarts where the agent's count of the trajectory does.
A restore rewinds the parameters and the optimizer, not the step count, the data stream or the LR
schedule's position: every rank applies the plan at the same step, so they stay alike.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (no collective inside a step), a plain tensor as it is."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _flat(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    return torch.cat([_local(t.detach()).reshape(-1).float() for t in tensors])


@dataclass
class EvidenceProbe:
    """Measures the trajectory cosine's three sums for this rank's shard and keeps the branch snapshot."""

    params: list[torch.nn.Parameter]
    measures: bool = True
    """False where another rank holds the same values (a DDP replica other than dp rank 0): this
    rank adds zeros to the all-reduce, so every value counts once."""
    window: int = 0
    anchor: int = 0
    seen: tuple[int, int] = (0, 0)
    ref: torch.Tensor | None = None
    snapshot: dict[str, Any] | None = None
    log: list[str] = field(default_factory=list)

    def apply(self, request: object, step: int, objects: list[Any], *, first: bool) -> str:
        """Take the plan's request at ``step`` (steps done); ``objects``: modules and optimizers
        whose ``state_dict`` the snapshot holds. ``first``: the attempt's first plan, whose requests
        were for an earlier attempt and are only noted. Returns what it did ("" for nothing)."""
        if not isinstance(request, dict):
            self.window = 0
            return ""
        window = request.get("window", 0)
        self.window = window if isinstance(window, int) and window >= 4 else 0
        snap, restore = (int(v) if isinstance(v := request.get(k, 0), int) else 0 for k in ("snapshot", "restore"))
        seen, self.seen = self.seen, (snap, restore)
        if first:
            return ""
        done = ""
        if restore > seen[1]:
            if self.snapshot is None:
                done = f"restore asked at step {step} but no snapshot is held; nothing restored"
            else:
                for obj, state in zip(objects, self.snapshot["states"], strict=True):
                    obj.load_state_dict(copy.deepcopy(state))
                done = f"restored the snapshot of step {self.snapshot['step']} at step {step}"
            self.anchor, self.ref = step, None
        elif snap > seen[0]:
            self.snapshot = {"step": step, "states": [copy.deepcopy(o.state_dict()) for o in objects]}
            self.anchor, self.ref = step, None
            done = f"snapshot taken at step {step}"
        return done

    def before_step(self, step: int) -> None:
        """``step`` steps are done: reset theta_ref where a window starts."""
        if self.window and (step - self.anchor) % self.window == 0:
            self.ref = _flat(self.params) if self.measures else None

    def reads(self, step: int) -> bool:
        """Whether the step that makes ``step`` steps done is measured (the controller reads it)."""
        if not self.window:
            return False
        offset = (step - self.anchor) % self.window
        return offset == 0 or offset > self.window // 2

    def terms(self, step: int) -> torch.Tensor | None:
        """-g.d, g.g, d.d of this rank's shard (d = theta - theta_ref) for the step that makes
        ``step`` steps done, after backward and before the optimizer; None when not measured here."""
        if not self.measures or self.ref is None or not self.reads(step):
            return None
        grads = [p.grad for p in self.params]
        if any(g is None for g in grads):
            return None
        g = _flat(g for g in grads if g is not None)
        d = _flat(self.params) - self.ref
        if g.shape != d.shape:
            return None
        return torch.stack([-torch.dot(g, d), torch.dot(g, g), torch.dot(d, d)])
