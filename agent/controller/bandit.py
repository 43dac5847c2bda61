"""``rl``: a contextual bandit over the moves LR x0.5 / x1 / x2 and batch x0.5 / x1 / x2.

The context is where the job stands: x = log2(LR scale), y = log2(batch / base batch). The nine
moves lead to nine neighbouring settings; the reward of a move is the objective of the window run
at the setting it leads to. The learner is Bayesian linear regression on quadratic features of
that setting, phi = (1, x, y, x^2, y^2, xy), so one fitted response surface shares what every
window taught across all moves and contexts. Each decision draws one weight vector from the
posterior (Thompson sampling) and takes the move whose destination the draw rates best.

Exploration decays over the run: the draw's covariance is the posterior's times
(exploration / (1 + decisions)^(1/4))^2, on top of the posterior narrowing by itself. Training is non-stationary (the loss landscape moves), so
older windows weigh ``forget`` per window less. Rewards are standardised over the windows seen; a
diverged window counts as a reward 3 standard deviations below the mean.
"""

from __future__ import annotations

import math

import numpy as np

from trainguard.agent.controller.config import ControllerConfig
from trainguard.agent.controller.strategy import Proposal, Setting, Space, WindowResult

MOVES: tuple[tuple[float, float], ...] = tuple((lr, b) for lr in (0.5, 1.0, 2.0) for b in (0.5, 1.0, 2.0))


# Prior: a concave bowl (reward falls off quadratically in log LR and log batch away from the
# best setting), the shape LR and batch-size sweeps show; the data move its top and its width.
PRIOR_MEAN = np.array([0.0, 0.0, 0.0, -0.5, -0.5, 0.0])
MAX_WEIGHT = 3.0


def features(x: float, y: float) -> np.ndarray:
    return np.array([1.0, x, y, x * x, y * y, x * y])


class BanditStrategy:
    name = "rl"

    def __init__(self, config: ControllerConfig, space: Space, *, prior: float = 0.2, forget: float = 0.98) -> None:
        self.space = space
        self.exploration = config.exploration
        self.forget = forget
        self.prior = prior
        self.rng = np.random.default_rng(config.seed)
        self.observations: list[tuple[float, float, float, bool]] = []  # x, y, reward, diverged
        self.decisions = 0

    def _xy(self, s: Setting) -> tuple[float, float]:
        return math.log2(s.lr_scale), math.log2(s.batch / self.space.base_batch)

    def observe(self, result: WindowResult) -> None:
        x, y = self._xy(result.setting)
        ok = math.isfinite(result.objective) and not result.diverged
        self.observations.append((x, y, result.objective if ok else 0.0, not ok))

    def posterior(self) -> tuple[np.ndarray, np.ndarray]:
        """Mean and covariance of the weights, refitted from every window with weight forget^age.

        Rewards are standardised over the finite windows; a diverged window counts as -3. The
        noise variance is the weighted residual variance of the fit (floored), so the posterior
        narrows as the surface explains the windows well.
        """
        n = len(features(0.0, 0.0))
        if not self.observations:
            return PRIOR_MEAN.copy(), np.eye(n) / self.prior
        finite = np.array([r for _, _, r, bad in self.observations if not bad])
        mu, sd = (float(finite.mean()), float(finite.std()) or 1.0) if len(finite) >= 2 else (0.0, 1.0)
        phi = np.array([features(x, y) for x, y, _, _ in self.observations])
        z = np.array([-3.0 if bad else (r - mu) / sd for _, _, r, bad in self.observations])
        w = self.forget ** np.arange(len(z))[::-1]
        # Many windows at one setting say little about its neighbours; capping a setting's total
        # weight keeps the unvisited moves uncertain enough to be tried.
        totals: dict[tuple[float, float], float] = {}
        for (x, y, _, _), wi in zip(self.observations, w, strict=True):
            totals[(x, y)] = totals.get((x, y), 0.0) + wi
        w = w * np.array([min(1.0, MAX_WEIGHT / totals[(x, y)]) for x, y, _, _ in self.observations])
        precision = self.prior * np.eye(n) + (phi * w[:, None]).T @ phi
        cov = np.linalg.inv(precision)
        mean = cov @ (self.prior * PRIOR_MEAN + (phi * w[:, None]).T @ z)
        resid = z - phi @ mean
        noise = max(0.1, float((w * resid**2).sum() / w.sum())) if len(z) > n else 1.0
        return mean, cov * noise

    def propose(self, current: Setting, last: WindowResult | None) -> Proposal:
        if not self.observations:
            return Proposal(current, "rl: the first window measures the current setting", {"move": [1.0, 1.0]})
        mean, cov = self.posterior()
        scale = self.exploration / (1.0 + self.decisions) ** 0.25
        draw = self.rng.multivariate_normal(mean, cov * scale * scale + 1e-12 * np.eye(len(mean))) if scale > 0 else mean
        options: dict[Setting, tuple[float, tuple[float, float]]] = {}
        for lr_mul, b_mul in MOVES:
            dest = self.space.clamp(Setting(current.lr_scale * lr_mul, round(current.batch * b_mul)))
            value = float(features(*self._xy(dest)) @ draw)
            if dest not in options or value > options[dest][0]:
                options[dest] = (value, (lr_mul, b_mul))
        # Ties (e.g. an untrained model) keep the current setting.
        best = max(options, key=lambda s: (options[s][0], s == current))
        value, (lr_mul, b_mul) = options[best]
        self.decisions += 1
        predicted = float(features(*self._xy(best)) @ mean)
        reason = (f"rl move lr x{lr_mul:g}, batch x{b_mul:g} (Thompson draw {value:+.3f}, posterior mean "
                  f"{predicted:+.3f}, exploration {scale:.2f}, {len(self.observations)} windows)")
        return Proposal(best, reason, {"move": [lr_mul, b_mul], "exploration": scale, "draw": value})

    def close(self) -> None:
        return None
