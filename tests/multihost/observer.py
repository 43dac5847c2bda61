"""An observer outside the hosts: every second it records, per host, the job's live ranks and the
newest step they report, the job attempt the host runs, the checkpoint parts committed in the
host's RAM, and the agent's new events, so tests judge what happened from the outside.

Each host is asked over its agent's unix socket (a path on the shared filesystem, reachable from
the test's namespace whatever happens to the host's network); a rank counts as alive only while
its process exists and its newest telemetry came from that process.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from tests.multihost.hosts import Fabric, Host


@dataclass
class Sample:
    t: float
    """Wall-clock time of the reading."""
    host: str
    answered: bool
    """The agent answered (a killed host's does not)."""
    alive: int = 0
    """Rank processes of the job alive on the host."""
    step: int | None = None
    """Newest step any live rank of the host reported."""
    attempt: int | None = None
    state: str = ""
    parts: frozenset[tuple[str, int]] = frozenset()
    """(part's node, step) committed in the host's RAM (its own parts and held peer copies)."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@dataclass
class Observer:
    fabric: Fabric
    job: str
    interval_s: float = 1.0
    rounds: list[list[Sample]] = field(default_factory=list)
    marks: list[tuple[float, str]] = field(default_factory=list)
    """(wall time, what): the faults the test injected, for the figures and the report."""
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> Observer:
        self._thread = threading.Thread(target=self._loop, name="multihost-observer", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)

    def __enter__(self) -> Observer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def mark(self, what: str, at: float | None = None) -> float:
        at = time.time() if at is None else at
        with self._lock:
            self.marks.append((at, what))
        return at

    def _loop(self) -> None:
        while not self._stop.is_set():
            began = time.monotonic()
            hosts = [h for h in self.fabric.hosts.values() if h.proc is not None]
            taken = [self._read(h) for h in hosts]
            with self._lock:
                self.rounds.append(taken)
            self._stop.wait(max(0.05, self.interval_s - (time.monotonic() - began)))

    def _read(self, host: Host) -> Sample:
        parts = frozenset(host.committed_parts(self.job))
        if not host.agent_alive():
            return Sample(time.time(), host.name, False, parts=parts)
        try:
            status = host.client(timeout=3).status()
            host.new_events()
        except Exception:  # noqa: BLE001 - an agent that does not answer in time is recorded as such
            return Sample(time.time(), host.name, False, parts=parts)
        job = next((j for j in status.get("jobs", []) if j.get("job") == self.job), None)
        if job is None:
            return Sample(time.time(), host.name, True, parts=parts)
        alive, steps = 0, []
        for r in job.get("ranks", []):
            pid = r.get("pid")
            if not isinstance(pid, int) or not r.get("alive", True) or not _pid_alive(pid):
                continue
            alive += 1
            tel = r.get("telemetry") or {}
            if tel.get("pid") == pid and isinstance(tel.get("step"), int):
                steps.append(tel["step"])
        return Sample(time.time(), host.name, True, alive, max(steps) if steps else None, job.get("attempt"),
                      str(job.get("state", "")), parts)

    # -- what the samples say ------------------------------------------------------------------

    def snapshot(self) -> list[list[Sample]]:
        with self._lock:
            return list(self.rounds)

    def advancing(self, since: float = 0.0) -> list[tuple[float, dict[str, int]]]:
        """Per round after ``since``: the hosts whose live ranks reported a newer step than in the
        round before, with that step (a host training)."""
        out: list[tuple[float, dict[str, int]]] = []
        last: dict[str, int | None] = {}
        for taken in self.snapshot():
            moving: dict[str, int] = {}
            for s in taken:
                prev = last.get(s.host)
                if s.alive and s.step is not None and prev is not None and s.step > prev:
                    moving[s.host] = s.step
                last[s.host] = s.step if s.alive else None
            if taken and taken[0].t >= since:
                out.append((taken[0].t, moving))
        return out

    def two_copies(self, sides: Iterable[Iterable[str]], since: float, until: float, lockstep: int = 3) -> list[str]:
        """Rounds between a cut (``since``) and its heal (``until``) in which hosts on two sides trained
        at once (two copies of the job). The round that closes the last steps taken before the cut
        shows one copy on both sides, at one step; two copies either report steps more than
        ``lockstep`` apart or advance on both sides in two rounds running. (After the heal one copy
        may span both sides again: ``diverged`` judges that time.)"""
        groups = [set(s) for s in sides]
        bad: list[str] = []
        both_before = False
        for t, moving in self.advancing(since):
            if t > until:
                break
            touched = [i for i, g in enumerate(groups) if g & moving.keys()]
            both = len(touched) > 1
            if both and (both_before or max(moving.values()) - min(moving.values()) > lockstep):
                bad.append(f"t={t:.1f}: {moving}")
            both_before = both
        return bad

    def diverged(self, since: float = 0.0, tolerance: int = 40) -> list[str]:
        """Rounds in which training hosts reported steps far apart: the ranks of one copy move in
        lockstep, so a wide gap means a second copy."""
        return [f"t={t:.1f}: steps {moving}" for t, moving in self.advancing(since)
                if len(moving) > 1 and max(moving.values()) - min(moving.values()) > tolerance]

    def wait_training(self, hosts: Iterable[str] | Callable[[], Iterable[str]], since: float, timeout: float,
                      what: str, diagnose: Callable[[], str] = lambda: "",
                      give_up: Callable[[], str | None] = lambda: None) -> float:
        """Waits until every host in ``hosts`` (or in what it returns now, for a job that may be
        placed anew meanwhile) trains in one round after ``since`` and no other host does; returns
        that round's time, or fails with what the hosts looked like, early when ``give_up`` names a
        reason (the job failed for good)."""
        def current() -> Iterable[str]:
            return hosts() if callable(hosts) else hosts

        deadline = time.monotonic() + timeout
        reason = None
        want: set[str] = set()
        while time.monotonic() < deadline and reason is None:
            want = set(current())
            for t, moving in self.advancing(since):
                if set(moving) == want:
                    return t
            time.sleep(0.5)
            reason = give_up()
        raise AssertionError(f"{what}: {sorted(want)} did not train "
                             f"{'within ' + format(timeout, '.0f') + ' s' if reason is None else 'and ' + reason}\n"
                             f"{self.describe(since)}\n{diagnose()}")

    def committed_floor(self, at: float, holders: Iterable[str], parts: Iterable[str]) -> int:
        """Newest step of which every part in ``parts`` was committed on some host in ``holders``
        in the last round before ``at``: what a restart after ``at`` must not lose (-1: none)."""
        keep = set(holders)
        before = [r for r in self.snapshot() if r and r[0].t <= at]
        if not before:
            return -1
        held: dict[int, set[str]] = {}
        for s in before[-1]:
            if s.host in keep:
                for node, step in s.parts:
                    held.setdefault(step, set()).add(node)
        need = set(parts)
        return max((step for step, have in held.items() if need <= have), default=-1)

    def first_steps(self, hosts: Iterable[str], since: float) -> dict[str, int]:
        """The first step each host reported from a live rank after ``since``."""
        want = set(hosts)
        first: dict[str, int] = {}
        for taken in self.snapshot():
            for s in taken:
                if s.t >= since and s.host in want and s.host not in first and s.alive and s.step is not None:
                    first[s.host] = s.step
        return first

    def describe(self, since: float = 0.0, last: int = 25) -> str:
        """The recent rounds as text: per host alive ranks, step, attempt, state."""
        lines = []
        for taken in [r for r in self.snapshot() if r and r[0].t >= since][-last:]:
            cells = [f"{s.host}:{'-' if not s.answered else f'{s.alive}r@{s.step}/a{s.attempt}/{s.state}'}"
                     for s in taken]
            lines.append(f"  {taken[0].t:.1f} " + "  ".join(cells))
        return "\n".join(lines)

    def events(self, kinds: Iterable[str] = (), since: float = 0.0) -> list[tuple[str, dict[str, Any]]]:
        """(host, event) of every event seen, in time order, optionally only ``kinds``."""
        want = set(kinds)
        got = [(h.name, e) for h in self.fabric.hosts.values() for e in h.seen
               if e.get("ts", 0) >= since and (not want or e["kind"] in want)]
        return sorted(got, key=lambda he: float(he[1].get("ts", 0)))

    def timeline(self, since: float, skip: tuple[str, ...] = ("checkpoint_", "straggler_", "controller_")) -> str:
        """The events every host logged after ``since``, as ``+seconds host kind: message`` lines."""
        return "\n".join(f"  +{float(e['ts']) - since:6.1f}s {h:<7} {e['kind']}: {e['message'][:160]}"
                         for h, e in self.events(since=since) if not e["kind"].startswith(skip))
