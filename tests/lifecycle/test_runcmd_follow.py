"""``trainguard run``'s follower when the agent goes away mid-job (``trainguard.launch.runcmd.follow``),
against a stand-in for the agent's API: it waits while a rank of the job still runs, follows on
once the agent answers again, and gives up only when the ranks are gone and no agent came back.
The real thing, an agent SIGKILLed and started again, is in test_run_command.py."""

from __future__ import annotations

import io
import itertools
import os
from typing import Any

import pytest

from trainguard.agent.api.client import ApiClientError
from trainguard.launch.runcmd import follow

LOST = ApiClientError(0, "no agent at /run/x/agent.sock: is `trainguard agent` running?")


class Agent:
    """Answers, then is gone for ``gone`` polls, then answers with ``last`` (None: gone for good)."""

    def __init__(self, ranks: list[dict[str, Any]], gone: int, last: dict[str, Any] | None) -> None:
        self.ranks, self.gone, self.last = ranks, gone, last
        self.polls = 0

    def events(self, since: int, limit: int) -> dict[str, Any]:
        return {"events": [], "next": 0}

    def follow_job(self, job: str, since: int, offsets: dict[int, int]) -> dict[str, Any]:
        self.polls += 1
        if self.polls > 1000:
            raise RuntimeError("the follower never gave up")
        if self.polls == 1:
            return {"job": {"state": "running", "ranks": self.ranks}, "output": [
                {"rank": 0, "text": "step 0\n", "offset": 0, "next": 7, "size": 7}], "events": [], "next": 0}
        if self.polls <= 1 + self.gone or self.last is None:
            raise LOST
        return {"job": self.last, "output": [
            {"rank": 0, "text": "step 1\n", "offset": offsets.get(0, 0), "next": 14, "size": 14}], "events": [],
            "next": 0}


def _follow(agent: Agent, grace_s: float) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    ticks = itertools.count()  # one second a call: the waits below are counted, not slept
    rc = follow(agent, "j", out=out, err=err, poll_s=0.0, idle_poll_s=0.0, agent_grace_s=grace_s,
                clock=lambda: float(next(ticks)))
    return rc, out.getvalue(), err.getvalue()


def test_a_running_rank_keeps_it_waiting_and_it_follows_on_when_the_agent_is_back() -> None:
    # This test's own process stands for a rank of the job that still trains on this node.
    finished = {"state": "succeeded", "exit_code": 0, "restarts": 0, "ranks": []}
    agent = Agent([{"rank": 0, "pid": os.getpid(), "alive": True}], gone=40, last=finished)
    rc, out, err = _follow(agent, grace_s=5.0)
    assert rc == 0 and agent.polls == 42, (agent.polls, err)  # waited well past the grace: the rank ran
    assert out == "[rank0]:step 0\n[rank0]:step 1\n"  # the output goes on from where it was
    assert "waiting for the agent to come back" in err and "the agent is back" in err
    assert "Traceback" not in err


def test_it_gives_up_once_no_rank_of_the_job_runs_and_no_agent_came_back() -> None:
    gone_pid = {"rank": 0, "pid": 2**22 + 12345, "alive": True}  # above pid_max's default: no such process
    agent = Agent([gone_pid], gone=10**6, last=None)
    rc, _, err = _follow(agent, grace_s=5.0)
    assert rc == 1 and agent.polls < 12, agent.polls
    assert "no agent came back" in err and "trainguard status" in err


def test_an_answer_from_the_agent_is_not_a_lost_agent() -> None:
    class Unknown(Agent):
        def follow_job(self, job: str, since: int, offsets: dict[int, int]) -> dict[str, Any]:
            raise ApiClientError(404, "no job 'j' on this agent")

    with pytest.raises(ApiClientError) as raised:
        _follow(Unknown([], gone=0, last=None), grace_s=5.0)
    assert raised.value.status == 404


def test_ctrl_c_while_the_agent_is_away_says_the_job_goes_on_and_where() -> None:
    class Interrupted(Agent):
        def follow_job(self, job: str, since: int, offsets: dict[int, int]) -> dict[str, Any]:
            if self.polls == 3:
                raise KeyboardInterrupt
            return super().follow_job(job, since, offsets)

    agent = Interrupted([{"rank": 0, "pid": os.getpid(), "alive": True}], gone=10**6, last=None)
    rc, _, err = _follow(agent, grace_s=5.0)
    assert rc == 130
    assert "was not stopped" in err and str(os.getpid()) in err and "trainguard stop j" in err
