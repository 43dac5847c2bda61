"""Snapshot tests of `trainguard top`: the main screens pinned at 80x24 and 160x48 against the fixed
fake scene (tui.fake: a straggler, a killed rank, a throttling GPU, checkpoints, events), with the
clock and time zone pinned so the images do not depend on when or where they are taken.

Update after an intended change of the look: ``pytest tests/tui/test_tui_snapshots.py --snapshot-update``
and look at the SVGs under tests/tui/__snapshots__/test_tui_snapshots/ before committing them.
"""

from __future__ import annotations

import time

import pytest
from textual.pilot import Pilot

from trainguard.agent.api.client import ApiClientError
from trainguard.tui.app import TrainguardApp, create_app
from trainguard.tui.fake import T0, FakeSource

SIZES = [(80, 24), (160, 48)]
POLLS = 30  # the controller plots need history: one point per poll


def utc(ts: float) -> str:
    return time.strftime("%H:%M:%S", time.gmtime(ts))


def make_app(source: FakeSource | None = None) -> TrainguardApp:
    # A poll interval of an hour: only the polls the test asks for happen.
    return create_app(source or FakeSource(), poll_s=3600, clock=lambda: T0, clock_text=utc)


async def settle(pilot: Pilot, polls: int = POLLS) -> None:
    """Wait for the first poll; give the controller ``polls - 1`` earlier polls of history (fed
    straight in, which is much cheaper than drawing each), and draw the last one."""
    app = pilot.app
    assert isinstance(app, TrainguardApp)
    await app.workers.wait_for_complete()
    await pilot.pause()
    assert app.main.polls == 1
    if polls > 1:
        for _ in range(polls - 2):
            app.main.history.add(app.main.source.poll())
        app.main.poll()
        await app.workers.wait_for_complete()
        await pilot.pause()


PANELS = {"overview": "1", "ranks": "2", "gpus": "3", "kernel": "4", "checkpoints": "5", "controller": "6",
          "events": "7"}


@pytest.mark.parametrize("panel", list(PANELS))
def test_panels_80x24(snap_compare, panel: str) -> None:
    assert snap_compare(make_app(), press=[PANELS[panel]], terminal_size=(80, 24), run_before=settle)


@pytest.mark.parametrize("panel", ["overview", "ranks", "controller", "events"])
def test_panels_160x48(snap_compare, panel: str) -> None:
    assert snap_compare(make_app(), press=[PANELS[panel]], terminal_size=(160, 48), run_before=settle)


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_agent_unreachable_banner(snap_compare, size: tuple[int, int]) -> None:
    source = FakeSource()

    async def run_before(pilot: Pilot) -> None:
        await settle(pilot, polls=3)
        source.down = True
        app = pilot.app
        assert isinstance(app, TrainguardApp)
        app.main.poll()
        await app.workers.wait_for_complete()
        await pilot.pause()

    assert snap_compare(make_app(source), press=["2"], terminal_size=size, run_before=run_before)


def test_help_overlay(snap_compare) -> None:
    assert snap_compare(make_app(), press=["question_mark"], run_before=settle)


def test_filtered_ranks_sorted_by_score(snap_compare) -> None:
    async def run_before(pilot: Pilot) -> None:
        await settle(pilot)
        app = pilot.app
        assert isinstance(app, TrainguardApp)
        app.main.ranks.sort_by("score")
        await pilot.press("slash", *"gpt", "enter")

    assert snap_compare(make_app(), run_before=run_before)


def test_drain_confirm_dialog(snap_compare) -> None:
    source = FakeSource()
    source.refusals["drain"] = ApiClientError(
        501, "POST /v1/jobs/gpt-small/drain: draining needs the straggler/healing module")

    async def run_before(pilot: Pilot) -> None:
        await settle(pilot, polls=2)
        await pilot.press("down", "down", "d")  # rank 2, the straggler
        await pilot.pause()

    assert snap_compare(make_app(source), run_before=run_before)


def test_two_agents(snap_compare) -> None:
    source = FakeSource(agents=("10.0.0.1:9479", "10.0.0.2:9479"))
    assert snap_compare(make_app(source), terminal_size=(160, 48), run_before=settle)
