"""``optuna``: every control window is one trial over (LR scale, global batch).

ask() at the start of a window, tell(objective) at its end. The LR scale is log-uniform in the
bounds; the batch is the base batch times 2^k (an integer k inside the bounds), so both samplers
search in log space. TPE (multivariate) by default; ``sampler = "gp"`` uses the numpy Gaussian
process of gp.py (Optuna's own GPSampler needs torch and scipy, which the agent never imports).
Both start modelling after 4 trials. The first trial of a fresh study is the job's current setting,
so the study always holds the baseline.

Storage: "" keeps the study in memory; an RDB URL (``sqlite:///path``) or a journal file path
(``/path/study.log``, or ``journal:///path``) persists it, so a restarted agent loads the same
study and its next ask() is conditioned on every trial told before the restart. Trials this job
left running when the agent stopped are marked failed on load (their window never ended).
"""

from __future__ import annotations

import logging
import math
from typing import Any

import optuna

from trainguard.agent.controller.config import ControllerConfig
from trainguard.agent.controller.strategy import Proposal, Setting, Space, WindowResult

log = logging.getLogger(__name__)

# A diverged window is told this much below the worst objective seen so far (objectives are
# log-log slopes, order 0.1-1), so the sampler learns the region is bad without an infinite value.
_DIVERGED_MARGIN = 1.0


def open_storage(url: str) -> Any:
    """None (in memory), an RDB storage for URLs, or a journal file storage for a path."""
    if not url:
        return None
    if url.startswith("journal://"):
        url = url.removeprefix("journal://")
    elif "://" in url:
        return optuna.storages.RDBStorage(url, engine_kwargs={"connect_args": {"timeout": 30}}
                                          if url.startswith("sqlite") else {})
    from optuna.storages.journal import JournalFileBackend, JournalStorage

    return JournalStorage(JournalFileBackend(url))


def make_sampler(name: str, seed: int) -> optuna.samplers.BaseSampler:
    if name == "gp":
        from trainguard.agent.controller.gp import NumpyGPSampler

        return NumpyGPSampler(seed=seed, n_startup_trials=4)
    # Few trials fit in a run: start modelling after 4 random ones instead of TPE's default 10.
    return optuna.samplers.TPESampler(seed=seed, n_startup_trials=4, multivariate=True)


class OptunaStrategy:
    name = "optuna"

    def __init__(self, config: ControllerConfig, space: Space, job: str) -> None:
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self.space = space
        self.job = job
        self.study_name = config.study_name.replace("{job}", job)
        self.study = optuna.create_study(
            study_name=self.study_name,
            storage=open_storage(config.storage),
            sampler=make_sampler(config.sampler, config.seed),
            direction="maximize",
            load_if_exists=True,
        )
        self._fail_stale_trials()
        self._k_low, self._k_high = self._exponents()
        self._trial: optuna.trial.Trial | None = None
        self._trial_setting: Setting | None = None

    def _exponents(self) -> tuple[int, int]:
        ks = [round(math.log2(b / self.space.base_batch)) for b in self.space.batches()]
        return min(ks), max(ks)

    def _fail_stale_trials(self) -> None:
        for t in self.study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
            if t.user_attrs.get("job") == self.job:
                self.study.tell(t.number, state=optuna.trial.TrialState.FAIL)

    @property
    def completed(self) -> int:
        return len(self.study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)))

    def _distributions(self) -> dict[str, optuna.distributions.BaseDistribution]:
        return {
            "lr_scale": optuna.distributions.FloatDistribution(self.space.lr_low, self.space.lr_high, log=True),
            "batch_log2": optuna.distributions.IntDistribution(self._k_low, self._k_high),
        }

    def propose(self, current: Setting, last: WindowResult | None) -> Proposal:
        if self._trial is not None:  # a window ended without observe (rollback, restart): drop it
            self.study.tell(self._trial.number, state=optuna.trial.TrialState.FAIL)
            self._trial = None
        fresh = not self.study.get_trials(deepcopy=False)
        if fresh:
            k = round(math.log2(max(1, current.batch) / self.space.base_batch))
            self.study.enqueue_trial({"lr_scale": min(self.space.lr_high, max(self.space.lr_low, current.lr_scale)),
                                      "batch_log2": min(self._k_high, max(self._k_low, k))})
        trial = self.study.ask(self._distributions())
        trial.set_user_attr("job", self.job)
        setting = self.space.clamp(Setting(float(trial.params["lr_scale"]),
                                           round(self.space.base_batch * 2.0 ** int(trial.params["batch_log2"]))))
        self._trial, self._trial_setting = trial, setting
        best = self._best()
        reason = (f"optuna trial {trial.number} ({'baseline' if fresh else self.study.sampler.__class__.__name__}); "
                  f"{self.completed} complete" + (f", best so far {best}" if best else ""))
        return Proposal(setting, reason, {"trial": trial.number, "study": self.study_name})

    def _best(self) -> str:
        try:
            t = self.study.best_trial
        except ValueError:
            return ""
        return f"#{t.number} lr x{t.params['lr_scale']:.3g} batch 2^{t.params['batch_log2']} -> {t.value:.4g}"

    def observe(self, result: WindowResult) -> None:
        if self._trial is None:
            return
        value = result.objective
        if result.diverged or not math.isfinite(value):
            done = [t.value for t in self.study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
                    if t.value is not None]
            value = min([0.0, *done, value if math.isfinite(value) else 0.0]) - _DIVERGED_MARGIN
        self._trial.set_user_attr("window", [result.start_step, result.end_step])
        self.study.tell(self._trial.number, value)
        self._trial = None

    def best_setting(self) -> Setting | None:
        try:
            p = self.study.best_trial.params
        except ValueError:
            return None
        return self.space.clamp(Setting(float(p["lr_scale"]), round(self.space.base_batch * 2.0 ** int(p["batch_log2"]))))

    def close(self) -> None:
        if self._trial is not None:
            self.study.tell(self._trial.number, state=optuna.trial.TrialState.FAIL)
            self._trial = None
