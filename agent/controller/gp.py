"""A small Gaussian-process sampler for Optuna in numpy, for ``controller.sampler = "gp"``.

Optuna's own GPSampler needs torch and scipy, and the agent never imports torch. The controller's
search space is two numbers (log LR scale, batch exponent) and a few dozen trials at most, so an
exact GP in numpy is plenty: parameters mapped to [0, 1] (log scale where the distribution is),
objective standardised, squared-exponential kernel with a length scale chosen by marginal
likelihood from a short grid, and the next point is the best expected improvement among random
candidates plus perturbations of the incumbent. Integers are rounded after the search.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from optuna.distributions import BaseDistribution, FloatDistribution, IntDistribution
from optuna.samplers import BaseSampler, RandomSampler
from optuna.search_space import IntersectionSearchSpace
from optuna.study import Study, StudyDirection
from optuna.trial import FrozenTrial, TrialState

_LENGTH_SCALES = (0.1, 0.2, 0.35, 0.6, 1.0)
_NOISE = 0.1  # observation noise variance on the standardised objective: windows are noisy


def _to_unit(d: BaseDistribution, value: float) -> float:
    assert isinstance(d, (FloatDistribution, IntDistribution))
    lo, hi, v = float(d.low), float(d.high), float(value)
    if d.log:
        lo, hi, v = math.log(lo), math.log(hi), math.log(v)
    return 0.5 if hi == lo else (v - lo) / (hi - lo)


def _from_unit(d: BaseDistribution, u: float) -> float | int:
    assert isinstance(d, (FloatDistribution, IntDistribution))
    lo, hi = float(d.low), float(d.high)
    if d.log:
        lo, hi = math.log(lo), math.log(hi)
    v = lo + min(1.0, max(0.0, u)) * (hi - lo)
    if d.log:
        v = math.exp(v)
    if isinstance(d, IntDistribution):
        return int(min(d.high, max(d.low, round(v))))
    return float(min(d.high, max(d.low, v)))


def _kernel(a: np.ndarray, b: np.ndarray, ls: float) -> np.ndarray:
    d2 = ((a[:, None, :] - b[None, :, :]) ** 2).sum(-1)
    return np.exp(-0.5 * d2 / ls**2)


class GaussianProcess:
    """Exact GP regression on standardised targets (zero mean, unit signal variance)."""

    def __init__(self, x: np.ndarray, y: np.ndarray, noise: float = _NOISE) -> None:
        self.x = x
        self.mean, self.std = float(y.mean()), float(y.std()) or 1.0
        self.y = (y - self.mean) / self.std
        self.noise = noise
        best: tuple[float, float] | None = None
        for ls in _LENGTH_SCALES:
            ll = self._log_likelihood(ls)
            if best is None or ll > best[0]:
                best = (ll, ls)
        assert best is not None
        self.length_scale = best[1]
        k = _kernel(x, x, self.length_scale) + noise * np.eye(len(x))
        self._chol = np.linalg.cholesky(k)
        self._alpha = np.linalg.solve(self._chol.T, np.linalg.solve(self._chol, self.y))

    def _log_likelihood(self, ls: float) -> float:
        k = _kernel(self.x, self.x, ls) + self.noise * np.eye(len(self.x))
        chol = np.linalg.cholesky(k)
        alpha = np.linalg.solve(chol.T, np.linalg.solve(chol, self.y))
        return float(-0.5 * self.y @ alpha - np.log(np.diag(chol)).sum())

    def predict(self, xs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Posterior mean and standard deviation, standardised units."""
        ks = _kernel(xs, self.x, self.length_scale)
        mu = ks @ self._alpha
        v = np.linalg.solve(self._chol, ks.T)
        var = np.maximum(1.0 - (v**2).sum(0), 1e-12)
        return mu, np.sqrt(var)


def expected_improvement(mu: np.ndarray, sigma: np.ndarray, best: float) -> np.ndarray:
    z = (mu - best) / sigma
    cdf = 0.5 * (1.0 + np.vectorize(math.erf)(z / math.sqrt(2.0)))
    pdf = np.exp(-0.5 * z**2) / math.sqrt(2 * math.pi)
    return (mu - best) * cdf + sigma * pdf


class NumpyGPSampler(BaseSampler):
    """GP + expected improvement over the numeric parameters; random for the first trials."""

    def __init__(self, seed: int | None = None, n_startup_trials: int = 4, n_candidates: int = 512) -> None:
        self._rng = np.random.default_rng(seed)
        self._random = RandomSampler(seed=seed)
        self._space = IntersectionSearchSpace()
        self.n_startup_trials = n_startup_trials
        self.n_candidates = n_candidates

    def reseed_rng(self) -> None:
        self._rng = np.random.default_rng()
        self._random.reseed_rng()

    def infer_relative_search_space(self, study: Study, trial: FrozenTrial) -> dict[str, BaseDistribution]:
        space = self._space.calculate(study)
        return {k: d for k, d in space.items() if isinstance(d, (FloatDistribution, IntDistribution)) and d.single() is False}

    def sample_relative(self, study: Study, trial: FrozenTrial, search_space: dict[str, BaseDistribution]) -> dict[str, Any]:
        if not search_space:
            return {}
        done = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
                if t.value is not None and all(k in t.params for k in search_space)]
        if len(done) < self.n_startup_trials:
            return {}
        names = sorted(search_space)
        x = np.array([[_to_unit(search_space[n], t.params[n]) for n in names] for t in done])
        sign = 1.0 if study.direction == StudyDirection.MAXIMIZE else -1.0
        y = np.array([sign * float(t.value) for t in done])  # type: ignore[arg-type]  # filtered above
        gp = GaussianProcess(x, y)
        incumbent = x[int(np.argmax(y))]
        cands = np.vstack([
            self._rng.random((self.n_candidates, len(names))),
            np.clip(incumbent + 0.1 * self._rng.standard_normal((self.n_candidates // 4, len(names))), 0, 1),
        ])
        mu, sigma = gp.predict(cands)
        ei = expected_improvement(mu, sigma, float(gp.y.max()))
        pick = cands[int(np.argmax(ei))]
        return {n: _from_unit(search_space[n], float(u)) for n, u in zip(names, pick, strict=True)}

    def sample_independent(self, study: Study, trial: FrozenTrial, param_name: str,
                           param_distribution: BaseDistribution) -> Any:
        return self._random.sample_independent(study, trial, param_name, param_distribution)

    def after_trial(self, study: Study, trial: FrozenTrial, state: TrialState, values: Sequence[float] | None) -> None:
        self._random.after_trial(study, trial, state, values)
