"""A failed memory-tier save is told once, with the cause from the rank that had it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import in_process_agent_config
from tests.helpers.telemetry import make_msg
from trainguard.agent.daemon import Agent
from trainguard.agent.recovery.service import SECONDHAND_WAIT_S
from trainguard.agent.wire import CKPT_FAILED_ELSEWHERE

JOB = "job-1"


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[Agent]:
    agent = Agent(in_process_agent_config(tmp_path / "agent"))
    agent.start()
    agent.table.register_job(JOB)
    try:
        yield agent
    finally:
        agent.shutdown()


def _failures(agent: Agent) -> list[dict[str, Any]]:
    events = [{**e, **e.get("fields", {})} for e in agent.events.since(0, 1000)]
    return [e for e in events if e["kind"] == "checkpoint_write_failed"]


def _note(agent: Agent, now: float) -> None:
    views = list(agent.table.snapshot().jobs[JOB].values())
    agent.recovery._note_save_failures(JOB, views, now)


def test_the_failing_ranks_own_error_is_told_though_another_rank_reported_first(agent: Agent) -> None:
    agent.table.add(make_msg(JOB, rank=0, step=20))
    agent.table.add(make_msg(JOB, rank=1, step=21, ckpt_failed=20, ckpt_error=CKPT_FAILED_ELSEWHERE))
    _note(agent, 100.0)
    assert _failures(agent) == []  # waits for the cause
    agent.table.add(make_msg(JOB, rank=0, step=21, ckpt_failed=20, ckpt_error="[Errno 28] No space left on device"))
    _note(agent, 101.0)
    _note(agent, 100.0 + 2 * SECONDHAND_WAIT_S)
    told = _failures(agent)
    assert len(told) == 1, told
    assert told[0]["rank"] == 0 and "No space left" in told[0]["error"], told[0]


def test_a_secondhand_report_alone_is_told_after_the_wait_and_once(agent: Agent) -> None:
    agent.table.add(make_msg(JOB, rank=0, step=20))
    agent.table.add(make_msg(JOB, rank=1, step=21, ckpt_failed=20, ckpt_error=CKPT_FAILED_ELSEWHERE))
    _note(agent, 100.0)
    _note(agent, 100.0 + SECONDHAND_WAIT_S / 2)
    assert _failures(agent) == []
    _note(agent, 100.0 + SECONDHAND_WAIT_S)
    _note(agent, 100.0 + 2 * SECONDHAND_WAIT_S)
    told = _failures(agent)
    assert [(e["rank"], e["error"]) for e in told] == [(1, CKPT_FAILED_ELSEWHERE)]


def test_a_job_that_ends_first_still_gets_the_secondhand_report(agent: Agent) -> None:
    agent.table.add(make_msg(JOB, rank=1, step=21, ckpt_failed=20, ckpt_error=CKPT_FAILED_ELSEWHERE))
    _note(agent, 100.0)
    agent.recovery._finish(JOB)
    assert [e["step"] for e in _failures(agent)] == [20]
