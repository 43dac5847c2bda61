"""The ``[controller]`` section of the agent config: which strategy retunes LR and batch size, how
often, and the safety bounds every strategy stays inside.

>>> ControllerConfig(strategy="goodput", every_steps=20).strategy
'goodput'
>>> ControllerConfig(lr_scale_min=2.0, lr_scale_max=1.0)
Traceback (most recent call last):
...
agent.config.ConfigError: controller.lr_scale_max: must be >= controller.lr_scale_min (2.0), got 1.0
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Literal

from trainguard.agent.batch_rule import RULES, Rule
from trainguard.agent.configerror import ConfigError

Strategy = Literal["none", "optuna", "rl", "goodput", "evidence"]
STRATEGIES = ("none", "optuna", "rl", "goodput", "evidence")
SAMPLERS = ("tpe", "gp")


@dataclass
class ControllerConfig:
    strategy: Strategy = "none"
    """none (observe only), optuna, rl, goodput or evidence (LR only, on a pre-registered test of the
    ranks' trajectory cosine, each move snapshot-protected: agent/controller/evidence.py)."""
    every_steps: int = 50
    """Control window: training steps run under one setting before the next decision."""
    warmup_steps: int = 100
    """No change before this training step (the loss moves too fast early on to judge a setting)."""
    lr_scale_min: float = 0.25
    """Lowest LR multiplier (of the trainer's own warmup+cosine schedule) the controller may set."""
    lr_scale_max: float = 4.0
    """Highest LR multiplier the controller may set (the LR guard may go above it, to ``lr_guard_max``)."""
    batch_min: int = 0
    """Smallest global batch in samples (0: the job's configured global batch / 4)."""
    batch_max: int = 0
    """Largest global batch in samples (0: the job's configured global batch x 4)."""
    seed: int = 0
    """Seed for the strategies' own randomness (samplers, Thompson draws); 0 draws one from the
    job id and its attempt (every job and restart explores differently)."""
    sampler: Literal["tpe", "gp"] = "tpe"
    """Optuna sampler: tpe (default) or gp (Gaussian process)."""
    storage: str = ""
    """Optuna storage: "" in memory; an RDB URL (sqlite:///path.db, postgresql://...); or a
    journal file path (*.log / *.journal, or journal:///path) so a study survives agent restarts."""
    study_name: str = "trainguard-{job}"
    """Optuna study name; ``{job}`` is replaced by the job id (a fixed name shares one study across jobs)."""
    divergence_factor: float = 1.5
    """Loss above this multiple of the loss before the last change (or non-finite) is divergence."""
    lr_cut: float = 0.5
    """LR multiplier applied on top of the last good setting after a rollback."""
    gain_threshold: float = 0.05
    """goodput: change the batch only when the predicted goodput gain exceeds this fraction."""
    noise_ema: float = 0.95
    """goodput: EMA factor for the |G|^2 and S estimates behind the gradient noise scale."""
    exploration: float = 1.0
    """rl: initial exploration (posterior variance inflation); it decays as 1/sqrt(decisions)."""
    lr_guard: bool = True
    """Raise an LR that is clearly too low, whatever the strategy: a window whose steps' gradients
    keep agreeing with the previous update (telemetry update_cos, trainguard.run.alignment; mean above
    lr_guard_threshold, 3 standard errors clear of 0) gets LR x2 (x4 above twice the threshold)."""
    lr_guard_threshold: float = 0.05
    """Mean ``update_cos`` over a window above which the LR guard calls the LR too low."""
    lr_guard_max: float = 16.0
    """Highest LR scale the guard may raise to (above lr_scale_max: it acts on evidence, not to
    explore); never below lr_scale_max (``guard_ceiling``)."""
    lr_batch_rule: Rule = "sqrt"
    """How the LR follows a global batch that healing changed (exclusion, node loss, rejoin), with
    any strategy, "none" included: sqrt, linear, adascale or none (batch_rule.py)."""

    planned_steps: int = 0
    """evidence: the run's planned steps, which its windows and start are fractions of (0: the
    embedded trainer's ``steps``; a job with neither is watched only)."""

    def __post_init__(self) -> None:
        self.validate("controller")

    def validate(self, key: str = "controller") -> None:
        """Raise ConfigError naming ``key.field`` for the first bad value (AgentConfig calls this)."""
        if self.strategy not in STRATEGIES:
            raise ConfigError(f"{key}.strategy", f"must be one of {', '.join(STRATEGIES)}, got {self.strategy!r}")
        if self.lr_batch_rule not in RULES:
            raise ConfigError(f"{key}.lr_batch_rule", f"must be one of {', '.join(RULES)}, got {self.lr_batch_rule!r}")
        if self.sampler not in SAMPLERS:
            raise ConfigError(f"{key}.sampler", f"must be one of {', '.join(SAMPLERS)}, got {self.sampler!r}")
        for name, low in (("every_steps", 2), ("warmup_steps", 0), ("batch_min", 0), ("batch_max", 0), ("seed", 0),
                          ("planned_steps", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"{key}.{name}", f"must be an integer >= {low}, got {value!r}")
        if not isinstance(self.lr_guard, bool):
            raise ConfigError(f"{key}.lr_guard", f"must be true or false, got {self.lr_guard!r}")
        for name in ("lr_scale_min", "lr_scale_max", "divergence_factor", "lr_cut", "noise_ema", "exploration",
                     "gain_threshold", "lr_guard_threshold", "lr_guard_max"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ConfigError(f"{key}.{name}", f"must be a finite number, got {value!r}")
        if not 0 < self.lr_scale_min <= 1e3:
            raise ConfigError(f"{key}.lr_scale_min", f"must be in (0, 1000], got {self.lr_scale_min}")
        if not self.lr_scale_min <= self.lr_scale_max <= 1e3:
            raise ConfigError(f"{key}.lr_scale_max",
                              f"must be >= {key}.lr_scale_min ({self.lr_scale_min}), got {self.lr_scale_max}")
        if self.batch_max and self.batch_min > self.batch_max:
            raise ConfigError(f"{key}.batch_max", f"must be >= {key}.batch_min ({self.batch_min}), got {self.batch_max}")
        if self.divergence_factor <= 1.0:
            raise ConfigError(f"{key}.divergence_factor", f"must be > 1, got {self.divergence_factor}")
        if not 0 < self.lr_cut < 1:
            raise ConfigError(f"{key}.lr_cut", f"must be in (0, 1), got {self.lr_cut}")
        if not 0 <= self.noise_ema < 1:
            raise ConfigError(f"{key}.noise_ema", f"must be in [0, 1), got {self.noise_ema}")
        if not 0 < self.lr_guard_threshold < 1:
            raise ConfigError(f"{key}.lr_guard_threshold", f"must be in (0, 1), got {self.lr_guard_threshold}")
        if self.exploration < 0:
            raise ConfigError(f"{key}.exploration", f"must be >= 0, got {self.exploration}")
        if self.gain_threshold < 0:
            raise ConfigError(f"{key}.gain_threshold", f"must be >= 0, got {self.gain_threshold}")
        if not isinstance(self.storage, str):
            raise ConfigError(f"{key}.storage", "must be a string")
        if self.storage and "://" not in self.storage and not os.path.isabs(self.storage):
            raise ConfigError(f"{key}.storage", f"a journal file must be an absolute path, got {self.storage!r}")
        if not isinstance(self.study_name, str) or not self.study_name.strip():
            raise ConfigError(f"{key}.study_name", "must be a non-empty string")

    @property
    def guard_ceiling(self) -> float:
        return max(self.lr_guard_max, self.lr_scale_max)

    def batch_bounds(self, base: int, dp: int) -> tuple[int, int]:
        """Global batch bounds for a job whose configured batch is ``base``, as multiples of dp."""
        low = self.batch_min or max(1, base // 4)
        high = self.batch_max or base * 4
        low = max(dp, -(-low // dp) * dp)
        high = max(low, high // dp * dp)
        return low, high
