"""Hang detection from step telemetry: a job hangs when no rank advanced its step for long
enough, or never reached its first step. Pure logic: it returns findings; the recovery service
decides and acts."""

from __future__ import annotations

from dataclasses import dataclass

from trainguard.agent.detect.finding import Finding


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
