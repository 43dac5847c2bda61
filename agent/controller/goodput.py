"""``goodput``: pick the global batch that maximises throughput x statistical efficiency, and let
the LR follow it.

* Noise scale: B_noise = B_simple from the controller's NoiseScale estimator (noise.py).
* Statistical efficiency of batch B relative to the base batch B0 (Pollux / AdaptDL, for SGD-like
  updates): E(B) = (B_noise + B0) / (B_noise + B). A step at batch B makes E(B) * B / B0 base
  steps' worth of progress; E < 1 once B grows past the noise scale.
* Throughput: step time T(B) = alpha + beta * B, throughput(B) = B / T(B) samples per second.
  Once windows ran at two or more batch sizes, alpha and beta are the least-squares fit of the
  median step times measured at each batch (the newest window per batch). Before that, the split
  comes from rank 0's telemetry over the last window: alpha = the median per-step time that does
  not grow with the batch (collectives, optimizer), beta = the rest of the measured step time per
  sample of the global batch.
* goodput(B) = throughput(B) * E(B). Candidates are the base batch times powers of two inside the
  bounds. The batch moves one candidate per window toward the best one, and only when that move's
  goodput > (1 + gain_threshold) * goodput(current).
* LR follows the batch by the AdaScale gain ratio, from the same noise scale:
  lr_scale(B) = lr_ref * (1 + B_noise / B0) / (1 + B_noise / B), where lr_ref is the LR scale at
  the base batch (1.0, or what a rollback cut it to). It is AdaScale's r = (S/B0 + |G|^2) /
  (S/B + |G|^2) with S = B_noise |G|^2: linear scaling while B << B_noise, no change once
  B >> B_noise (McCandlish's optimal step size eps(B) = eps_max / (1 + B_noise / B)).
  ``sqrt_rule`` is kept for callers that want the square-root rule instead.
"""

from __future__ import annotations

import math

from trainguard.agent.batch_rule import gain_ratio
from trainguard.agent.controller.config import ControllerConfig
from trainguard.agent.controller.strategy import Proposal, Setting, Space, WindowResult


def efficiency(batch: float, base: float, noise: float) -> float:
    """Pollux statistical efficiency of ``batch`` relative to ``base``."""
    return (noise + base) / (noise + batch)


def step_time(batch: float, dp: int, fixed_s: float, per_sample_s: float) -> float:
    return fixed_s + per_sample_s * batch / dp


def goodput(batch: float, base: float, noise: float, dp: int, fixed_s: float, per_sample_s: float) -> float:
    """Samples per second times efficiency, with T(B) = fixed_s + per_sample_s * B / dp."""
    t = step_time(batch, dp, fixed_s, per_sample_s)
    return batch / t * efficiency(batch, base, noise) if t > 0 else 0.0


def fit_step_time(points: dict[int, float]) -> tuple[float, float] | None:
    """Least-squares (alpha, beta) of T(B) = alpha + beta * B over (batch, seconds); both >= 0."""
    if len(points) < 2:
        return None
    xs, ys = list(points), [points[b] for b in points]
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx <= 0:
        return None
    beta = max(1e-12, sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx)
    alpha = max(0.0, my - beta * mx)
    return alpha, beta


def sqrt_rule(lr_ref: float, batch: float, base: float) -> float:
    return lr_ref * math.sqrt(batch / base)


class GoodputStrategy:
    name = "goodput"

    def __init__(self, config: ControllerConfig, space: Space) -> None:
        self.space = space
        self.threshold = config.gain_threshold
        self.lr_ref: float | None = None
        self.last_table: dict[int, float] = {}
        self.step_times: dict[int, float] = {}

    def observe(self, result: WindowResult) -> None:
        if result.diverged:
            # The rollback cut the LR: keep the cut relation for later batches.
            self.lr_ref = None
            return
        if math.isfinite(result.step_s) and result.step_s > 0:
            self.step_times[result.setting.batch] = result.step_s

    def _time_model(self, last: WindowResult, batch: int) -> tuple[float, float, str]:
        """(alpha, beta per global sample, how it was obtained)."""
        fit = fit_step_time(self.step_times)
        if fit is not None:
            return fit[0], fit[1], f"fit over batches {sorted(self.step_times)}"
        alpha = min(last.fixed_s, last.step_s)
        beta = max(1e-12, (last.step_s - alpha) / max(1, batch))
        return alpha, beta, "telemetry split of one batch size"

    def propose(self, current: Setting, last: WindowResult | None) -> Proposal:
        base = self.space.base_batch
        if last is None or last.noise_scale is None:
            why = "no window yet" if last is None else "gradient noise scale not estimable yet (needs dp >= 2)"
            return Proposal(current, f"goodput: keep {current.describe()} ({why})")
        noise = last.noise_scale
        if self.lr_ref is None:
            self.lr_ref = current.lr_scale / gain_ratio(current.batch, base, noise)
        alpha, beta, how = self._time_model(last, current.batch)
        # goodput() takes the per-rank form; beta is per global sample, so dp = 1 here.
        table = {b: goodput(b, base, noise, 1, alpha, beta) for b in self.space.batches()}
        table.setdefault(current.batch, goodput(current.batch, base, noise, 1, alpha, beta))
        self.last_table = table
        best = max(table, key=lambda b: table[b])
        # One candidate step per window toward the best: the noise scale is a noisy, drifting
        # estimate, and a jump across the whole range on one window's reading overshoots.
        ordered = sorted(table)
        here = min(range(len(ordered)), key=lambda i: abs(ordered[i] - current.batch))
        step_to = ordered[min(here + 1, len(ordered) - 1)] if best > current.batch else ordered[max(here - 1, 0)]
        move = current.batch if best == current.batch else step_to
        gain = table[move] / table[current.batch] - 1.0 if table[current.batch] > 0 else 0.0
        inputs = {"noise_scale": noise, "step_time_alpha_s": alpha, "step_time_beta_s": beta, "time_model": how,
                  "goodput": {str(b): round(g, 3) for b, g in sorted(table.items())}, "best": best, "gain": gain}
        if move == current.batch or gain <= self.threshold:
            return Proposal(current, f"goodput: keep batch {current.batch} (B_noise {noise:.1f}; a step toward "
                                     f"best {best} would gain {gain:+.1%}, threshold {self.threshold:.0%})", inputs)
        lr = self.lr_ref * gain_ratio(move, base, noise)
        target = self.space.clamp(Setting(lr, move))
        return Proposal(target, f"goodput: batch {current.batch} -> {target.batch} toward {best} (B_noise {noise:.1f}, "
                                f"predicted goodput {gain:+.1%}); LR by AdaScale gain x{target.lr_scale:.3g}", inputs)

    def close(self) -> None:
        return None
