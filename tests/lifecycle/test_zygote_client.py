"""``ZygoteChild``: its status from the eBPF exit event without waiting for its zygote's report; once
its warm launcher is gone (``orphaned``) no report will come, so its end is looked for in /proc and
its status taken from the exit event, or counted a failure when none came. The whole job with its
zygote SIGKILLed is in test_run_command.py."""

from __future__ import annotations

import itertools
import os
import subprocess
import threading
from pathlib import Path

import pytest

from trainguard.agent.lifecycle.zygote_client import ZygoteChild

GONE_PID = 2**22 + 4321  # above the kernel's largest pid: no such process


def test_an_orphan_that_runs_is_running_and_one_that_ended_takes_its_status_from_the_exit_event(tmp_path: Path) -> None:
    log = str(tmp_path / "rank0.log")
    alive = ZygoteChild(os.getpid(), ["-m", "x"], log)
    alive.orphaned = True
    assert alive.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        alive.wait(0.05)
    ended = ZygoteChild(GONE_PID, ["-m", "x"], log)
    assert ended.poll() is None  # its zygote still reports: not looked for in /proc
    ended.orphaned = True
    ended.status_hint = -9  # the eBPF exit event's SIGKILL
    assert ended.poll() == -9 and ended.wait(1) == -9 and ended.status_source == "ebpf"


def test_an_orphan_whose_end_no_event_told_counts_as_failed_after_a_short_wait(tmp_path: Path) -> None:
    ticks = itertools.count()
    child = ZygoteChild(GONE_PID, ["-m", "x"], str(tmp_path / "rank0.log"), clock=lambda: next(ticks) * 0.1)
    child.orphaned = True
    assert child.poll() is None  # gone, but the exit event may still be on its way
    assert child.wait(5) == 1 and child.status_source == "unknown"


def test_the_exit_events_status_is_the_end_before_the_zygote_reports_and_a_wait_waits_for_the_reap(tmp_path: Path) -> None:
    """A crash is told by the kernel's word (the eBPF exit event, ~15-25 ms ahead of the zygote's
    report on a busy node); a stop waits for the report, so that it leaves no zombie behind."""
    child = ZygoteChild(GONE_PID, ["-m", "x"], str(tmp_path / "rank1.log"))
    assert child.poll() is None  # no report yet, no event yet
    child.exit_seen(-9)
    assert child.poll() == -9 and child.status_source == "ebpf"
    child.exit_seen(0)  # a second event changes nothing
    assert child.poll() == -9
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(0.05)
    got: list[int] = []
    waiter = threading.Thread(target=lambda: got.append(child.wait(30)))
    waiter.start()
    child._ended(0, 9)  # the zygote's report (as its reader thread hands it over)
    waiter.join(5)
    assert got == [-9] and child.poll() == -9
