"""What every strategy sees and returns: a setting (LR scale, global batch), the result of one
control window, the job's search space, and the ``Strategy`` interface (ask / tell).

The window objective is the same for every strategy: the log-log slope of the training loss
against training time, ``-d log L / d log t``, fitted by least squares over the window's steps
(t is seconds since the job's step 0). A loss curve that follows a power law in time,
L = a * t^-alpha, has the constant slope alpha at any point of the run, so a window late in
training is compared fairly with an early one, while a setting that lowers the loss faster per
second (a better LR, or a batch size with more goodput) still scores higher. It is scale-free, so
one Optuna study can be shared across jobs of different sizes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class Setting:
    lr_scale: float
    """Multiplier of the trainer's own LR schedule (plan field lr_scale)."""
    batch: int
    """Global batch in samples (the plan's batch_sizes sum to it)."""

    def describe(self) -> str:
        return f"lr x{self.lr_scale:.3g}, batch {self.batch}"


@dataclass(frozen=True)
class Space:
    """Where a job's settings may go. Batches are multiples of ``quantum`` (dp x pipeline
    microbatches) within [batch_low, batch_high]; LR scales within [lr_low, lr_high]."""

    base_batch: int
    quantum: int
    batch_low: int
    batch_high: int
    lr_low: float
    lr_high: float

    def clamp(self, s: Setting) -> Setting:
        """The nearest allowed setting (the bounds are multiples of quantum, see batch_bounds)."""
        lr = min(self.lr_high, max(self.lr_low, s.lr_scale))
        b = round(max(self.batch_low, min(self.batch_high, s.batch)) / self.quantum) * self.quantum
        return Setting(lr, min(self.batch_high, max(self.batch_low, self.quantum, b)))

    def batches(self) -> list[int]:
        """Candidate batches: the base batch times powers of two inside the bounds, snapped."""
        out = {self.clamp(Setting(1.0, self.base_batch)).batch}
        for e in range(-20, 21):
            b = self.base_batch * 2.0 ** e
            if self.batch_low <= b <= self.batch_high:
                out.add(self.clamp(Setting(1.0, round(b))).batch)
        return sorted(out)


@dataclass(frozen=True)
class WindowResult:
    """One control window: the steps a setting ran for and what they did."""

    setting: Setting
    start_step: int
    end_step: int
    seconds: float
    samples: int
    loss_start: float
    """Fitted loss at the window's first step."""
    loss_end: float
    objective: float
    """-d log(loss) / d log(t) over the window (higher is better)."""
    elapsed: float
    """Training seconds since step 0 at the window's end."""
    step_s: float
    """Median step wall time."""
    fixed_s: float
    """Median per-step time that does not grow with the batch (collectives, optimizer), rank 0."""
    per_sample_s: float
    """Median per-step time per local sample (forward/backward and data), rank 0."""
    dp: int
    noise_scale: float | None = None
    """Smoothed gradient noise scale B_simple at the window's end (samples), if estimable."""
    diverged: bool = False


@dataclass(frozen=True)
class Proposal:
    setting: Setting
    reason: str
    inputs: dict[str, Any] = field(default_factory=dict)


class Strategy(Protocol):
    """Ask for the next setting, tell how a window went. One instance per job."""

    name: str

    def propose(self, current: Setting, last: WindowResult | None) -> Proposal:
        """The setting for the next window (``current`` to keep it), with its reason."""
        ...

    def observe(self, result: WindowResult) -> None:
        """The window run under the last proposal ended (``result.diverged``: it was rolled back)."""
        ...

    def close(self) -> None: ...


def loglog_slope(times: Sequence[float], losses: Sequence[float]) -> tuple[float, float, float] | None:
    """Least-squares fit of log(loss) on log(t): (objective = -slope, fitted loss at first and last
    point). None when fewer than 2 usable points or no spread in time."""
    pts = [(math.log(t), math.log(v)) for t, v in zip(times, losses, strict=True)
           if t > 0 and math.isfinite(v) and v > 0]
    if len(pts) < 2:
        return None
    n = len(pts)
    mx = sum(p[0] for p in pts) / n
    my = sum(p[1] for p in pts) / n
    sxx = sum((p[0] - mx) ** 2 for p in pts)
    if sxx <= 0:
        return None
    slope = sum((p[0] - mx) * (p[1] - my) for p in pts) / sxx
    first, last = pts[0][0], pts[-1][0]
    return -slope, math.exp(my + slope * (first - mx)), math.exp(my + slope * (last - mx))


class KeepStrategy:
    """strategy = "none": observe and export, never change anything."""

    name = "none"

    def propose(self, current: Setting, last: WindowResult | None) -> Proposal:
        return Proposal(current, "observe only (strategy none)")

    def observe(self, result: WindowResult) -> None:
        return None

    def close(self) -> None:
        return None
