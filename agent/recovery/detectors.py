"""Failure detectors that work on the rank telemetry table: hang (no step progress) and loss
divergence (NaN/inf, or a spike beyond a factor of the recent median). Pure logic: they return
findings; the recovery service decides and acts."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Finding:
    kind: str  # "hang" | "loss_diverged"
    job: str
    message: str
    step: int
    evidence: dict[str, Any] = field(default_factory=dict)


@dataclass
class _Progress:
    step: int = -1
    since: float = 0.0


class HangDetector:
    """A job hangs when no rank advanced its step for max(factor x median step time, floor).

    The clock starts when the ranks start, so a job stuck before its first step is found too.
    """

    def __init__(self, factor: float, floor_s: float, startup_s: float = 180.0) -> None:
        self.factor = factor
        self.floor_s = floor_s
        self.startup_s = startup_s
        self._progress: dict[str, _Progress] = {}
        self._reported: set[tuple[str, int]] = set()
        self._first: dict[str, bool] = {}

    def reset(self, job: str, now: float) -> None:
        """A new attempt: its first step (imports, rendezvous, restore) gets the startup limit."""
        self._progress[job] = _Progress(-1, now)
        self._first[job] = True

    def forget(self, job: str) -> None:
        self._progress.pop(job, None)
        self._first.pop(job, None)

    def check(self, job: str, max_step: int, median_step_s: float | None, now: float) -> Finding | None:
        p = self._progress.setdefault(job, _Progress(-1, now))
        if max_step > p.step:
            self._first[job] = False
            p.step, p.since = max_step, now
            return None
        if self._first.get(job, False):
            limit = self.startup_s
        else:
            limit = max(self.factor * (median_step_s or 0.0), self.floor_s)
        stalled = now - p.since
        if stalled < limit or (job, p.step) in self._reported:
            return None
        self._reported.add((job, p.step))
        return Finding(
            "hang",
            job,
            f"no step progress for {stalled:.1f}s (limit {limit:.1f}s) after step {p.step}",
            p.step,
            {"stalled_s": round(stalled, 3), "limit_s": round(limit, 3), "median_step_s": median_step_s},
        )


class LossDetector:
    """Divergence: a non-finite loss, or one above ``spike_factor`` x the median of recent steps."""

    def __init__(self, spike_factor: float, window: int = 32, min_history: int = 8) -> None:
        self.spike_factor = spike_factor
        self.window = window
        self.min_history = min_history
        self._history: dict[str, list[tuple[int, float]]] = {}
        self._last_step: dict[str, int] = {}

    def forget(self, job: str) -> None:
        self._history.pop(job, None)
        self._last_step.pop(job, None)

    def observe(self, job: str, steps: list[tuple[int, float]]) -> Finding | None:
        """``steps``: (step, loss) of one rank, oldest first; only steps not seen yet are judged."""
        hist = self._history.setdefault(job, [])
        last = self._last_step.get(job, -1)
        for step, loss in steps:
            if step <= last:
                if step < last:
                    # The job went back (a restore): start the history again from here.
                    hist.clear()
                    last = step
                continue
            last = step
            self._last_step[job] = step
            if not math.isfinite(loss):
                hist.clear()
                return Finding("loss_diverged", job, f"loss is {loss} at step {step}", step, {"loss": str(loss)})
            if len(hist) >= self.min_history:
                median = statistics.median(v for _, v in hist[-self.window :])
                if median > 0 and loss > self.spike_factor * median:
                    hist.clear()
                    return Finding(
                        "loss_diverged",
                        job,
                        f"loss {loss:.4g} at step {step} is {loss / median:.1f}x the recent median {median:.4g}",
                        step,
                        {"loss": loss, "median": median, "factor": loss / median},
                    )
            hist.append((step, loss))
            del hist[: -self.window]
        return None
