"""The dashboard's main screen: panels in tabs, the connection banner, the filter bar, the keys.

The screen owns the polling (a timer starts a thread worker that asks the data source; the worker
posts the result back as a message, so the UI never waits on an agent) and the actions (confirmed
in a dialog, sent from a worker, answered in the status line and a notification).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.message import Message
from textual.reactive import reactive
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Header, Input, Static, TabbedContent, TabPane

from trainguard.agent.api.client import ApiClientError
from trainguard.tui import model
from trainguard.tui.screens.dialogs import ConfirmDialog, HelpScreen
from trainguard.tui.source import AgentSnapshot, DataSource
from trainguard.tui.widgets.banner import ConnectionBanner, StatusLine
from trainguard.tui.widgets.controller import ControllerPanel
from trainguard.tui.widgets.events import EventsTable
from trainguard.tui.widgets.overview import OverviewPanel
from trainguard.tui.widgets.ranks import RanksTable
from trainguard.tui.widgets.tables import CheckpointPanel, GpuPanel, KernelPanel

PANELS = (
    ("overview", "overview"), ("ranks", "ranks"), ("gpus", "GPUs"), ("kernel", "kernel"),
    ("checkpoints", "checkpoints"), ("controller", "controller"), ("events", "events"),
)
FILTERABLE = ("ranks", "events")


@dataclass(frozen=True)
class Target:
    """What an action applies to: a job on an agent, and the highlighted rank of it if any."""

    agent: str
    node: str
    job: str
    rank: int | None


def polite_refusal(what: str, exc: ApiClientError) -> str:
    """One line a user can act on, for an action the agent did not carry out."""
    message = exc.message
    head, sep, rest = message.partition(": ")
    if sep and head.split(" ", 1)[0] in ("GET", "POST", "PUT", "DELETE"):
        message = rest  # drop the "POST /v1/...: " prefix: the user did not type a URL
    if exc.status == 0:
        return f"{what} not sent: {message}"
    if exc.status == 401:
        return f"{what} refused: the agent did not accept this token (check --token-file)"
    if exc.status == 403:
        return f"{what} refused: this token may only read; ask for an admin token"
    if exc.status == 501:
        return f"{what} not available on this agent: {message}"
    return f"{what} refused by the agent: {message} (HTTP {exc.status})"


class MainScreen(Screen[None]):
    """Every panel in a tab; key bindings for navigation and actions."""

    BINDINGS = [
        Binding("q", "app.quit", "quit"),
        Binding("question_mark", "help", "help"),
        *(Binding(str(i + 1), f"panel('{pid}')", title, show=False) for i, (pid, title) in enumerate(PANELS)),
        Binding("left_square_bracket", "step_panel(-1)", "prev", show=False),
        Binding("right_square_bracket", "step_panel(1)", "next", show=False),
        Binding("slash", "filter", "filter"),
        Binding("escape", "clear_filter", "clear", show=False),
        Binding("s", "sort", "sort"),
        Binding("S", "reverse_sort", "reverse", show=False),
        Binding("p", "pause", "pause"),
        Binding("r", "refresh", "refresh"),
        Binding("c", "checkpoint", "checkpoint"),
        Binding("d", "drain_rank", "drain rank"),
        Binding("n", "drain_node", "drain node"),
    ]

    paused: reactive[bool] = reactive(False, init=False)
    """Live updates stopped: no polling, the data on screen stays as it was."""

    class Polled(Message):
        """A poll of every agent finished (sent from the poll worker)."""

        def __init__(self, snapshots: list[AgentSnapshot]) -> None:
            super().__init__()
            self.snapshots = snapshots

    class ActionDone(Message):
        """An action's answer, as one line for the user."""

        def __init__(self, text: str, ok: bool) -> None:
            super().__init__()
            self.text = text
            self.ok = ok

    def __init__(self, source: DataSource, *, poll_s: float, clock: Callable[[], float],
                 clock_text: Callable[[float], str]) -> None:
        super().__init__()
        self.source = source
        self.poll_s = poll_s
        self.clock = clock
        self.clock_text = clock_text
        self.history = model.ControllerHistory()
        self.snapshots: list[AgentSnapshot] = []  # latest poll, as received
        self.polls = 0  # finished polls (tests wait on it)
        self._last_good: dict[str, AgentSnapshot] = {}
        self._polling = False
        self._filter_target = "ranks"
        self._view: tuple[list[AgentSnapshot], list[model.RankRow], float] | None = None
        self.last_action = ""

    # -- layout -------------------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        yield Header(show_clock=False)
        yield ConnectionBanner(id="banner")
        with TabbedContent(initial="ranks", id="tabs"):
            with TabPane("overview", id="overview"):
                yield OverviewPanel()
            with TabPane("ranks", id="ranks"):
                yield RanksTable(id="ranks-table")
                yield Static(id="rank-detail", classes="note")
            with TabPane("GPUs", id="gpus"):
                yield GpuPanel()
            with TabPane("kernel", id="kernel"):
                yield KernelPanel()
            with TabPane("checkpoints", id="checkpoints"):
                yield CheckpointPanel()
            with TabPane("controller", id="controller"):
                yield ControllerPanel()
            with TabPane("events", id="events"):
                yield EventsTable(self.clock_text, id="events-table")
                yield Static(id="event-detail", classes="note")
        yield Input(placeholder="filter: words every row must contain (enter: keep, esc: clear)", id="filter")
        yield StatusLine(id="status")
        yield Footer()

    def on_mount(self) -> None:
        self.title = "trainguard top"
        self.sub_title = ", ".join(self.source.agents())
        self.query_one(StatusLine).sort_label = self.ranks.sort_label()
        self.set_interval(self.poll_s, self.poll)
        self.poll()
        self.ranks.focus()

    @property
    def ranks(self) -> RanksTable:
        return self.query_one(RanksTable)

    @property
    def events_table(self) -> EventsTable:
        return self.query_one(EventsTable)

    @property
    def active_panel(self) -> str:
        return self.query_one(TabbedContent).active

    # -- polling ------------------------------------------------------------------------------------
    def poll(self) -> None:
        if self.paused or self._polling:
            return
        self._polling = True
        self._fetch()

    @work(thread=True, group="poll", exit_on_error=False)
    def _fetch(self) -> None:
        try:
            snapshots = self.source.poll()
        except Exception as exc:  # noqa: BLE001 - a broken source is a banner, not a traceback
            snapshots = [AgentSnapshot(a, error=f"{type(exc).__name__}: {exc}") for a in self.source.agents()]
        self.post_message(self.Polled(snapshots))

    @on(Polled)
    def _apply(self, message: Polled) -> None:
        self._polling = False
        self.polls += 1
        if self.paused:
            return
        try:
            self._show(message.snapshots)
        except Exception as exc:  # noqa: BLE001 - an answer of an unexpected shape: say so, keep running
            self.log.error("could not show the agents' answer", exc)  # textual devtools, not the terminal
            self._say(f"could not show the agents' answer: {type(exc).__name__}: {exc}", False)

    def _show(self, snaps: list[AgentSnapshot]) -> None:
        self.snapshots = snaps
        now = self.clock()
        for s in snaps:
            if s.up:
                self._last_good[s.agent] = s
        # Keep showing what an unreachable agent said last; the banner says it is stale.
        shown = [s if s.up else self._last_good.get(s.agent, s) for s in snaps]
        self.query_one(ConnectionBanner).show_snapshots(snaps, self.poll_s)
        status = self.query_one(StatusLine)
        status.stale = any(not s.up for s in snaps)
        status.updated = self.clock_text(now)
        several = len(snaps) > 1
        rows = model.rank_rows(shown, now)
        self.ranks.show(rows, several)
        events = self.events_table
        events.with_node = several
        for s in snaps:
            if s.up:
                events.add_events(s.agent, s.events)
        self.history.add(s for s in snaps if s.up)
        self._view = (shown, rows, now)
        self._render_panel(self.active_panel)

    def _render_panel(self, panel: str) -> None:
        try:
            self._draw_panel(panel)
        except Exception as exc:  # noqa: BLE001 - same as in _apply: one line, not a traceback
            self.log.error(f"could not draw panel {panel}", exc)
            self._say(f"could not draw the {panel} panel: {type(exc).__name__}: {exc}", False)

    def _draw_panel(self, panel: str) -> None:
        """Draw the panel the user sees; the others are drawn when their tab is opened (drawing
        all of them on every poll costs a busy machine the UI's responsiveness)."""
        if self._view is None:
            return
        shown, rows, now = self._view
        if panel == "overview":
            warnings = [e for e in self.events_table.events
                        if e.get("severity") in ("warning", "error", "critical")][-3:]
            self.query_one(OverviewPanel).show(shown, rows, now, warnings)
        elif panel == "gpus":
            self.query_one(GpuPanel).show_gpus(model.gpu_rows(shown),
                                               self._why_none(shown, "gpu", "gpus", "GPU readings"))
        elif panel == "kernel":
            self.query_one(KernelPanel).show_hists(model.kernel_lines(shown),
                                                   self._why_none(shown, "ebpf", "kernel", "kernel histograms"))
        elif panel == "checkpoints":
            ckpt = model.checkpoint_rows(shown, now, self.clock_text)
            self.query_one(CheckpointPanel).show_checkpoints(
                ckpt, f"{len(ckpt)} job/tier row(s)" if ckpt else "no checkpoints yet (none committed in any tier)")
        elif panel == "controller":
            self._show_controller()

    @on(TabbedContent.TabActivated)
    def _tab_opened(self, event: TabbedContent.TabActivated) -> None:
        self._render_panel(self.active_panel)

    @staticmethod
    def _why_none(snaps: Sequence[AgentSnapshot], collector: str, key: str, what: str) -> str:
        reasons = []
        for s in snaps:
            if s.status is None:
                continue
            c = (s.status.get("collectors") or {}).get(collector)
            if isinstance(c, dict) and not c.get("up"):
                reasons.append(f"{s.node}: {collector} collector off: {c.get('reason') or 'no reason given'}")
            elif key not in s.status:
                reasons.append(f"{s.node}: the agent does not report {what} yet")
        return "n/a - " + ("; ".join(reasons) if reasons else "no agent answered")

    def _show_controller(self) -> None:
        target = self._target()
        job = target.job if target else None
        plan_text = "plan n/a"
        for s in self.snapshots:
            for j in (s.status or {}).get("jobs", []):
                if j.get("job") == job and j.get("plan"):
                    p = j["plan"]
                    plan_text = (f"plan v{p.get('version')} lr x{model.fmt_float(p.get('lr_scale'), 3)}"
                                 + (f" lr={model.fmt_float(p.get('lr'), 3)}" if p.get("lr") is not None else "")
                                 + (f" batches {p.get('batch_sizes')}" if p.get("batch_sizes") else "")
                                 + (f" ({p.get('reason')})" if p.get("reason") else ""))
        self.query_one(ControllerPanel).show(self.history, job, plan_text)

    # -- messages from widgets ----------------------------------------------------------------------
    @on(RanksTable.Selected)
    def _rank_selected(self, message: RanksTable.Selected) -> None:
        self.query_one("#rank-detail", Static).update(
            message.row.detail() if message.row else "no rank matches" if self.ranks.filter_text else "no ranks")

    @on(DataTable.RowHighlighted, "#events-table")
    def _event_highlighted(self, message: DataTable.RowHighlighted) -> None:
        e = self.events_table.event_at(message.row_key.value)
        self.query_one("#event-detail", Static).update(self.events_table.detail(e) if e else "")

    @on(RanksTable.Sorted)
    def _sorted(self, message: RanksTable.Sorted) -> None:
        self.query_one(StatusLine).sort_label = message.label

    @on(Input.Changed, "#filter")
    def _filter_changed(self, event: Input.Changed) -> None:
        self._apply_filter(event.value)

    @on(Input.Submitted, "#filter")
    def _filter_done(self, event: Input.Submitted) -> None:
        self.query_one("#filter", Input).remove_class("-visible")
        self._focus_panel()

    def _apply_filter(self, query: str) -> None:
        if self._filter_target == "events":
            self.events_table.filter(query)
        else:
            self.ranks.filter(query)
        self.query_one(StatusLine).filter_text = query.strip()

    # -- actions: navigation ------------------------------------------------------------------------
    def action_help(self) -> None:
        self.app.push_screen(HelpScreen())

    def action_panel(self, panel: str) -> None:
        self.query_one(TabbedContent).active = panel
        self._focus_panel()

    def action_step_panel(self, delta: int) -> None:
        ids = [p for p, _ in PANELS]
        self.action_panel(ids[(ids.index(self.active_panel) + delta) % len(ids)])

    def _focus_panel(self) -> None:
        pane = self.query_one(f"#{self.active_panel}", TabPane)
        tables = pane.query(DataTable)
        if tables:
            tables.first().focus()
        else:
            self.query_one(TabbedContent).focus()

    def action_filter(self) -> None:
        if self.active_panel not in FILTERABLE:
            self.action_panel("ranks")
        self._filter_target = self.active_panel
        box = self.query_one("#filter", Input)
        box.value = self.events_table.filter_text if self._filter_target == "events" else self.ranks.filter_text
        box.add_class("-visible")
        box.focus()

    def action_clear_filter(self) -> None:
        box = self.query_one("#filter", Input)
        box.value = ""
        self._apply_filter("")
        box.remove_class("-visible")
        self._focus_panel()

    def action_sort(self) -> None:
        self.action_panel("ranks")
        self.ranks.cycle_sort()

    def action_reverse_sort(self) -> None:
        self.action_panel("ranks")
        self.ranks.sort_by(self.ranks.sort_key, reverse=not self.ranks.reverse)

    def action_pause(self) -> None:
        self.paused = not self.paused

    def watch_paused(self, paused: bool) -> None:
        self.query_one(StatusLine).paused = paused
        if not paused:
            self.poll()

    def action_refresh(self) -> None:
        self.poll()

    # -- actions on the cluster ---------------------------------------------------------------------
    def _target(self) -> Target | None:
        row = self.ranks.selected
        if row is not None:
            return Target(row.agent, row.node, row.job, row.rank)
        for s in self.snapshots:
            for j in (s.status or {}).get("jobs", []):
                return Target(s.agent, s.node, str(j.get("job")), None)
        return None

    def _say(self, text: str, ok: bool) -> None:
        self.last_action = text
        self.query_one(StatusLine).last_action = text
        self.notify(text, severity="information" if ok else "warning", timeout=6)

    def action_checkpoint(self) -> None:
        t = self._target()
        if t is None:
            self._say("no job to checkpoint", False)
            return
        self._confirm(f"Write a checkpoint of job [b]{t.job}[/b] on {t.node} now?", "checkpoint",
                      lambda: self.source.checkpoint_now(t.agent, t.job),
                      lambda r: f"checkpoint requested for {t.job} (id {r.get('checkpoint_id', '?')}, "
                                f"plan v{r.get('plan_version', '?')})")

    def action_drain_rank(self) -> None:
        t = self._target()
        if t is None or t.rank is None:
            self._say("highlight a rank in the ranks panel to drain it", False)
            return
        rank = t.rank
        self._confirm(f"Drain rank [b]{rank}[/b] of job [b]{t.job}[/b] on {t.node}?\n"
                      "Its data shard moves to the other ranks.", f"drain of rank {rank}",
                      lambda: self.source.drain(t.agent, t.job, rank=rank),
                      lambda r: f"rank {rank} of {t.job} drained: {r.get('message') or r}")

    def action_drain_node(self) -> None:
        t = self._target()
        if t is None:
            self._say("no job to drain", False)
            return
        self._confirm(f"Drain node [b]{t.node}[/b] from job [b]{t.job}[/b]?\n"
                      "The cluster leader restarts its ranks on other nodes from the newest checkpoint.",
                      f"drain of node {t.node}",
                      lambda: self.source.drain(t.agent, t.job, node=t.node),
                      lambda r: f"node {t.node} drained from {t.job}: {r.get('state') or r.get('message') or r}"
                                + (f", moving to {', '.join(r['moves_to'])}" if r.get("moves_to") else ""))

    def _confirm(self, question: str, what: str, call: Callable[[], dict[str, Any]],
                 ok_text: Callable[[dict[str, Any]], str]) -> None:
        def answered(yes: bool | None) -> None:
            if yes:
                self._say(f"{what}: sending…", True)
                self._send(what, call, ok_text)
            else:
                self._say(f"{what} cancelled", True)

        self.app.push_screen(ConfirmDialog(question), answered)

    @work(thread=True, group="action", exit_on_error=False)
    def _send(self, what: str, call: Callable[[], dict[str, Any]], ok_text: Callable[[dict[str, Any]], str]) -> None:
        try:
            result = call()
            message = self.ActionDone(ok_text(result if isinstance(result, dict) else {}), True)
        except ApiClientError as exc:
            message = self.ActionDone(polite_refusal(what, exc), False)
        except Exception as exc:  # noqa: BLE001 - one line for the user, never a traceback
            message = self.ActionDone(f"{what} failed: {type(exc).__name__}: {exc}", False)
        self.post_message(message)

    @on(ActionDone)
    def _action_done(self, message: ActionDone) -> None:
        self._say(message.text, message.ok)
        self.poll()
