"""`trainguard top`: the app factory and the command's entry point.

::

    app = create_app(ApiDataSource([ApiClient.local(sock)]))   # what `trainguard top` runs
    app = create_app(FakeSource(), poll_s=3600, clock=lambda: T0, clock_text=utc)  # tests

The app is thin: it loads the stylesheet and shows :class:`~tui.screens.main.MainScreen`, which
composes the panels and owns the keys.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Callable

from textual.app import App
from textual.screen import Screen

from trainguard.agent.api.client import ApiClientError
from trainguard.agent.api.tls import context_for_cli
from trainguard.tui.screens.main import MainScreen
from trainguard.tui.source import ApiDataSource, DataSource, clients_from_args

DEFAULT_POLL_S = 1.0


def local_clock_text(ts: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(ts))


class TrainguardApp(App[int]):
    """The dashboard; everything it shows comes from ``source``."""

    CSS_PATH = "dashboard.tcss"
    TITLE = "trainguard top"

    def __init__(self, source: DataSource, *, poll_s: float, clock: Callable[[], float],
                 clock_text: Callable[[float], str]) -> None:
        super().__init__()
        self.source = source
        self.poll_s = poll_s
        self.clock = clock
        self.clock_text = clock_text

    def get_default_screen(self) -> Screen[None]:
        return MainScreen(self.source, poll_s=self.poll_s, clock=self.clock, clock_text=self.clock_text)

    @property
    def main(self) -> MainScreen:
        screen = self.screen_stack[0]
        assert isinstance(screen, MainScreen)
        return screen


def create_app(source: DataSource, *, poll_s: float = DEFAULT_POLL_S, clock: Callable[[], float] = time.time,
               clock_text: Callable[[float], str] = local_clock_text) -> TrainguardApp:
    """Build the dashboard over ``source``; ``clock``/``clock_text`` give ages and shown times
    (tests pin them so snapshots do not depend on the time of day or the time zone)."""
    if poll_s <= 0:
        raise ValueError(f"poll_s must be > 0, got {poll_s}")
    return TrainguardApp(source, poll_s=poll_s, clock=clock, clock_text=clock_text)


def run_dashboard(args: argparse.Namespace) -> int:
    """Entry point of `trainguard top` (args: state_dir, agent, token_file, json)."""
    try:
        clients = clients_from_args(getattr(args, "state_dir", None), getattr(args, "agent", None),
                                    getattr(args, "token_file", None),
                                    context_for_cli(getattr(args, "tls_ca", None), getattr(args, "tls_cert", None),
                                                    getattr(args, "tls_key", None)))
    except (ValueError, ApiClientError) as exc:
        print(f"trainguard: {exc}", file=sys.stderr)
        return 2
    source = ApiDataSource(clients)
    if getattr(args, "json", False):
        # No terminal UI: one poll of every agent as JSON (for scripts, and to check access).
        snaps = source.poll()
        print(json.dumps([dataclasses.asdict(s) for s in snaps], indent=2))
        return 0 if all(s.up for s in snaps) else 1
    app = create_app(source)
    app.run()
    return 0
