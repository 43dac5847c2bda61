"""A noisy quadratic model (NQM; Zhang et al. 2019, "Which algorithmic choices matter at which
batch sizes?"): the controller's calibration task, with a known good LR and runs of milliseconds,
so tests and the bench can use many seeds.

The loss is L(theta) = 1/2 sum_i h_i theta_i^2 with curvatures h_i = 1/i. A step's minibatch loss
is 1/2 sum_i h_i (theta_i - xi_i)^2 with xi_i ~ N(0, s^2 / h_i), so its gradient h_i (theta_i -
xi_i) carries noise of covariance s^2 H, proportional to the curvature as in a real network's
gradients. Two optimizers make two tasks with different LR physics: ``adam`` (a normalised step:
too high an LR raises the noise floor without diverging, as AdamW does on the bench's GPT) and
``nesterov`` (SGD with Nesterov momentum: too high diverges along the sharpest direction). The LR
follows the trainer's shape, linear warm-up then cosine to a tenth, times the controller's scale.

``NQM.snapshot()`` / ``restore()`` copy the whole state but not the data stream, as the trainer's
memory snapshot does: a restored run sees new minibatches. Every step reports what the trainer
can report: the minibatch loss, the gradient norm, and the candidate LR-too-high/too-low signals
(update alignment, trajectory cosine, successive-gradient cosine).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

Optimizer = Literal["adam", "nesterov"]


@dataclass(frozen=True)
class NQMTask:
    optimizer: Optimizer = "adam"
    dims: int = 64
    noise: float = 0.3
    """s: the minibatch gradient noise is s^2 H."""
    warmup: float = 0.02
    """Warm-up as a fraction of the planned steps."""
    good_lr: float = 0.0
    """The base LR that reaches the target soonest (``good_lr`` measures it; 0 until set)."""

    def lr_at(self, step: int, steps: int) -> float:
        """The schedule's factor at ``step`` of a ``steps``-step run (its floor after the end)."""
        warm = max(1, int(self.warmup * steps))
        if step < warm:
            return (step + 1) / warm
        frac = min(1.0, (step - warm) / max(1, steps - warm))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac))


    @property
    def family(self) -> str:
        """The optimizer family whose evidence preset applies (evidence.PRESETS)."""
        return "adam" if self.optimizer == "adam" else "sgd"


ADAM = NQMTask("adam", good_lr=0.014)
NESTEROV = NQMTask("nesterov", good_lr=0.028)
TASKS = {"adam": ADAM, "nesterov": NESTEROV}
ADAM_CAL = NQMTask("adam", dims=32, noise=0.5, good_lr=0.014)
"""The Adam calibration task: another NQM instance (half the dimensions, more noise), on which the
adam preset is fitted at seeds ``CAL_SEEDS``, so that the bench's adam task stays a check."""
CAL_SEEDS = range(100, 112)


@dataclass(frozen=True)
class StepStats:
    step: int
    loss: float
    """The step's minibatch loss (what the trainer reports): L(theta) plus an irreducible
    1/2 dims s^2 on average, like a language model's entropy floor."""
    true_loss: float
    """L(theta) after the step: the held-out figure a bench reports."""
    grad_norm: float
    update_cos: float
    """cos(g_t, -u_{t-1}): positive when the last update was too short (trainguard.run.alignment)."""
    traj_cos: float
    """cos(g_t, -(theta_t - theta_ref)) with theta_ref the parameters at the last ``set_ref``
    (Mechanic-style): negative when the gradient points back along the way travelled."""
    grad_cos: float
    """cos(g_t, g_{t-1}): Pflug's stationarity statistic, negative once the iterate bounces."""
    lr: float
    gain: tuple[float, float] = (0.0, 0.0)
    """(predicted, actual) decrease of the step's own minibatch loss: -g.u to first order, and the
    loss re-evaluated on the same minibatch after the step (the curvature share's inputs)."""


def _cos(a: np.ndarray, b: np.ndarray) -> float:
    na, nb = float(np.dot(a, a)), float(np.dot(b, b))
    if na <= 0 or nb <= 0:
        return 0.0
    return float(np.dot(a, b)) / math.sqrt(na * nb)


class NQM:
    """One run of ``task`` at base LR ``lr`` for a planned ``steps`` (the schedule's length)."""

    def __init__(self, task: NQMTask, lr: float, steps: int, seed: int) -> None:
        self.task, self.lr, self.steps = task, lr, steps
        self.rng = np.random.default_rng(seed)
        self.h = 1.0 / np.arange(1, task.dims + 1)
        self.theta = self.rng.standard_normal(task.dims)
        self.m = np.zeros(task.dims)
        self.v = np.zeros(task.dims)
        self.step_no = 0
        self.last_update = np.zeros(task.dims)
        self.last_grad = np.zeros(task.dims)
        self.ref = self.theta.copy()
        self.lr_scale = 1.0

    def true_loss(self) -> float:
        with np.errstate(all="ignore"):
            return float(0.5 * np.dot(self.h, self.theta ** 2))

    def eval_losses(self, samples: np.ndarray) -> list[float]:
        """The loss of each row of ``samples`` (fixed draws of xi): a held-out evaluation batch."""
        with np.errstate(all="ignore"):
            return [float(v) for v in 0.5 * ((self.theta - samples) ** 2 @ self.h)]

    def eval_batch(self, n: int, seed: int) -> np.ndarray:
        """``n`` draws of xi from their own stream (not the training one)."""
        rng = np.random.default_rng(seed)
        return rng.standard_normal((n, self.task.dims)) * self.task.noise / np.sqrt(self.h)

    def set_ref(self) -> None:
        self.ref = self.theta.copy()

    def snapshot(self, data: bool = False) -> dict[str, Any]:
        """The state; with ``data`` the data stream's position too (a branch probe replays it)."""
        snap = {"theta": self.theta.copy(), "m": self.m.copy(), "v": self.v.copy(), "step": self.step_no,
                "u": self.last_update.copy(), "g": self.last_grad.copy(), "ref": self.ref.copy()}
        if data:
            snap["rng"] = copy.deepcopy(self.rng.bit_generator.state)
        return snap

    def restore(self, snap: dict[str, Any]) -> None:
        if "rng" in snap:
            self.rng.bit_generator.state = copy.deepcopy(snap["rng"])
        self.theta, self.m, self.v = snap["theta"].copy(), snap["m"].copy(), snap["v"].copy()
        self.step_no = snap["step"]
        self.last_update, self.last_grad, self.ref = snap["u"].copy(), snap["g"].copy(), snap["ref"].copy()

    def step(self) -> StepStats:
        with np.errstate(all="ignore"):  # a diverging run reports inf, it does not warn
            return self._step()

    def _step(self) -> StepStats:
        t = self.task
        xi = self.rng.standard_normal(t.dims) * t.noise / np.sqrt(self.h)
        diff = self.theta - xi
        loss = float(0.5 * np.dot(self.h, diff ** 2))
        g = self.h * diff
        lr = self.lr * self.lr_scale * t.lr_at(self.step_no, self.steps)
        update_cos = _cos(g, -self.last_update)
        traj_cos = _cos(g, -(self.theta - self.ref))
        grad_cos = _cos(g, self.last_grad)
        if t.optimizer == "adam":
            b1, b2 = 0.9, 0.99
            self.m = b1 * self.m + (1 - b1) * g
            self.v = b2 * self.v + (1 - b2) * g * g
            k = self.step_no + 1
            update = -lr * (self.m / (1 - b1 ** k)) / (np.sqrt(self.v / (1 - b2 ** k)) + 1e-8)
        else:
            mu = 0.9
            self.m = mu * self.m + g
            update = -lr * (g + mu * self.m)
        self.theta = self.theta + update
        self.last_update, self.last_grad = update, g
        self.step_no += 1
        true = self.true_loss()
        gain = (float(-np.dot(g, update)), loss - float(0.5 * np.dot(self.h, (self.theta - xi) ** 2)))
        return StepStats(self.step_no, loss if math.isfinite(loss) else math.inf, true if math.isfinite(true) else math.inf,
                         float(np.linalg.norm(g)), update_cos, traj_cos, grad_cos, lr, gain)
