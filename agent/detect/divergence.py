"""Loss divergence detection: a non-finite loss, or a spike beyond a factor of the recent median.
Pure logic: it returns findings; the recovery service rolls the job back."""

from __future__ import annotations

import math
import statistics

from trainguard.agent.detect.finding import Finding


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
