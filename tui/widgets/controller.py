"""The controller panel: learning rate, global batch size and loss of one job over steps, as plots,
with the plan the agent currently asks for."""

from __future__ import annotations

import math
from collections.abc import Sequence

from textual.containers import Horizontal, Vertical
from textual.widgets import Static
from textual_plotext import PlotextPlot

from trainguard.tui.model import ControllerHistory, Series, fmt_float

PLOTS = (("lr", "learning rate"), ("batch", "global batch"), ("loss", "loss (mean over ranks)"))


class ControllerPanel(Vertical):
    """Plots follow the job of the highlighted rank (or the first job)."""

    def compose(self):  # noqa: ANN201 - textual's ComposeResult
        yield Static(classes="note")
        with Horizontal(id="ctl-top"):
            yield PlotextPlot(id="plot-lr")
            yield PlotextPlot(id="plot-batch")
        yield PlotextPlot(id="plot-loss")

    def show(self, history: ControllerHistory, job: str | None, plan_text: str) -> None:
        note = self.query_one(".note", Static)
        if job is None or job not in history.jobs:
            note.update("no step telemetry yet: the plots start with the first steps a job reports")
            for key, _title in PLOTS:
                self._plot(key, f"{_title}: n/a", [], [])
            return
        series = history.jobs[job]
        note.update(f"job {job}: {plan_text}")
        for key, title in PLOTS:
            values = list(getattr(series, key))
            last = values[-1] if values else math.nan
            self._plot(key, f"{title} {fmt_float(last, 3)}", list(series.steps), values)

    def _plot(self, key: str, title: str, steps: Sequence[int], values: Sequence[float]) -> None:
        widget = self.query_one(f"#plot-{key}", PlotextPlot)
        plt = widget.plt
        plt.clear_data()
        plt.clear_figure()
        plt.title(title)
        points = [(s, v) for s, v in zip(steps, values, strict=True) if not math.isnan(v)]
        if points:
            xs, ys = zip(*points, strict=True)
            plt.plot(list(xs), list(ys), marker="braille")
            plt.xticks([float(t) for t in step_ticks(xs[0], xs[-1])])
        widget.refresh()


def step_ticks(first: int, last: int, n: int = 5) -> list[int]:
    """Whole step numbers for the x axis (plotext's own ticks are fractional)."""
    if last <= first:
        return [first]
    return sorted({round(first + (last - first) * i / (n - 1)) for i in range(n)})


def series_for(history: ControllerHistory, job: str | None) -> Series | None:
    return history.jobs.get(job) if job else None
