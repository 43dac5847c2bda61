"""The evidence controller (evidence.py) on a live job: telemetry in, plans out.

The ranks apply a plan some steps after the agent publishes it (plansync), so the controller does
not count the trainer's steps directly. It counts the steps of the trajectory it controls:
* the steps a rank runs between a decision and the plan that carries it (at the old LR, or on a
  branch about to be restored) are left out;
* the plan's first step under a move or a restore is the step right after the decision's (a
  restore goes back to the move's step, as the snapshot does); the trainer restarts its windows
  there (``anchor``, trainer/evidence.py), so theta_ref is reset where the controller's windows
  start.
A move asks the ranks for an in-memory snapshot and the new LR scale in one plan; a restore asks
for the snapshot back with the old LR scale; a kept move needs no plan (the snapshot stays until
the next move replaces it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from trainguard.agent.controller.evidence import Action, EvidenceConfig, EvidenceController


@dataclass
class Pending:
    version: int
    """The plan version that carries the decision."""
    target: int
    """The controller's step count at the plan's first step (the decision's, or the move's for a restore)."""


@dataclass
class EvidenceDriver:
    """One job's evidence controller and its bookkeeping between trainer steps and plans."""

    steps: int
    config: EvidenceConfig = field(default_factory=EvidenceConfig)
    lr_scale: float = 1.0
    snapshots: int = 0
    """Snapshot requests so far (the plan's ``extra["evidence"]["snapshot"]``)."""
    restores: int = 0
    offset: int = 0
    """Trainer step - controller step on the current stretch."""
    pending: Pending | None = None

    def __post_init__(self) -> None:
        self.ctl = EvidenceController(self.steps, self.config, lr_scale=self.lr_scale)

    def request(self) -> dict[str, int]:
        """The plan's ``extra["evidence"]``."""
        return {"window": self.ctl.window, "snapshot": self.snapshots, "restore": self.restores}

    def restarted(self) -> None:
        """The ranks went back to a checkpoint (a new attempt starts its windows at step 0 and
        applies no request it finds in the plan): a fresh controller at the LR scale in force."""
        self.ctl = EvidenceController(self.steps, self.config, lr_scale=self.ctl.lr_scale)
        self.offset, self.pending = 0, None

    def ingest(self, end: int, steps: int, plan_version: int, loss: float | None,
               traj_cos: float | None) -> Action | None:
        """A telemetry part of ``steps`` steps ending at trainer step count ``end``, run under
        ``plan_version``, with their mean loss (None: none reported) and trajectory cosine. Returns
        the first decision it leads to; the rest of the part then runs before the decision's plan."""
        start = end - steps
        if self.pending is not None:
            if plan_version < self.pending.version:
                return None  # steps run before the decision's plan arrived: not on the trajectory
            self.offset = start - self.pending.target
            self.pending = None
        if loss is None:
            return None
        for trainer_step in range(start + 1, end + 1):
            step = trainer_step - self.offset
            if step <= 0:
                continue
            action = self.ctl.observe(step, loss, traj_cos if self.ctl.reads(step) else None)
            if action is not None:
                return action
        return None

    def published(self, action: Action, version: int) -> None:
        """The plan carrying ``action`` (a move or a restore) went out as ``version``."""
        self.pending = Pending(version, action.step)

    def plan_changes(self, action: Action, extra: dict[str, Any]) -> dict[str, Any] | None:
        """The plan fields for ``action`` (None: a kept move, nothing to publish)."""
        if action.kind == "keep":
            return None
        if action.kind == "move":
            self.snapshots += 1
        else:
            self.restores += 1
        return {"lr_scale": float(action.lr_scale), "extra": {**extra, "evidence": self.request()}}


def event_inputs(action: Action) -> dict[str, float | None]:
    """An action's figures for an event (non-finite ones as null)."""
    return {k: (v if math.isfinite(v) else None) for k, v in action.inputs.items()}
