"""The plan sync points' store round trips run off the training thread (``trainguard.run.plansync``):
rank 0's write goes out in the background, the other ranks fetch a point's key while they train
towards the next one, and every rank still applies the same plan at the same step. Real c10d
TCPStore on loopback; the ranks' steps interleaved in one thread, as synchronous training orders
them (rank 0 passes a sync point before the others finish the step after it)."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch.distributed as dist

import trainguard.run.plansync as plansync
from trainguard.agent.wire import Plan
from trainguard.run.plansync import PlanSync

STEP_S = 0.1
"""Steps long enough that sync points stay 4 steps apart (``PlanSync.every``)."""


class _Plans:
    """A watcher whose plan the test sets."""

    def __init__(self) -> None:
        self.current = Plan()

    def poll(self) -> Plan:
        return self.current


class _Recorded:
    """A store that notes which thread made each request; its clone notes as "clone"."""

    def __init__(self, inner: Any, log: list[tuple[str, str, str]], tag: str = "main") -> None:
        self.inner, self.log, self.tag = inner, log, tag
        self.fail_clone_sets = self.fail_clone_gets = 0

    def clone(self) -> _Recorded:
        clone = _Recorded(self.inner.clone(), self.log, "clone")
        clone.fail_clone_sets, clone.fail_clone_gets = self.fail_clone_sets, self.fail_clone_gets
        return clone

    def set(self, key: str, value: str) -> None:
        self.log.append((self.tag, "set", key))
        if self.tag == "clone" and self.fail_clone_sets > 0:
            self.fail_clone_sets -= 1
            raise RuntimeError("store connection reset")
        self.inner.set(key, value)

    def get(self, key: str) -> bytes:
        self.log.append((self.tag, "get", key))
        if self.tag == "clone" and self.fail_clone_gets > 0:
            self.fail_clone_gets -= 1
            raise RuntimeError("store connection reset")
        return bytes(self.inner.get(key))

    def delete_key(self, key: str) -> bool:
        self.log.append((self.tag, "delete", key))
        return bool(self.inner.delete_key(key))


@pytest.fixture()
def store() -> Any:
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    yield server


def _pair(monkeypatch: pytest.MonkeyPatch, server: Any, plans: _Plans) -> tuple[PlanSync, PlanSync, list[Any]]:
    monkeypatch.setattr(plansync, "_job_store", lambda: server)
    leader = PlanSync(plans, is_leader=True, attempt=0, every=4)  # type: ignore[arg-type]
    follower = PlanSync(_Plans(), is_leader=False, attempt=0, every=4)  # type: ignore[arg-type]
    log: list[Any] = []
    leader.store = _Recorded(leader.store, log)  # type: ignore[assignment]
    follower.store = _Recorded(follower.store, log)  # type: ignore[assignment]
    return leader, follower, log


def _settle(sync: PlanSync) -> None:
    """Wait for what the sync's thread has in hand (the test's steps take no time)."""
    for result in (sync._sent, sync._fetch[1] if sync._fetch else None):
        if result is not None:
            try:
                result.get()
            except Exception:  # noqa: BLE001 - the test looks at what after_step does with it
                pass


def test_sync_points_agree_with_their_round_trips_off_the_training_thread(monkeypatch: pytest.MonkeyPatch,
                                                                          store: Any) -> None:
    plans = _Plans()
    leader, follower, log = _pair(monkeypatch, store, plans)
    assert leader.initial() == follower.initial() == Plan()
    applied: list[list[tuple[int, int]]] = [[], []]
    for step in range(60):
        if step == 10:
            plans.current = Plan(version=1, lr_scale=0.5, reason="test")
        if step == 33:
            plans.current = Plan(version=2, lr_scale=0.25, reason="test")
        for i, sync in enumerate((leader, follower)):
            got = sync.after_step(STEP_S)
            _settle(sync)
            if got is not None and got.version > (applied[i][-1][1] if applied[i] else 0):
                applied[i].append((step, got.version))
    assert applied[0] == applied[1], applied  # every rank switches plans at the same step
    assert [v for _, v in applied[0]] == [1, 2]
    assert leader.points == follower.points > 10
    main = [(op, key) for tag, op, key in log if tag == "main"]
    # On the training thread: rank 0's "start" write, the other rank's two reads of "start" (at
    # start-up and at the first point). Every later point's write, fetch and delete ran on the clone.
    assert sorted(main) == [("get", "start"), ("get", "start"), ("set", "start")], main
    clone_ops = {(op, key) for tag, op, key in log if tag == "clone"}
    assert ("set", "5") in clone_ops and ("get", "5") in clone_ops and ("delete", "2") in clone_ops
    threads = {t.name for t in threading.enumerate()}
    assert "trainguard-plan-sync" in threads


def test_a_write_that_failed_in_the_background_is_raised_at_the_next_point(monkeypatch: pytest.MonkeyPatch,
                                                                            store: Any) -> None:
    plans = _Plans()
    leader, follower, _ = _pair(monkeypatch, store, plans)
    leader.store.fail_clone_sets = 1  # type: ignore[attr-defined]
    leader.initial()
    follower.initial()
    raised = None
    for step in range(20):
        try:
            leader.after_step(STEP_S)
        except RuntimeError as exc:
            raised = (step, str(exc))
            break
        _settle(leader)
    assert raised is not None and "connection reset" in raised[1], raised
    assert raised[0] == 4  # the first point's write failed (step 0), told at the next point


def test_a_failed_fetch_is_read_again_on_the_training_thread(monkeypatch: pytest.MonkeyPatch, store: Any) -> None:
    plans = _Plans()
    leader, follower, log = _pair(monkeypatch, store, plans)
    leader.initial()
    follower.initial()
    follower.store.fail_clone_gets = 1  # type: ignore[attr-defined]
    plans.current = Plan(version=3, lr_scale=0.5, reason="test")
    seen = []
    for _ in range(12):
        leader.after_step(STEP_S)
        _settle(leader)
        got = follower.after_step(STEP_S)
        if got is not None:
            seen.append(got.version)
    assert 3 in seen
    assert ("clone", "get", "0") in log  # the fetch, which failed,
    assert ("main", "get", "0") in log  # and the read again, on the training thread
