"""Controller strategies and estimators on synthetic problems with known answers (no training).

Budgets: optuna (TPE and GP) 30 windows, rl 40 windows, goodput 3 windows.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from trainguard.agent.batch_rule import gain_ratio
from trainguard.agent.config import ConfigError
from trainguard.agent.controller import ControllerConfig, Setting, Space, WindowResult
from trainguard.agent.controller.bandit import BanditStrategy
from trainguard.agent.controller.goodput import GoodputStrategy, efficiency, fit_step_time
from trainguard.agent.controller.noise import NoiseScale, noise_point
from trainguard.agent.controller.optuna_strategy import OptunaStrategy
from trainguard.agent.controller.strategy import loglog_slope

BASE = 16
SPACE = Space(base_batch=BASE, quantum=2, batch_low=2, batch_high=128, lr_low=0.125, lr_high=8.0)
BEST = Setting(2.0, 4)  # lr x2, batch base/4


def synthetic_objective(s: Setting, rng: np.random.Generator, noise: float = 0.05) -> float:
    """A smooth bowl in log space with its top at BEST, plus window-to-window noise."""
    x = math.log2(s.lr_scale / BEST.lr_scale)
    y = math.log2(s.batch / BEST.batch)
    return 1.0 - 0.3 * x * x - 0.2 * y * y + noise * float(rng.standard_normal())


def window(s: Setting, objective: float, **kw: object) -> WindowResult:
    base = dict(setting=s, start_step=0, end_step=10, seconds=1.0, samples=10 * s.batch, loss_start=2.0,
                loss_end=1.9, objective=objective, elapsed=10.0, step_s=0.1, fixed_s=0.05, per_sample_s=0.002, dp=2)
    base.update(kw)
    return WindowResult(**base)  # type: ignore[arg-type]


# --- gradient noise scale -----------------------------------------------------------------------

def _synthetic_step(rng: np.random.Generator, g: np.ndarray, sigma: np.ndarray, sizes: list[int]) -> tuple[float, list[tuple[int, float]]]:
    """Per-sample gradients G + N(0, diag(sigma^2)); each rank averages its own, the reduction
    averages all samples (what DDP/FSDP do with the trainer's sample-weighted loss)."""
    per_rank = [g + rng.standard_normal((b, g.size)) * sigma for b in sizes]
    means = [p.mean(0) for p in per_rank]
    big = np.concatenate(per_rank).mean(0)
    return float(big @ big), [(b, float(m @ m)) for b, m in zip(sizes, means, strict=True)]


@pytest.mark.parametrize("sizes", [[8, 8], [8, 8, 8, 8], [4, 12, 8]])
def test_noise_scale_matches_formula_on_synthetic_gradients(sizes: list[int]) -> None:
    rng = np.random.default_rng(1)
    d = 64
    g = rng.standard_normal(d) * 0.2
    sigma = rng.uniform(0.5, 1.5, d)
    true_g2, true_s = float(g @ g), float((sigma**2).sum())
    est = NoiseScale(ema=0.99)
    g2s, ss = [], []
    for _ in range(3000):
        big, small = _synthetic_step(rng, g, sigma, sizes)
        point = noise_point(big, small)
        assert point is not None
        g2s.append(point[0])
        ss.append(point[1])
        est.update(big, small)
    # Unbiased: the means of the one-step estimates match the true |G|^2 and tr(Sigma).
    assert np.mean(ss) == pytest.approx(true_s, rel=0.03)
    assert np.mean(g2s) == pytest.approx(true_g2, rel=0.1)
    assert est.value == pytest.approx(true_s / true_g2, rel=0.25)
    # And the smoothed estimate is far closer than a wrong model would be (10x off).
    assert 0.75 < est.value / (true_s / true_g2) < 1.33


def test_noise_point_equal_batches_is_mccandlish_formula() -> None:
    b, big_b, gs, gb = 8, 16, 3.0, 2.0
    g2, s = noise_point(gb, [(b, gs), (b, gs)])  # type: ignore[misc]
    assert g2 == pytest.approx((big_b * gb - b * gs) / (big_b - b))
    assert s == pytest.approx((gs - gb) / (1 / b - 1 / big_b))
    assert noise_point(gb, [(16, gs)]) is None  # one dp rank: no estimate


def test_loglog_slope_recovers_power_law() -> None:
    t = np.linspace(10, 20, 30)
    result = loglog_slope(list(t), list(3.0 * t**-0.4))
    assert result is not None
    assert result[0] == pytest.approx(0.4, rel=1e-6)


# --- optuna -------------------------------------------------------------------------------------

@pytest.mark.parametrize("sampler", ["tpe", "gp"])
def test_optuna_finds_known_best_within_30_windows(sampler: str) -> None:
    rng = np.random.default_rng(0)
    strat = OptunaStrategy(ControllerConfig(strategy="optuna", sampler=sampler, seed=3), SPACE, "job-a")
    current = Setting(1.0, BASE)
    for _ in range(30):
        current = strat.propose(current, None).setting
        strat.observe(window(current, synthetic_objective(current, rng)))
    best = strat.best_setting()
    assert best is not None
    assert abs(math.log2(best.lr_scale / BEST.lr_scale)) < 0.75, best
    assert abs(math.log2(best.batch / BEST.batch)) <= 1, best
    first = strat.study.trials[0].params
    assert first == {"lr_scale": 1.0, "batch_log2": 0}  # the baseline is trial 0


def test_optuna_study_survives_restart_on_journal_and_sqlite(tmp_path) -> None:  # noqa: ANN001
    for storage in (str(tmp_path / "study.log"), f"sqlite:///{tmp_path / 'study.db'}"):
        cfg = ControllerConfig(strategy="optuna", storage=storage, seed=1)
        rng = np.random.default_rng(0)
        first = OptunaStrategy(cfg, SPACE, "job-r")
        current = Setting(1.0, BASE)
        for _ in range(5):
            current = first.propose(current, None).setting
            first.observe(window(current, synthetic_objective(current, rng)))
        first.propose(current, None)  # a trial left running when the "agent" stops
        del first
        second = OptunaStrategy(cfg, SPACE, "job-r")
        states = [t.state.name for t in second.study.trials]
        assert states == ["COMPLETE"] * 5 + ["FAIL"], (storage, states)
        proposal = second.propose(current, None)
        assert proposal.inputs["trial"] == 6  # continues numbering: the same study
        assert "5 complete" in proposal.reason


# --- rl -----------------------------------------------------------------------------------------

def test_rl_bandit_walks_to_known_best_within_40_windows() -> None:
    rng = np.random.default_rng(0)
    strat = BanditStrategy(ControllerConfig(strategy="rl", seed=0), SPACE)
    current = Setting(1.0, BASE)
    visited = []
    for _ in range(40):
        current = strat.propose(current, None).setting
        visited.append(current)
        strat.observe(window(current, synthetic_objective(current, rng)))
    tail = visited[-10:]
    at_best = sum(1 for s in tail if s == BEST)
    assert at_best >= 6, tail
    # Exploration decays: the draw spread shrinks with decisions.
    assert strat.propose(current, None).inputs["exploration"] < 0.45 * strat.exploration


def test_rl_avoids_diverged_setting() -> None:
    strat = BanditStrategy(ControllerConfig(strategy="rl", seed=0), SPACE)
    start = Setting(1.0, BASE)
    for _ in range(6):
        strat.observe(window(start, 0.5))
        strat.observe(window(Setting(2.0, BASE), float("nan"), diverged=True))
    mean, _ = strat.posterior()
    from trainguard.agent.controller.bandit import features
    assert features(1.0, 0.0) @ mean < features(0.0, 0.0) @ mean


# --- goodput ------------------------------------------------------------------------------------

def test_goodput_picks_batch_maximising_throughput_times_efficiency() -> None:
    # goodput(B) = B / (a + k B) * (Bn + B0) / (Bn + B) peaks at B* = sqrt(a Bn / k), k = c / dp.
    a, c, dp, bn = 0.2, 0.004, 2, 64.0
    b_star = math.sqrt(a * bn / (c / dp))  # 80

    def measured(s: Setting) -> WindowResult:  # what the ranks' telemetry would show at batch s.batch
        return window(s, 0.3, fixed_s=a, step_s=a + c * s.batch / dp, per_sample_s=c, dp=dp, noise_scale=bn)

    strat = GoodputStrategy(ControllerConfig(strategy="goodput", gain_threshold=0.05), SPACE)
    current = Setting(1.0, BASE)
    for _ in range(3):
        last = measured(current)
        strat.observe(last)
        current = strat.propose(current, last).setting
    assert abs(math.log2(current.batch / b_star)) <= 0.5, (current, b_star)
    assert current.batch == 64
    # LR by the AdaScale gain ratio from the same noise scale (1 at the base batch).
    assert current.lr_scale == pytest.approx(gain_ratio(64, BASE, bn))
    # Two batch sizes measured: the step-time model is the fit, which recovers a and c / dp.
    alpha, beta = fit_step_time(strat.step_times)  # type: ignore[misc]
    assert alpha == pytest.approx(a) and beta == pytest.approx(c / dp)
    # Settled: no further change when the best candidate is the current batch.
    again = strat.propose(current, measured(current))
    assert again.setting == current and "keep" in again.reason


def test_goodput_threshold_and_missing_noise() -> None:
    strat = GoodputStrategy(ControllerConfig(strategy="goodput", gain_threshold=10.0), SPACE)
    current = Setting(1.0, BASE)
    assert strat.propose(current, window(current, 0.3, noise_scale=64.0)).setting == current
    assert "not estimable" in strat.propose(current, window(current, 0.3, noise_scale=None)).reason
    assert efficiency(BASE, BASE, 10.0) == 1.0 and efficiency(4 * BASE, BASE, 10.0) < 0.5


# --- config -------------------------------------------------------------------------------------

@pytest.mark.parametrize(("kwargs", "key"), [
    ({"strategy": "magic"}, "controller.strategy"),
    ({"every_steps": 1}, "controller.every_steps"),
    ({"lr_scale_min": 0}, "controller.lr_scale_min"),
    ({"lr_scale_min": 2.0, "lr_scale_max": 1.0}, "controller.lr_scale_max"),
    ({"batch_min": 64, "batch_max": 8}, "controller.batch_max"),
    ({"sampler": "cmaes"}, "controller.sampler"),
    ({"storage": "relative/study.log"}, "controller.storage"),
    ({"divergence_factor": 1.0}, "controller.divergence_factor"),
    ({"lr_cut": 1.5}, "controller.lr_cut"),
])
def test_config_errors_name_the_key(kwargs: dict[str, object], key: str) -> None:
    with pytest.raises(ConfigError) as info:
        ControllerConfig(**kwargs)  # type: ignore[arg-type]
    assert str(info.value).startswith(key + ":")
