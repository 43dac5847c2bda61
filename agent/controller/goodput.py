"""``goodput``: pick the global batch that maximises throughput x statistical efficiency, and let
the LR follow it.

* Noise scale: B_noise = B_simple from the controller's NoiseScale estimator (noise.py).
* Statistical efficiency of batch B relative to the base batch B0 (Pollux / AdaptDL, for SGD-like
  updates): E(B) = (B_noise + B0) / (B_noise + B). A step at batch B makes E(B) * B / B0 base
  steps' worth of progress; E < 1 once B grows past the noise scale.
* Throughput: step time T(B) = fixed + per_sample * B / dp, with ``fixed`` the median per-step time
  that does not grow with the batch (collectives and optimizer) and ``per_sample`` the median
  forward/backward and data time per local sample, both from rank 0's telemetry over the last
  window; throughput(B) = B / T(B) samples per second.
* goodput(B) = throughput(B) * E(B). Candidates are the base batch times powers of two inside the
  bounds; the batch changes only when goodput(best) > (1 + gain_threshold) * goodput(current).
* LR follows the batch by the square-root rule (the usual rule for Adam-type optimizers):
  lr_scale(B) = lr_ref * sqrt(B / B0), where lr_ref is the LR scale at the base batch (1.0, or what
  a rollback cut it to).
"""

from __future__ import annotations

import math

from agent.controller.config import ControllerConfig
from agent.controller.strategy import Proposal, Setting, Space, WindowResult


def efficiency(batch: float, base: float, noise: float) -> float:
    """Pollux statistical efficiency of ``batch`` relative to ``base``."""
    return (noise + base) / (noise + batch)


def step_time(batch: float, dp: int, fixed_s: float, per_sample_s: float) -> float:
    return fixed_s + per_sample_s * batch / dp


def goodput(batch: float, base: float, noise: float, dp: int, fixed_s: float, per_sample_s: float) -> float:
    t = step_time(batch, dp, fixed_s, per_sample_s)
    return batch / t * efficiency(batch, base, noise) if t > 0 else 0.0


def sqrt_rule(lr_ref: float, batch: float, base: float) -> float:
    return lr_ref * math.sqrt(batch / base)


class GoodputStrategy:
    name = "goodput"

    def __init__(self, config: ControllerConfig, space: Space) -> None:
        self.space = space
        self.threshold = config.gain_threshold
        self.lr_ref: float | None = None
        self.last_table: dict[int, float] = {}

    def observe(self, result: WindowResult) -> None:
        if result.diverged:
            # The rollback cut the LR: keep the cut relation for later batches.
            self.lr_ref = None

    def propose(self, current: Setting, last: WindowResult | None) -> Proposal:
        base = self.space.base_batch
        if self.lr_ref is None:
            self.lr_ref = current.lr_scale / math.sqrt(current.batch / base)
        if last is None or last.noise_scale is None:
            why = "no window yet" if last is None else "gradient noise scale not estimable yet (needs dp >= 2)"
            return Proposal(current, f"goodput: keep {current.describe()} ({why})")
        noise, dp = last.noise_scale, last.dp
        table = {b: goodput(b, base, noise, dp, last.fixed_s, last.per_sample_s) for b in self.space.batches()}
        table.setdefault(current.batch, goodput(current.batch, base, noise, dp, last.fixed_s, last.per_sample_s))
        self.last_table = table
        best = max(table, key=lambda b: table[b])
        gain = table[best] / table[current.batch] - 1.0 if table[current.batch] > 0 else 0.0
        inputs = {"noise_scale": noise, "fixed_s": last.fixed_s, "per_sample_s": last.per_sample_s, "dp": dp,
                  "goodput": {str(b): round(g, 3) for b, g in sorted(table.items())}, "gain": gain}
        if best == current.batch or gain <= self.threshold:
            return Proposal(current, f"goodput: keep batch {current.batch} (B_noise {noise:.1f}; best {best} "
                                     f"would gain {gain:+.1%} <= {self.threshold:.0%})", inputs)
        lr = sqrt_rule(self.lr_ref, best, base)
        target = self.space.clamp(Setting(lr, best))
        return Proposal(target, f"goodput: batch {current.batch} -> {target.batch} (B_noise {noise:.1f}, predicted "
                                f"goodput {gain:+.1%}); LR by sqrt rule x{target.lr_scale:.3g}", inputs)

    def close(self) -> None:
        return None
