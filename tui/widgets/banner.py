"""The connection banner and the status line."""

from __future__ import annotations

from collections.abc import Sequence

from rich.text import Text
from textual.reactive import reactive
from textual.widgets import Static

from trainguard.tui.source import AgentSnapshot


class ConnectionBanner(Static):
    """Shown only while an agent does not answer: which one, why, and that the dashboard retries.
    The panels keep the last data they had (marked stale in the status line)."""

    def show_snapshots(self, snapshots: Sequence[AgentSnapshot], retry_s: float) -> None:
        down = [s for s in snapshots if not s.up]
        self.set_class(bool(down), "-down")
        if not down:
            self.update("")
            return
        text = Text()
        text.append("AGENT UNREACHABLE", style="bold")
        text.append(f" - retrying every {retry_s:g}s (r: now); showing the last data received")
        for snap in down:
            text.append(f"\n{snap.error}")
        self.update(text)


class StatusLine(Static):
    """One line under the panels: pause state, sort, filter, last update, last action's answer."""

    paused: reactive[bool] = reactive(False)
    """Whether polling is paused (the data on screen is frozen)."""
    sort_label: reactive[str] = reactive("")
    filter_text: reactive[str] = reactive("")
    updated: reactive[str] = reactive("")
    stale: reactive[bool] = reactive(False)
    """True while at least one agent is unreachable."""
    last_action: reactive[str] = reactive("")

    def render(self) -> Text:
        text = Text()
        if self.paused:
            text.append(" PAUSED ", style="reverse bold")
            text.append(" ")
        if self.stale:
            text.append("STALE ", style="bold")
        text.append(f"sort {self.sort_label}" if self.sort_label else "")
        if self.filter_text:
            text.append(f"  filter '{self.filter_text}'")
        if self.updated:
            text.append(f"  updated {self.updated}")
        if self.last_action:
            text.append(f"  | {self.last_action}")
        return text
