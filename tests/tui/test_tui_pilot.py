"""`trainguard top` driven with Textual's Pilot against a real agent started by the test, running
a job of fake ranks (tests.helpers.fake_rank: real processes sending real telemetry).

Covers navigation, help, filtering and sorting, the confirm dialogs and the actions they send
(a checkpoint request that reaches the job's plan; a drain the agent refuses with 501; an admin
action refused with 403 for a read-only token), pause, and the agent going away and coming back.
"""

from __future__ import annotations

import os
import sys
import time
from argparse import Namespace
from collections.abc import Callable
from pathlib import Path

import pytest
from textual.pilot import Pilot
from textual.widgets import TabbedContent

from trainguard.agent.api.client import ApiClient, ApiClientError
from trainguard.tui.app import TrainguardApp, create_app, run_dashboard
from trainguard.tui.fake import FakeSource, screen_text
from trainguard.tui.screens.dialogs import ConfirmDialog, HelpScreen
from trainguard.tui.screens.main import PANELS
from trainguard.tui.source import ApiDataSource
from trainguard.tui.widgets.banner import ConnectionBanner, StatusLine

FAKE = [sys.executable, str(Path(__file__).resolve().parents[1] / "helpers" / "fake_rank.py")]
POLL_S = 0.5


async def until(pilot: Pilot, pred: Callable[[], object], what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            await pilot.pause()  # let the screen catch up with the state it was waiting for
            return
        await pilot.pause(0.05)
    raise AssertionError(f"timed out waiting for {what}\n{screen_text(pilot.app)}")


def start_job(client: ApiClient, job: str = "fake-1", nproc: int = 2) -> None:
    client.submit_job({"job": job, "nproc": nproc, "command": FAKE,
                       "env": {"FAKE_STEPS": "100000", "FAKE_STEP_S": "0.02"}})


def app_for(*clients: ApiClient) -> TrainguardApp:
    return create_app(ApiDataSource(list(clients)), poll_s=POLL_S)


def ranks_with_steps(app: TrainguardApp, n: int) -> bool:
    rows = app.main.ranks.shown
    return len(rows) == n and all(r.step is not None for r in rows)


def token_files(tmp_path: Path) -> tuple[Path, Path, Path]:
    """The agent's token file (an admin and a read-only token), the viewer's, and a wrong one."""
    tokens = tmp_path / "tokens"
    tokens.write_text("admin-0123456789abcdef admin\nviewer-0123456789abcdef read\n")
    viewer = tmp_path / "viewer"
    viewer.write_text("viewer-0123456789abcdef\n")
    bad = tmp_path / "bad"
    bad.write_text("wrong-0123456789abcdef\n")
    for f in (tokens, viewer, bad):
        os.chmod(f, 0o600)
    return tokens, viewer, bad


@pytest.mark.asyncio
async def test_navigation_filter_sort_and_actions(agent_factory, tmp_path: Path) -> None:
    tokens, viewer, bad = token_files(tmp_path)
    agent = agent_factory(config=f'[api]\ntcp = "127.0.0.1:0"\ntoken_file = "{tokens}"\nallow_plaintext = true\n')
    client = agent.client()
    start_job(client)
    app = app_for(client)
    async with app.run_test(size=(100, 30)) as pilot:
        main = app.main
        await until(pilot, lambda: ranks_with_steps(app, 2), "telemetry of both ranks in the table")
        assert "fake-1" in screen_text(app)

        # Panels by number, and round the ring with ] / [.
        tabs = main.query_one(TabbedContent)
        for i, (pid, _title) in enumerate(PANELS):
            await pilot.press(str(i + 1))
            assert tabs.active == pid
        await pilot.press("right_square_bracket")
        assert tabs.active == "overview"
        await pilot.press("left_square_bracket")
        assert tabs.active == "events"
        await pilot.press("?")
        assert isinstance(app.screen, HelpScreen)
        assert "drain the highlighted rank" in screen_text(app)
        await pilot.press("escape")
        assert app.screen is main

        # Filter the ranks table, then clear the filter.
        await pilot.press("2", "slash", *"rank1", "enter")
        assert [r.rank for r in main.ranks.shown] == [1]
        assert main.query_one(StatusLine).filter_text == "rank1"
        await pilot.press("slash", "escape")
        assert [r.rank for r in main.ranks.shown] == [0, 1]
        await pilot.press("S")  # reverse the rank order
        assert [r.rank for r in main.ranks.shown] == [1, 0]
        await pilot.press("S")
        await pilot.press("s")  # next column: state
        assert main.ranks.sort_key == "state"

        # Search the event log.
        await pilot.press("7", "slash", *"ranks_started", "enter")
        shown = main.events_table.row_count
        assert shown >= 1 and shown < len(main.events_table.events)
        await pilot.press("slash", "escape")
        assert main.events_table.row_count == len(main.events_table.events)

        # Checkpoint: cancelled first (nothing sent), then confirmed (reaches the job's plan).
        await pilot.press("2", "c")
        assert isinstance(app.screen, ConfirmDialog)
        await pilot.press("n")
        assert app.screen is main and "cancelled" in main.last_action
        assert client.get_plan("fake-1")["checkpoint_id"] == 0
        await pilot.press("c")
        assert isinstance(app.screen, ConfirmDialog)
        await pilot.press("y")
        await until(pilot, lambda: "checkpoint requested for fake-1" in main.last_action, "checkpoint answer")
        assert client.get_plan("fake-1")["checkpoint_id"] == 1
        await until(pilot, lambda: any(e.get("kind") == "checkpoint_requested" for e in main.events_table.events),
                    "the checkpoint_requested event in the log")

        # Drain: whatever the agent answers (the job restarts without the rank's replica, or a
        # refusal) is one line, not a traceback.
        await pilot.press("down", "d")
        assert isinstance(app.screen, ConfirmDialog)
        assert "Drain rank" in screen_text(app)
        await pilot.press("y")
        answers = ("rank 1 of fake-1 drained", "drain of rank 1 not available on this agent: ",
                   "drain of rank 1 refused by the agent: ")
        await until(pilot, lambda: main.last_action.startswith(answers), "the drain's answer")
        assert "Traceback" not in screen_text(app)

        # Pause: no polls while paused; resuming polls again.
        await pilot.press("p")
        assert main.query_one(StatusLine).paused
        await pilot.pause(0.1)  # let a poll already in flight land
        before = main.polls
        await pilot.pause(4 * POLL_S)
        assert main.polls <= before + 1
        await pilot.press("p")
        await until(pilot, lambda: main.polls >= before + 2, "polls after resuming")

    # Over TCP: a read-only token sees everything but its admin actions are refused politely; a
    # wrong token is an agent that does not answer, with the reason, next to the one that does.
    port = client.status()["api_tcp_port"]
    app = app_for(ApiClient.remote("127.0.0.1", port, viewer), ApiClient.remote("127.0.0.1", port, bad))
    async with app.run_test(size=(120, 30)) as pilot:
        main = app.main
        # After the drain the job may run with fewer ranks: expect what the agent says it runs.
        await until(pilot, lambda: ranks_with_steps(app, len(client.job("fake-1")["ranks"])),
                    "the job's ranks through the read-only token")
        await until(pilot, lambda: main.query_one(ConnectionBanner).has_class("-down"), "banner for the bad token")
        assert "HTTP 401" in screen_text(app)
        await pilot.press("c", "y")
        await until(pilot, lambda: "refused" in main.last_action, "the refusal")
        assert "may only read" in main.last_action
        assert client.get_plan("fake-1")["checkpoint_id"] == 1  # unchanged since the admin's request
    client.stop_job("fake-1")


@pytest.mark.asyncio
async def test_agent_going_away_shows_banner_and_recovers(agent_factory, tmp_path: Path, capsys) -> None:
    agent = agent_factory("flaky")
    # `trainguard top --json`: one poll as JSON, exit 0 while the agent answers.
    assert run_dashboard(Namespace(state_dir=str(agent.state_dir), agent=None, token_file=None, json=True)) == 0
    assert '"collectors"' in capsys.readouterr().out
    app = app_for(agent.client())
    async with app.run_test(size=(80, 24)) as pilot:
        main = app.main
        banner = main.query_one(ConnectionBanner)
        await until(pilot, lambda: main.snapshots and main.snapshots[0].up, "first answer")
        assert not banner.has_class("-down")
        node = main.snapshots[0].node
        assert agent.stop() == 0
        await until(pilot, lambda: banner.has_class("-down"), "the unreachable banner")
        text = screen_text(app)
        assert "AGENT UNREACHABLE" in text and "retrying" in text and "Traceback" not in text
        assert main.query_one(StatusLine).stale
        await pilot.press("1")
        assert node in screen_text(app)  # the last data stays on screen
        agent_factory("flaky")  # same state directory, same socket
        await until(pilot, lambda: not banner.has_class("-down"), "recovery after the agent came back")
        assert not main.query_one(StatusLine).stale
        assert "AGENT UNREACHABLE" not in screen_text(app)


def test_run_dashboard_without_an_agent_or_token(tmp_path: Path, capsys) -> None:
    missing = tmp_path / "nowhere"
    assert run_dashboard(Namespace(state_dir=str(missing), agent=None, token_file=None, json=True)) == 1
    assert "no agent at" in capsys.readouterr().out
    assert run_dashboard(Namespace(state_dir=None, agent="127.0.0.1:1", token_file=None, json=False)) == 2
    assert "--token-file" in capsys.readouterr().err


@pytest.mark.asyncio
async def test_refusals_are_polite() -> None:
    """The agent's refusals (501 no such module, 403 read-only token) as the user sees them."""
    source = FakeSource()
    source.refusals["drain"] = ApiClientError(501, "POST /v1/jobs/gpt-small/drain: draining needs the "
                                                   "straggler/healing module, which is not enabled on this agent")
    source.refusals["checkpoint"] = ApiClientError(403, "POST /v1/jobs/gpt-small/checkpoint: this token is read-only")
    app = create_app(source, poll_s=3600)
    async with app.run_test(size=(80, 24)) as pilot:
        main = app.main
        await until(pilot, lambda: main.polls == 1, "the first poll")
        await pilot.press("down", "down", "d", "y")
        await until(pilot, lambda: "draining needs" in main.last_action, "the drain refusal")
        assert main.last_action == ("drain of rank 2 not available on this agent: draining needs the "
                                    "straggler/healing module, which is not enabled on this agent")
        assert source.calls[-1] == ("drain", source.agents()[0], "gpt-small", {"rank": 2, "node": None})
        await pilot.press("n", "y")
        await until(pilot, lambda: source.calls[-1][3].get("node") == "node-a", "the node drain")
        await pilot.press("c", "y")
        await until(pilot, lambda: "may only read" in main.last_action, "the checkpoint refusal")
        assert "STALE" not in screen_text(app) and "Traceback" not in screen_text(app)
        del source.refusals["checkpoint"]
        await pilot.press("c", "y")
        await until(pilot, lambda: main.last_action.startswith("checkpoint requested for gpt-small (id 5"),
                    "the checkpoint answer")


class GarbageSource(FakeSource):
    """An agent whose answer has an unexpected shape (a newer or broken agent)."""

    def poll(self):  # noqa: ANN201
        snaps = super().poll()
        snaps[0].status["jobs"] = {"gpt-small": "running"}  # type: ignore[index]
        return snaps


@pytest.mark.asyncio
async def test_an_answer_of_unexpected_shape_is_a_message_not_a_crash() -> None:
    app = create_app(GarbageSource(), poll_s=3600)
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: app.main.polls == 1, "the first poll")
        assert app.main.last_action.startswith("could not show the agents' answer: AttributeError")
        await pilot.press("1", "3", "7")
        assert app.is_running and "Traceback" not in screen_text(app)
