"""Runs on the noisy quadratic model (nqm.py) with and without the evidence controller, and the
ROC of the candidate LR signals: the calibration that tests and bench/controller.py share.

A run's clock is the steps it executed, restored ones included (a restore costs the steps since
the snapshot); its reported figure is the true loss L(theta), the NQM's held-out loss.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from trainguard.agent.controller.evidence import Action, EvidenceConfig, EvidenceController
from trainguard.agent.controller.nqm import NQM, NQMTask

MULTIPLIERS: dict[str, float] = {"low30": 1 / 30, "low10": 1 / 10, "low3": 1 / 3, "good": 1.0,
                                 "high3": 3.0, "high10": 10.0, "high30": 30.0}
"""Starting LRs as multiples of the task's good LR, by the names the bench's RESULT keys use."""


@dataclass
class NQMRun:
    losses: list[float] = field(default_factory=list)
    """True loss after every executed step (the clock is the index + 1)."""
    actions: list[Action] = field(default_factory=list)
    final_lr_scale: float = 1.0
    final_loss: float = math.nan
    """True loss when the planned schedule ends (the trajectory's step ``steps``)."""

    def to_target(self, target: float) -> float:
        return next((i + 1.0 for i, v in enumerate(self.losses) if v <= target), math.inf)

    @property
    def moves(self) -> int:
        return sum(a.kind == "move" for a in self.actions)


def run_nqm(task: NQMTask, mult: float, seed: int, steps: int, *, control: bool,
            config: EvidenceConfig | None = None, budget: int | None = None) -> NQMRun:
    """One run from ``mult`` x the task's good LR: ``steps`` planned, ``budget`` executed at most
    (default 1.5 x steps, the schedule's floor LR after its end), controlled or not."""
    model = NQM(task, task.good_lr * mult, steps, seed)
    ctl = EvidenceController(steps, config or EvidenceConfig()) if control else None
    out = NQMRun()
    snap = None
    for _ in range(budget or int(1.5 * steps)):
        if ctl is not None and ctl.window_start(model.step_no):
            model.set_ref()
        st = model.step()
        out.losses.append(st.true_loss)
        if model.step_no == steps:
            out.final_loss = st.true_loss
        if ctl is None:
            continue
        action = ctl.observe(st.step, st.loss, st.traj_cos)
        if action is None:
            continue
        out.actions.append(action)
        if action.kind == "move":
            snap = model.snapshot()
        elif action.kind == "restore" and snap is not None:
            model.restore(snap)
        if action.kind != "move":
            snap = None
        model.lr_scale = action.lr_scale
    out.final_lr_scale = model.lr_scale
    if math.isnan(out.final_loss):
        out.final_loss = out.losses[-1]
    return out
