"""The heartbeat watch on its own: stuck and dead threads, recovery, and error reports that a
loop failing every time round cannot turn into a flood of events."""

from __future__ import annotations

import threading

import pytest

from trainguard.agent import health
from trainguard.agent.health import ERROR_REPORT_S, ThreadHealth, Watch


class Loop:
    """Stands in for an object that owns a long-lived loop."""


def test_stuck_then_recovered_is_reported_once_each(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    monkeypatch.setattr(health, "_clock", lambda: now[0])
    changes: list[ThreadHealth] = []
    watch = Watch(10.0, on_change=changes.append)
    loop = Loop()
    health.beat(loop, "loop")
    watch.watch(loop, "loop")
    assert watch.healthy()
    now[0] = 111.0
    (th,) = watch.check()
    assert not th.healthy and th.reason == "stuck" and th.since_s == pytest.approx(1.0)
    watch.check(112.0)
    health.beat(loop, "loop")
    assert watch.healthy()
    assert [(c.healthy, c.reason) for c in changes] == [(False, "stuck"), (True, "")]


def test_a_thread_that_ended_without_saying_so_is_dead() -> None:
    watch = Watch(60.0)
    loop = Loop()
    t = threading.Thread(target=health.beat, args=(loop, "short"))
    t.start()
    t.join()
    watch.watch(loop, "short")
    (th,) = watch.check()
    assert th.reason == "dead"
    health.stopped(loop, "short")  # a loop that ends on purpose says so
    assert watch.healthy()


def test_errors_of_a_loop_failing_every_time_are_reported_once_a_minute(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [0.0]
    monkeypatch.setattr(health, "_clock", lambda: now[0])
    reports: list[tuple[str, int, str]] = []
    watch = Watch(1e9, on_errors=lambda *r: reports.append(r))
    loop = Loop()
    watch.watch(loop, "busy")
    for i in range(10_000):  # a loop failing every 10 ms for 100 s, checked every second
        health.failed(loop, "busy", ValueError(f"bad {i}"))
        if i % 100 == 0:
            now[0] = i / 100
            watch.check()
    watch.check(now[0] + ERROR_REPORT_S)
    assert len(reports) == 3  # at 0 s, 60 s and 159 s: not one per iteration or per check
    assert sum(n for _name, n, _last in reports) == 10_000
    assert reports[-1][2] == "ValueError: bad 9999"
