"""The leader's look at the members before one decision: every call at once, one deadline.

Before it places an attempt of a spanning job the leader probes each candidate node's API and asks
every holder (members and shared tiers) which checkpoint steps it keeps of each part, then reads
the manifests of the steps found. All of it runs concurrently under one deadline
(``cluster.decision_timeout_s``): a node that has not answered by then is unreachable for this
decision (not placed, its copies not used), so one hanging node never stalls the leader. A node
whose lease has not expired yet but whose agent is dead (SIGKILLed a moment ago) fails the probe.
The result is plain data; ``gang.decide`` stays pure and is fed from it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

log = logging.getLogger("trainguard.cluster.survey")

TIER_HOLDER = "tier:"
"""Prefix of a holder that is a tier every node reaches (the object store), not a node."""
MAX_WORKERS = 32
"""Calls in flight at once; a hanging holder ties up one worker until its client times out."""

K = TypeVar("K")
T = TypeVar("T")

Probe = Callable[[str], object]
"""Raises unless the node's API answers (a cheap authenticated GET)."""
Lister = Callable[[str, str], list[int]]
"""(holder, part origin) -> steps the holder keeps of that part; raises when it holds none."""
PartsReader = Callable[[str, str, int], tuple[list[str], float]]
"""(holder, part origin, step) -> (the parts (nodes) the checkpoint of that step consists of, when
its writer committed it)."""


def sorted_holders(part: str, holders: Iterable[str]) -> list[str]:
    """The writer itself first (its RAM, no copy), then nodes holding copies, shared tiers last."""
    return sorted(set(holders), key=lambda n: (n != part, n.startswith(TIER_HOLDER), n))


def run_bounded(tasks: dict[K, Callable[[], T]], timeout_s: float, *,
                workers: int = MAX_WORKERS) -> tuple[dict[K, T], dict[K, str]]:
    """Run ``tasks`` concurrently and wait at most ``timeout_s`` for all of them. Returns (results,
    failures: key -> why). A task still running at the deadline is left to its own timeout in a
    daemon thread and reported as not answering; one not started by then is not started."""
    keys = list(tasks)
    results: dict[K, T] = {}
    failures: dict[K, str] = {}
    cond = threading.Condition()
    deadline = time.monotonic() + timeout_s
    queue = list(reversed(keys))

    def work() -> None:
        while True:
            with cond:
                if not queue or time.monotonic() >= deadline:
                    return
                key = queue.pop()
            try:
                value = tasks[key]()
            except Exception as exc:  # noqa: BLE001 - a failing member is a result, not a crash
                with cond:
                    failures[key] = f"{type(exc).__name__}: {exc}"
                    cond.notify_all()
                continue
            with cond:
                results[key] = value
                cond.notify_all()

    for i in range(min(workers, len(keys))):
        threading.Thread(target=work, name=f"survey-{i}", daemon=True).start()
    with cond:
        while len(results) + len(failures) < len(keys):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            cond.wait(left)
        done_results, done_failures = dict(results), dict(failures)
    for key in keys:
        if key not in done_results and key not in done_failures:
            done_failures[key] = f"no answer within {timeout_s:g} s"
    return done_results, done_failures


@dataclass
class Survey:
    """What the members said within one decision's deadline."""

    unreachable: dict[str, str] = field(default_factory=dict)
    """Nodes (and shared tiers) that did not answer in time or refused the probe -> why."""
    have: dict[str, dict[int, list[str]]] = field(default_factory=dict)
    """Part origin -> step -> holders that answered with it."""
    manifests: dict[tuple[str, int, str], tuple[list[str], float]] = field(default_factory=dict)
    """(origin, step, holder) -> (parts, commit time) of that copy (absent: its manifest was unreadable)."""
    elapsed_s: float = 0.0

    def find_restore(self, max_step: int | None = None,
                     abandoned: Iterable[Sequence[float]] = ()) -> tuple[int, dict[str, list[str]]]:
        """Newest step (<= ``max_step``) of which every part is held by a holder that answered.
        ``abandoned``: [restore step, when] of each lineage the leader gave up: a copy of a later
        step committed before that moment belongs to the branch given up and is never used."""
        cuts = [(int(c[0]), float(c[1])) for c in abandoned]

        def usable(origin: str, step: int, holder: str) -> bool:
            meta = self.manifests.get((origin, step, holder))
            return not any(step > s0 and (meta is None or meta[1] < at) for s0, at in cuts)

        have: dict[str, dict[int, list[str]]] = {}
        for origin, by_step in self.have.items():
            for step, holders in by_step.items():
                kept = [h for h in holders if usable(origin, step, h)]
                if kept and (max_step is None or step <= max_step):
                    have.setdefault(origin, {})[step] = kept
        for step in sorted({s for by in have.values() for s in by}, reverse=True):
            parts = next((self.manifests[(o, step, h)][0] for o in sorted(have) for h in have[o].get(step, [])
                          if (o, step, h) in self.manifests), None)
            if parts and all(step in have.get(p, {}) for p in parts):
                return step, {p: sorted_holders(p, have[p][step]) for p in parts}
        return -1, {}

    def finder(self) -> Callable[..., tuple[int, dict[str, list[str]]]]:
        """A ``gang.RestoreFinder`` over this survey (no I/O); the gang's given-up lineages apply."""
        def find(_rec: Any, g: Any, _apis: dict[str, str], max_step: int | None) -> tuple[int, dict[str, list[str]]]:
            return self.find_restore(max_step, getattr(g, "abandoned", ()))

        return find


def take_survey(*, probe_nodes: Iterable[str], holders: Iterable[str], origins: list[str], probe: Probe,
                listing: Lister, parts_of: PartsReader, timeout_s: float) -> Survey:
    """Probe ``probe_nodes`` and ask every holder for its listing of each origin's part and the
    manifests of the steps it lists: one task per node, all at once, one deadline of ``timeout_s``
    seconds (a second round for manifests would get no time left after a hanging member)."""
    t0 = time.monotonic()
    probed = set(probe_nodes)
    listed = set(holders)

    def ask(node: str) -> dict[str, dict[int, tuple[list[str], float] | None]]:
        if node in probed:
            probe(node)
        out: dict[str, dict[int, tuple[list[str], float] | None]] = {}
        for origin in origins if node in listed else []:
            try:
                steps = listing(node, origin)
            except Exception as exc:  # noqa: BLE001 - a holder without this part holds nothing of it
                log.debug("%s holds no listing of %s: %s", node, origin, exc)
                continue
            by_step: dict[int, tuple[list[str], float] | None] = {}
            for step in steps:
                try:
                    by_step[int(step)] = parts_of(node, origin, int(step))
                except Exception as exc:  # noqa: BLE001 - listed, but which parts it needs is unknown here
                    log.info("manifest of %s step %s unreadable on %s: %s", origin, step, node, exc)
                    by_step[int(step)] = None
            out[origin] = by_step
        return out

    everyone = sorted(probed | listed)
    answers, failures = run_bounded({n: (lambda n=n: ask(n)) for n in everyone}, timeout_s)  # type: ignore[misc]
    survey = Survey(unreachable=dict(sorted(failures.items())))
    for holder in sorted(answers, key=lambda h: (h.startswith(TIER_HOLDER), h)):
        for origin, by_step in sorted(answers[holder].items()):
            for step, meta in by_step.items():
                survey.have.setdefault(origin, {}).setdefault(step, []).append(holder)
                if meta is not None:
                    survey.manifests[(origin, step, holder)] = (list(meta[0]), float(meta[1]))
    survey.elapsed_s = time.monotonic() - t0
    return survey
