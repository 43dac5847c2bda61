"""Cluster overview: agents and their collectors, jobs, and what needs attention now."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text
from textual.containers import VerticalScroll
from textual.widgets import Static

from trainguard.tui.model import RankRow, collector_summary, fmt_age, job_lines
from trainguard.tui.source import AgentSnapshot

ATTENTION_MAX = 6


def _agents_table(snapshots: Sequence[AgentSnapshot]) -> Table:
    t = Table(title="agents", title_justify="left", box=None, padding=(0, 1))
    for col in ("node", "agent", "version", "up", "collectors"):
        t.add_column(col, no_wrap=col != "collectors")
    for s in snapshots:
        if s.status is None:
            t.add_row(s.node, s.agent, "-", Text("DOWN", style="bold red"), Text(s.error or "", style="red"))
            continue
        cols = Text()
        for i, (name, up, _reason) in enumerate(collector_summary(s.status)):
            cols.append(("" if i == 0 else " ") + f"{name}:")
            cols.append("ok" if up else "OFF", style="green" if up else "bold red")
        t.add_row(s.node, s.agent, str(s.status.get("version", "?")), fmt_age(s.status.get("uptime_s")), cols)
    return t


def _jobs_table(snapshots: Sequence[AgentSnapshot], now: float, show_node: bool, wide: bool) -> Table:
    t = Table(title="jobs", title_justify="left", box=None, padding=(0, 1))
    cols = ["node"] if show_node else []
    cols += ["job", "state", "try/rst", "ranks", "step", "speed", "plan"]
    for col in cols:
        t.add_column(col, no_wrap=True, overflow="ellipsis")
    for j in job_lines(snapshots, now):
        style = {"running": "green", "failed": "bold red", "crashloop": "bold red", "restarting": "yellow"}.get(j.state, "")
        speed = j.speed if wide else j.speed.split(" st/s")[0] + (" st/s" if "st/s" in j.speed else "")
        cells: list[str | Text] = [j.node] if show_node else []
        cells += [j.job, Text(j.state, style=style), f"{j.attempt}/{j.restarts}", j.ranks, j.step, speed, j.plan]
        t.add_row(*cells)
    if not t.row_count:
        t.add_row(*(["no jobs"] + [""] * (len(cols) - 1)))
    return t


def _attention(snapshots: Sequence[AgentSnapshot], ranks: Sequence[RankRow],
               warnings: Sequence[Mapping[str, Any]]) -> RenderableType:
    lines: list[Text] = []
    for r in ranks:
        if r.straggling:
            lines.append(Text(f"! straggler {r.job} rank {r.rank} on {r.node}: score {r.score:.2f}"
                              + (f", cause {r.cause}" if r.cause else ""), style="yellow"))
        elif not r.healthy:
            lines.append(Text(f"! {r.job} rank {r.rank} on {r.node}: {r.state}", style="red"))
    for s in snapshots:
        if s.status is None:
            continue
        for name, up, reason in collector_summary(s.status):
            if not up:
                lines.append(Text(f"- {s.node}: collector {name} off: {reason or 'no reason given'}", style="dim"))
    for e in warnings:
        lines.append(Text(f"- {e.get('kind')}: {e.get('message')}", style="yellow" if e.get("severity") == "warning" else "red"))
    if not lines:
        return Text("nothing needs attention", style="green")
    more = len(lines) - ATTENTION_MAX
    shown = lines[:ATTENTION_MAX] + ([Text(f"… and {more} more", style="dim")] if more > 0 else [])
    return Group(*shown)


class OverviewPanel(VerticalScroll):
    """Agents, jobs and an attention list (stragglers, dead ranks, collectors off, recent warnings)."""

    _last: tuple[Sequence[AgentSnapshot], Sequence[RankRow], float, Sequence[Mapping[str, Any]]] | None = None
    """What ``show`` was last given (None: nothing yet), drawn again when the panel is resized."""

    def compose(self):  # noqa: ANN201 - textual's ComposeResult
        yield Static(id="ov-agents")
        yield Static(id="ov-jobs")
        yield Static(id="ov-attention")

    def show(self, snapshots: Sequence[AgentSnapshot], ranks: Sequence[RankRow], now: float,
             warnings: Sequence[Mapping[str, Any]]) -> None:
        self._last = (snapshots, ranks, now, warnings)
        self._render_all()

    def on_resize(self) -> None:
        # Hidden tabs have no width: what was drawn there is drawn again once the panel is seen.
        if self._last is not None:
            self._render_all()

    def _render_all(self) -> None:
        if self._last is None:
            return
        snapshots, ranks, now, warnings = self._last
        self.query_one("#ov-agents", Static).update(_agents_table(snapshots))
        wide = self.size.width >= 110
        self.query_one("#ov-jobs", Static).update(_jobs_table(snapshots, now, len(snapshots) > 1, wide))
        att = Table(title="attention", title_justify="left", expand=True, box=None, show_header=False)
        att.add_column("what")
        att.add_row(_attention(snapshots, ranks, warnings))
        self.query_one("#ov-attention", Static).update(att)
