"""The evidence controller: silent unless a pre-registered test fires, and every move tentative.

It reads two figures besides the loss. One is the trajectory cosine ``cos(g_t, -(theta_t -
theta_ref))`` with theta_ref the parameters at the start of the current window (Mechanic-style).
While the LR is too low the gradient keeps pointing further along the way travelled (the mean is
clearly positive); once it is too high the iterate bounces in the noise and the gradient points
back (clearly negative). The other, on one step a window, is the curvature share: how much of
the step's first-order decrease of its own minibatch loss the curvature took back. It rises with
the LR and flags a too-high LR where the cosine stays near zero, but its value at a good LR depends
on the batch, so that test is opt-in (``high_curvature``). Thresholds are pre-registered per
optimizer family (``PRESETS``), chosen on calibration tasks and checked on the bench's
(docs/controller.md has the ROC of every candidate).

A test fires when a window's figure (the cosine's mean over its second half, where the reference
is old enough; the curvature share over its last steps) crosses a threshold for ``confirm``
windows in a row. Then, and only then:
1. a forecast of the next window's mean log-loss under the current LR is made from the last two
   windows (a local power law, log L linear in log t, with the standard error of its prediction);
2. the caller snapshots the run (``Action.snapshot``) and applies LR x ``factor`` (or / factor);
3. after one window the observed mean log-loss is compared with the forecast: more than
   ``forecast_z`` standard errors worse restores the snapshot and closes that direction for good;
   otherwise the move stands.
Windows, the first decision and the last are fractions of the planned run (``steps``), so a run of
any length gets the same number of looks. The LR scale lives in [lr_scale_min, lr_scale_max]
(1/100..100 by default): evidence moves it, not the bounds. Nothing here is random.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Literal


@dataclass(frozen=True)
class EvidenceConfig:
    window: float = 0.02
    """Window length as a fraction of the planned steps (at least ``min_window`` steps)."""
    min_window: int = 8
    start: float = 0.10
    """No decision before this fraction of the planned run (the warm-up and the first transient)."""
    low_start: float = 0.0
    """No raise before this fraction (0: ``start``). Early in an Adam run the LR that is best for the
    whole schedule is too low locally, and its trajectory cosine reads like SGD's at a 3x-low LR."""
    stop: float = 0.50
    """No new move after this fraction (the schedule's decay owns the end of the run)."""
    high_threshold: float = -0.12
    """LR too high: window mean trajectory cosine below this."""
    high_curvature: float = 0.0
    """LR too high: the window's curvature share above this (0, the default: the test is off). The
    share is 1 - actual / predicted decrease of the minibatch loss over the steps measured, the
    loss re-evaluated on the step's own minibatch after the step. It is the part of the step's first-order gain that curvature takes
    back (about 1/2 lr * the curvature along the step; 1 at the edge of stability). It is read from
    the first window on, not from ``start``: the warm-up does not confound it as it does the
    cosine, and a 30x-too-high start does its damage in the first windows. It is opt-in: the share
    at a good LR grows with the batch (less noise puts the good LR nearer the edge), so 0.1, chosen
    on a batch-64 MLP, fires at the good LR of a batch-256 one (docs/controller.md)."""
    curvature_reads: int = 1
    """Steps measured for the curvature share per window (its last ones): each costs a forward pass."""
    low_threshold: float = 0.2
    """LR too low: window mean trajectory cosine above this."""
    low_persist: float = 0.0
    """A too-low window counts toward ``confirm`` only when its mean is at least this fraction of
    the window before: evidence that fades fast is the run's early phase, not a low LR. 0 (the
    pre-registered default) turns the rule off; 1.0 trades rescue from 3x too low for silence at
    a good LR (docs/controller.md)."""
    confirm: int = 2
    """Consecutive windows a test must fire in before a move."""
    factor: float = 3.0
    forecast_z: float = 2.0
    """A move is worse when its window's mean log-loss is this many standard errors above the forecast."""
    lr_scale_min: float = 0.01
    lr_scale_max: float = 100.0

    def __post_init__(self) -> None:
        checks = [
            (0 < self.window <= 0.25, "window", "must be in (0, 0.25]"),
            (self.min_window >= 4, "min_window", "must be >= 4"),
            (0 <= self.start < self.stop <= 1, "stop", "must satisfy 0 <= start < stop <= 1"),
            (0 <= self.low_start < self.stop, "low_start", "must be in [0, stop)"),
            (self.high_threshold < 0 < self.low_threshold, "low_threshold", "must be > 0 > high_threshold"),
            (0 <= self.high_curvature < 1, "high_curvature", "must be in [0, 1) (0: off)"),
            (self.curvature_reads >= 1, "curvature_reads", "must be >= 1"),
            (self.confirm >= 1, "confirm", "must be >= 1"),
            (0 <= self.low_persist <= 1, "low_persist", "must be in [0, 1]"),
            (self.factor > 1, "factor", "must be > 1"),
            (self.forecast_z > 0, "forecast_z", "must be > 0"),
            (0 < self.lr_scale_min <= 1 <= self.lr_scale_max, "lr_scale_max", "must satisfy lr_scale_min <= 1 <= max"),
        ]
        for ok, name, msg in checks:
            if not ok:
                raise ValueError(f"evidence.{name}: {msg}")


PRESETS: dict[str, EvidenceConfig] = {
    "sgd": EvidenceConfig(),
    "adam": EvidenceConfig(low_start=0.2, high_threshold=-0.06),
}
"""Pre-registered configs by optimizer family. sgd's thresholds were chosen on the NQM's nesterov
task; adam's ``low_start`` and ``high_threshold`` on a calibration NQM (``nqm.ADAM_CAL``, its own
seeds), not on the bench's adam task (docs/controller.md). Neither turns the curvature test on."""


def preset(family: str) -> EvidenceConfig:
    """The pre-registered config for an optimizer family ("sgd", "adam")."""
    try:
        return PRESETS[family]
    except KeyError:
        raise ValueError(f"evidence: unknown optimizer family {family!r} (one of {', '.join(PRESETS)})") from None


@dataclass(frozen=True)
class Action:
    kind: Literal["move", "restore", "keep"]
    """move: snapshot, then set ``lr_scale``; restore: back to the snapshot at ``lr_scale``;
    keep: the tentative move stands (nothing to do but drop the snapshot)."""
    lr_scale: float
    step: int
    reason: str
    direction: int = 0
    """+1 up, -1 down: the move's direction (or the restored or kept one's)."""
    inputs: dict[str, float] = field(default_factory=dict)
    """The figures the decision rests on (window mean trajectory cosine, forecast, observed)."""


@dataclass
class _Trial:
    direction: int
    from_scale: float
    step: int
    forecast: float
    forecast_se: float


def curvature_share(predicted: float, actual: float) -> float | None:
    """1 - actual / predicted decrease of the minibatch loss (summed over the steps read); None
    when nothing was predicted to decrease."""
    return 1 - actual / predicted if predicted > 0 else None


def loglog_forecast(points: list[tuple[int, float]], at: list[int]) -> tuple[float, float] | None:
    """Fit log L = a + b log t to ``points`` (step, loss) and forecast the mean log-loss over the
    steps ``at``: (mean, standard error of that mean, prediction noise of its own window included)."""
    pts = [(math.log(s), math.log(v)) for s, v in points if s > 0 and v > 0 and math.isfinite(v)]
    if len(pts) < 6 or not at:
        return None
    n = len(pts)
    mx = sum(x for x, _ in pts) / n
    my = sum(y for _, y in pts) / n
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    if sxx <= 0:
        return None
    b = sum((x - mx) * (y - my) for x, y in pts) / sxx
    a = my - b * mx
    resid = math.sqrt(sum((y - a - b * x) ** 2 for x, y in pts) / (n - 2))
    xs = [math.log(s) for s in at]
    xbar = sum(xs) / len(xs)
    mean = a + b * xbar
    # The fit's error at the window's centre plus the new window's own sampling noise.
    se = resid * math.sqrt(1 / n + (xbar - mx) ** 2 / sxx + 1 / len(xs))
    return mean, se


@dataclass
class EvidenceController:
    """One run's controller: ``observe`` every step, act on what it returns."""

    steps: int
    """The planned run length (the schedule's steps)."""
    config: EvidenceConfig = field(default_factory=EvidenceConfig)
    lr_scale: float = 1.0
    closed: set[int] = field(default_factory=set)
    """Directions (+1 up, -1 down) a restored move closed."""
    log: list[Action] = field(default_factory=list)

    def __post_init__(self) -> None:
        c = self.config
        self.window = max(c.min_window, round(c.window * self.steps))
        self._start = max(2 * self.window, round(c.start * self.steps))
        self._low_start = max(self._start, round(c.low_start * self.steps))
        self._stop = round(c.stop * self.steps)
        self._points: list[tuple[int, float]] = []
        """(step, loss) under the current setting since it was last changed (the forecast's data)."""
        self._cos: list[float] = []
        self._gain = [0.0, 0.0]
        """Sums over the window's curvature reads: predicted and actual decrease of the minibatch loss."""
        self._streak = 0
        self._trial: _Trial | None = None
        self._last_mean = 0.0

    def window_start(self, step: int) -> bool:
        """True when ``step`` (the number of steps done) opens a window: the caller resets theta_ref."""
        return step % self.window == 0

    def _span(self, step: int) -> bool:
        """Whether the window that step ``step`` is in can decide or check a move."""
        return step <= self._stop + self.window

    def reads(self, step: int) -> bool:
        """Whether step ``step``'s trajectory cosine is read (the second half of its window, in a
        window that can decide on it: from the one before ``start``): a caller may skip computing
        it for the other steps."""
        offset = step % self.window
        return (offset == 0 or offset > self.window // 2) and self._start - self.window < step and self._span(step)

    def reads_curvature(self, step: int) -> bool:
        """Whether step ``step``'s curvature share is read (the last ``curvature_reads`` steps of a
        window that can decide): the caller re-evaluates that step's minibatch loss after it."""
        offset = step % self.window
        return (self.config.high_curvature > 0 and (offset == 0 or offset > self.window - self.config.curvature_reads)
                and self._span(step))

    def observe(self, step: int, loss: float, traj_cos: float | None,
                gain: tuple[float, float] | None = None) -> Action | None:
        """Step ``step`` (1-based count of steps done on the current trajectory) ended with this
        minibatch loss, trajectory cosine (None: not measured, left out of the window's mean) and
        ``gain``: (predicted, actual) decrease of that minibatch's loss by the step, predicted to
        first order (-g.u) and re-evaluated after it (None: not measured). Returns what to do now, or None."""
        self._points.append((step, loss))
        if self.reads(step) and traj_cos is not None:
            self._cos.append(traj_cos)
        if self.reads_curvature(step) and gain is not None and all(map(math.isfinite, gain)):
            self._gain[0] += gain[0]
            self._gain[1] += gain[1]
        if not math.isfinite(loss) and self._trial is not None:
            self._cos, self._gain, self._streak = [], [0.0, 0.0], 0  # the trial window's reads go with it
            return self._end_trial(step, math.inf)
        if step % self.window:
            return None
        cos, self._cos = self._cos, []
        (predicted, actual), self._gain = self._gain, [0.0, 0.0]
        mean = statistics.fmean(cos) if cos else 0.0
        curvature = curvature_share(predicted, actual)
        direction = self._direction(mean, curvature)
        if self._trial is not None:
            window = [math.log(v) if v > 0 else -math.inf for s, v in self._points if s > step - self.window]
            trial = self._trial
            action = self._end_trial(step, statistics.fmean(window))
            # A kept move whose own window still shows the same evidence counts as its first look.
            self._streak = direction if action.kind == "keep" and direction == trial.direction else 0
            return action
        # The curvature test may act before ``start``: it is not confounded by the warm-up.
        early = curvature is not None and curvature > self.config.high_curvature > 0
        if not (self._start <= step or early) or step > self._stop or direction == 0 or direction in self.closed:
            self._streak = 0
            return None
        if direction > 0 and step < self._low_start:
            self._streak = 0
            return None
        prev, self._last_mean = self._last_mean, mean
        if direction > 0 and self._streak > 0 and mean < self.config.low_persist * prev:
            self._streak = 1  # a too-low signal that is fading is the schedule's early phase, not a low LR
            return None
        self._streak = self._streak + direction if self._streak * direction > 0 else direction
        # A curvature share twice past its threshold is evidence enough in one window: a step that
        # loses half its gain to curvature does its damage within a window or two.
        strong = direction < 0 and curvature is not None and curvature > 2 * self.config.high_curvature > 0
        windows = 1 if strong else self.config.confirm
        if abs(self._streak) < windows:
            return None
        return self._move(step, direction, mean, curvature, windows)

    def _direction(self, mean: float, curvature: float | None) -> int:
        c = self.config
        if mean < c.high_threshold or (curvature is not None and curvature > c.high_curvature > 0):
            return -1
        return 1 if mean > c.low_threshold else 0

    def _move(self, step: int, direction: int, mean: float, curvature: float | None, windows: int) -> Action | None:
        c = self.config
        # Evidence twice past its threshold takes two steps of ``factor`` at once, on a direction's
        # first move only: later moves are near the good LR, where a double step overshoots.
        strength = mean / (c.low_threshold if direction > 0 else c.high_threshold)
        if direction < 0 and curvature is not None and c.high_curvature > 0:
            strength = max(strength, curvature / c.high_curvature)
        first = not any(a.kind == "move" and a.direction == direction for a in self.log)
        factor = c.factor ** (2 if strength >= 2 and first else 1)
        target = min(c.lr_scale_max, max(c.lr_scale_min, self.lr_scale * factor ** direction))
        if math.isclose(target, self.lr_scale):
            return None
        recent = [(s, v) for s, v in self._points if s > step - 2 * self.window]
        forecast = loglog_forecast(recent, list(range(step + 1, step + self.window + 1)))
        if forecast is None:
            return None
        self._trial = _Trial(direction, self.lr_scale, step, *forecast)
        self._streak = 0
        word = "low" if direction > 0 else "high"
        self.lr_scale = target
        inputs = {"traj_cos_mean": mean, "threshold": c.low_threshold if direction > 0 else c.high_threshold,
                  "factor": factor ** direction, "forecast": forecast[0], "forecast_se": forecast[1]}
        if curvature is not None:
            inputs |= {"curvature_share": curvature, "curvature_threshold": c.high_curvature}
        signal = (f"curvature share {curvature:.3f} above {c.high_curvature:g}"
                  if direction < 0 and curvature is not None and curvature > c.high_curvature and mean >= c.high_threshold
                  else f"window trajectory cosine {mean:+.3f} beyond "
                  f"{c.low_threshold if direction > 0 else c.high_threshold:+g}")
        return self._act("move", step, direction, inputs, f"LR too {word}: {signal} for {windows} "
                         f"window{'s' if windows > 1 else ''}; "
                         f"LR x{factor ** direction:.3g} tentatively, "
                         f"forecast mean log-loss {forecast[0]:.4f} +- {forecast[1]:.4f}")

    def _end_trial(self, step: int, observed: float) -> Action:
        trial = self._trial
        assert trial is not None
        self._trial = None
        z = (observed - trial.forecast) / trial.forecast_se if trial.forecast_se > 0 else math.inf
        if not z <= self.config.forecast_z:
            self.closed.add(trial.direction)
            self.lr_scale = trial.from_scale
            # Back at the snapshot's step: the points before the move still describe this setting.
            self._points = [(s, v) for s, v in self._points if s <= trial.step]
            inputs = {"observed": observed, "forecast": trial.forecast, "forecast_se": trial.forecast_se, "z": z}
            return self._act("restore", trial.step, trial.direction, inputs, f"move worse than forecast: mean log-loss {observed:.4f} vs "
                             f"{trial.forecast:.4f} +- {trial.forecast_se:.4f} (z {z:+.1f}); restored, direction "
                             f"{'up' if trial.direction > 0 else 'down'} closed")
        self._points = [(s, v) for s, v in self._points if s > trial.step]
        inputs = {"observed": observed, "forecast": trial.forecast, "forecast_se": trial.forecast_se, "z": z}
        return self._act("keep", step, trial.direction, inputs, f"move within forecast: mean log-loss {observed:.4f} vs {trial.forecast:.4f} "
                         f"+- {trial.forecast_se:.4f} (z {z:+.1f}); kept")

    def _act(self, kind: Literal["move", "restore", "keep"], step: int, direction: int, inputs: dict[str, float],
             reason: str) -> Action:
        action = Action(kind, self.lr_scale, step, reason, direction, inputs)
        self.log.append(action)
        return action

    @property
    def moves(self) -> int:
        return sum(a.kind == "move" for a in self.log)
