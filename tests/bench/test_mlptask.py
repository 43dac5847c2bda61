"""The controller bench's MLP task: parameters and gradients stay in their flat buffers through
training, a move and a restore, the curvature share it measures rises with the LR, and its fit
grid and ROC (``--fit-sgd``, ``--signals``) run in their smallest configuration."""

from __future__ import annotations

import math

import torch

from bench.mlptask import MLP_CAL, MLPLoop, MLPRun, fit_mlp, mlp_roc
from trainguard.agent.controller.evidence import Action, EvidenceConfig, EvidenceController


class Recorder(EvidenceController):
    """Records the curvature reads; one forced move and restore exercise the snapshot path."""

    def __init__(self, steps: int) -> None:
        super().__init__(steps, EvidenceConfig(min_window=8, high_curvature=0.1))
        self.gains: list[tuple[float, float]] = []

    def observe(self, step, loss, traj_cos, gain=None):  # type: ignore[no-untyped-def,override]
        if gain is not None:
            self.gains.append(gain)
        return super().observe(step, loss, traj_cos, gain)


def share(mult: float) -> float:
    torch.set_num_threads(1)
    rec = Recorder(400)
    loop = MLPLoop(MLP_CAL, MLP_CAL.good_lr * mult, 400, 100, rec, act=False, step_clock=True)
    loop.run(MLPRun(), 120, 1000)
    assert loop.flat_ok()
    assert rec.gains and all(p > 0 for p, _ in rec.gains)
    return 1 - sum(a for _, a in rec.gains) / sum(p for p, _ in rec.gains)


def test_the_curvature_share_rises_with_the_lr() -> None:
    assert share(1.0) < share(10.0)


class Scripted(EvidenceController):
    """Moves the LR up at step 10 and restores at step 20, whatever it observes."""

    said: int = 0

    def observe(self, step, loss, traj_cos, gain=None):  # type: ignore[no-untyped-def,override]
        if step == 10 * (self.said + 1) and self.said < 2:
            self.said += 1
            return Action("move", 3.0, step, "scripted", 1) if self.said == 1 else Action("restore", 1.0, 10, "scripted", 1)
        return None


def test_flat_buffers_survive_a_move_and_a_restore() -> None:
    """After the restore the run is back at step 10's parameters: its next 10 steps replay to the
    same step count, and the parameters still live in the flat buffers the reads use."""
    torch.set_num_threads(1)
    loop = MLPLoop(MLP_CAL, MLP_CAL.good_lr, 100, 0, Scripted(100), act=True, step_clock=True)
    run = loop.run(MLPRun(), 30, 1000)
    assert run.decisions == ["move@10->x3", "restore@10->x1"]
    assert run.curve[-1][1] == 20  # 30 executed, 10 of them undone
    assert loop.flat_ok()
    assert loop.theta.data_ptr() == next(loop.model.parameters()).data_ptr()


def test_the_fit_grid_and_the_roc_run_in_their_smallest_configuration() -> None:
    """Two seeds of 100-step runs in one worker: every row and cell is there and in range."""
    mult = {"good": 1.0, "high30": 30.0}
    rows = fit_mlp([EvidenceConfig(high_curvature=0.1)], ("high30",), range(100, 102), mult, jobs=1, steps=100)
    [(cfg, silent, harm, final, rescue)] = rows
    assert cfg.high_curvature == 0.1 and 0 <= silent <= 2 and set(rescue) == {"high30"}
    assert all(math.isfinite(v) and v >= 0 for v in (harm, final, rescue["high30"]))
    roc = mlp_roc(MLP_CAL, range(100, 102), mult, jobs=1, steps=100, at=(0.2,))
    assert set(roc) == {"traj_cos", "curvature"}
    assert all(0 <= roc[sig][0.2]["high30"] <= 1 for sig in roc)
