"""Modal screens: confirm an action, and the key help overlay."""

from __future__ import annotations

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Static

HELP = """\
[b]trainguard top[/b] - keys

  [b]1-7[/b]      panels: overview, ranks, GPUs, kernel,
           checkpoints, controller, events
  [b][ ][/b]      previous / next panel
  [b]/[/b]        filter ranks or search events (esc clears)
  [b]s S[/b]      ranks: next sort column / reverse order
  [b]p[/b]        pause / resume live updates
  [b]r[/b]        refresh now (retry an unreachable agent)
  [b]c[/b]        checkpoint the highlighted rank's job now
  [b]d[/b]        drain the highlighted rank (its shard moves)
  [b]n[/b]        drain the highlighted rank's node
  [b]?[/b]        this help        [b]q[/b]  quit

Actions are sent to the agent with your token and
confirmed first; an agent that refuses says why.
"""


class ConfirmDialog(ModalScreen[bool]):
    """Yes/no for an action that changes a running job; y/enter confirm, n/esc cancel."""

    BINDINGS = [
        Binding("y", "answer(True)", "yes"),
        Binding("n,escape", "answer(False)", "no"),
    ]

    def __init__(self, question: str) -> None:
        super().__init__()
        self.question = question

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            yield Static(self.question, id="question")
            with Horizontal(id="buttons"):
                yield Button("Yes (y)", variant="warning", id="yes")
                yield Button("No (n)", variant="primary", id="no")

    def on_mount(self) -> None:
        self.query_one("#no", Button).focus()

    def action_answer(self, yes: bool) -> None:
        self.dismiss(yes)

    @on(Button.Pressed)
    def _pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")


class HelpScreen(ModalScreen[None]):
    """The key overview; any of esc, ?, q closes it."""

    BINDINGS = [Binding("escape,question_mark,q", "close", "close")]

    def compose(self) -> ComposeResult:
        with Vertical(id="help"):
            yield Static(HELP)

    def action_close(self) -> None:
        self.dismiss(None)
