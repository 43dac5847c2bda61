"""Straggler detection and shard migration settings (the ``detection`` section).

Every field can be changed at run time through the control API (``PUT /v1/config/detection``);
``StragglerConfig.updated`` builds the new, validated value, so a bad request changes nothing.
Errors name the key (``detection.enter_score: ...``) like the rest of the agent's config.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

PREFIX = "detection."


class DetectionConfigError(ValueError):
    """A detection setting that does not fit; the message starts with the dotted key."""

    def __init__(self, key: str, why: str) -> None:
        super().__init__(f"{PREFIX}{key}: {why}")
        self.key = f"{PREFIX}{key}"


def _int(cfg: object, key: str, lo: int, hi: int) -> None:
    v = getattr(cfg, key)
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise DetectionConfigError(key, f"must be an integer in [{lo}, {hi}], got {v!r}")


def _num(cfg: object, key: str, lo: float, hi: float, *, lo_open: bool = False) -> None:
    v = getattr(cfg, key)
    ok = not isinstance(v, bool) and isinstance(v, (int, float)) and v <= hi and (v > lo if lo_open else v >= lo)
    if not ok:
        bracket = "(" if lo_open else "["
        raise DetectionConfigError(key, f"must be a number in {bracket}{lo}, {hi}], got {v!r}")


@dataclass(frozen=True)
class StragglerConfig:
    enabled: bool = True
    """Run straggler detection at all."""
    observe_only: bool = False
    """Detect, score and report (events, API, metrics) but never change a plan or exclude a rank."""
    window: int = 16
    """Steps per rank the robust statistics (median, MAD) are computed over."""
    warmup_steps: int = 10
    """Steps of a job (from its first step, and after a rank restarts) that are never judged:
    start-up, first-touch allocations and lazy initialisation make them slow on every rank."""
    enter_score: float = 0.65
    """A rank whose score (fastest rank's median compute time at the even batch / its own) is below
    this is slow."""
    leave_score: float = 0.85
    """A straggler is healthy again once its score is at or above this (> enter_score: hysteresis)."""
    enter_windows: int = 2
    """Consecutive evaluations below ``enter_score`` before a rank is declared a straggler."""
    leave_windows: int = 3
    """Consecutive evaluations at or above ``leave_score`` before a straggler is declared recovered."""
    eval_every_steps: int = 4
    """New steps (on the slowest-reporting rank of the job) between two evaluations."""
    mad_k: float = 3.0
    """Besides the score, a rank's median must exceed the fastest median by this many robust standard
    deviations (1.4826 x MAD, pooled over the job's ranks): noise alone never makes a straggler."""
    include_run_delay: bool = True
    """Also score with run delay (the lower score counts): add the time a rank's main thread waited for a CPU (run-queue delay, /proc schedstat) to its
    compute time. On CPU the trainer reports thread CPU time, which hides a rank that shares its
    core with another process or is throttled by a CPU quota; on GPU it reports wall time anyway."""
    delay_window_s: float = 10.0
    """Run delay per step is the median of the per-tick figures over this many recent seconds, so
    a burst of load from some other process on the node for a second or two does not make a
    straggler, while a rank that shares its core for good is seen within a few seconds."""
    migrate: bool = True
    """Move batch share away from stragglers (shard migration) through the job's plan."""
    min_gain: float = 0.05
    """Dead band: a new split is published only when it makes the modelled compute time of a step
    (the slowest replica's) at least this fraction shorter than the current split does."""
    rebalance_gain: float = 0.5
    """After the first migration, re-evaluations move this fraction of the way to the new target
    (damping against oscillation while speeds are re-measured)."""
    settle_steps: int = 8
    """Steps every rank must run under a newly published plan before the split is re-evaluated."""
    exclude_after_s: float = 600.0
    """A rank still a straggler this long after detection is excluded (restart without it);
    0 disables exclusion."""
    cause_min_frac: float = 0.5
    """A cause is attached when its evidence explains at least this fraction of the rank's extra
    time per step over the fastest rank (compute plus run delay); otherwise the cause is "unknown".
    Half, because on an oversubscribed node a rank that computes more also waits more for a CPU:
    that share of its run delay is a consequence, not the cause."""
    gpu_clock_drop: float = 0.85
    """GPU throttling when the rank's SM clock ratio is below this fraction of its peers' median."""

    def __post_init__(self) -> None:
        for key in ("enabled", "observe_only", "include_run_delay", "migrate"):
            if not isinstance(getattr(self, key), bool):
                raise DetectionConfigError(key, f"must be true or false, got {getattr(self, key)!r}")
        _int(self, "window", 4, 4096)
        _int(self, "warmup_steps", 0, 1 << 30)
        _int(self, "enter_windows", 1, 1000)
        _int(self, "leave_windows", 1, 1000)
        _int(self, "eval_every_steps", 1, 4096)
        _int(self, "settle_steps", 0, 1 << 20)
        _num(self, "delay_window_s", 0.0, 3600.0, lo_open=True)
        _num(self, "enter_score", 0.0, 1.0, lo_open=True)
        _num(self, "leave_score", 0.0, 1.0, lo_open=True)
        if self.leave_score <= self.enter_score:
            raise DetectionConfigError(
                "leave_score", f"{self.leave_score} must be above detection.enter_score ({self.enter_score})")
        _num(self, "mad_k", 0.0, 100.0)
        _num(self, "min_gain", 0.0, 1.0)
        _num(self, "rebalance_gain", 0.0, 1.0, lo_open=True)
        _num(self, "exclude_after_s", 0.0, 1e9)
        _num(self, "cause_min_frac", 0.0, 1.0)
        _num(self, "gpu_clock_drop", 0.0, 1.0, lo_open=True)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, body: object) -> StragglerConfig:
        return cls().updated(body)

    def updated(self, changes: object) -> StragglerConfig:
        """A new config with ``changes`` applied; unknown keys and bad values raise
        DetectionConfigError and leave this one as it is."""
        if not isinstance(changes, dict):
            raise DetectionConfigError("*", "changes must be an object")
        known = {f.name for f in dataclasses.fields(self)}
        for key in changes:
            if key not in known:
                raise DetectionConfigError(str(key), "unknown key")
        values = self.as_dict()
        for key, value in changes.items():
            # An int where a float is expected is fine (TOML/JSON "1" for 1.0); the reverse is not.
            default = values[key]
            if isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            values[key] = value
        return StragglerConfig(**values)
