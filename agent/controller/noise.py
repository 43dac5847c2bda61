"""Gradient noise scale B_simple (McCandlish et al. 2018, "An Empirical Model of Large-Batch
Training", appendix A) from what the ranks report each step.

For a gradient averaged over b independent samples, E|G_b|^2 = |G|^2 + S / b, with G the true
gradient and S = tr(Sigma) the per-sample gradient variance. Each dp rank reports the squared norm
of its own mean gradient before the reduction (telemetry ``local_grad_sq``, batch b_i) and every
rank the reduced one (``grad_norm``^2, batch B = sum b_i). With h = mean_i(1/b_i) and H = 1/B,
the small-batch mean m = mean_i |G_{b_i}|^2 and the big-batch norm g = |G_B|^2 satisfy
E[m] = |G|^2 + S h and E[g] = |G|^2 + S H, which gives the unbiased one-step estimates

    S_est  = (m - g) / (h - H)
    G2_est = (g h - m H) / (h - H)

(for equal b_i = b these are McCandlish's (B|G_B|^2 - b|G_b|^2)/(B - b) and
(|G_b|^2 - |G_B|^2)/(1/b - 1/B)). Each is noisy, so both are smoothed by an exponential moving
average (bias-corrected like Adam's moments) and B_simple = S_ema / G2_ema, in samples.
One dp rank (h = H) gives no estimate.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def noise_point(big_sq: float, small: Sequence[tuple[int, float]]) -> tuple[float, float] | None:
    """One step's unbiased (|G|^2, S) from the reduced norm^2 and (batch, local norm^2) per dp rank."""
    pts = [(b, sq) for b, sq in small if b > 0 and math.isfinite(sq)]
    if len(pts) < 2 or not math.isfinite(big_sq):
        return None
    big = sum(b for b, _ in pts)
    h = sum(1.0 / b for b, _ in pts) / len(pts)
    hh = 1.0 / big
    if h - hh <= 0:
        return None
    m = sum(sq for _, sq in pts) / len(pts)
    s = (m - big_sq) / (h - hh)
    g2 = (big_sq * h - m * hh) / (h - hh)
    return g2, s


class NoiseScale:
    """EMA-smoothed |G|^2 and S; ``value`` is B_simple = S / |G|^2 (None until it is positive)."""

    def __init__(self, ema: float = 0.9) -> None:
        if not 0 <= ema < 1:
            raise ValueError(f"ema must be in [0, 1), got {ema}")
        self.ema = ema
        self._g2 = 0.0
        self._s = 0.0
        self._weight = 0.0
        self.updates = 0

    def update(self, big_sq: float, small: Sequence[tuple[int, float]]) -> float | None:
        point = noise_point(big_sq, small)
        if point is not None:
            g2, s = point
            self._g2 = self.ema * self._g2 + (1 - self.ema) * g2
            self._s = self.ema * self._s + (1 - self.ema) * s
            self._weight = self.ema * self._weight + (1 - self.ema)
            self.updates += 1
        return self.value

    @property
    def g2(self) -> float | None:
        return self._g2 / self._weight if self._weight > 0 else None

    @property
    def s(self) -> float | None:
        return self._s / self._weight if self._weight > 0 else None

    @property
    def value(self) -> float | None:
        g2, s = self.g2, self.s
        if g2 is None or s is None or g2 <= 0 or s <= 0:
            return None
        return s / g2
