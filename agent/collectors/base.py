"""What every collector looks like to the agent.

A collector reads one part of the world once per interval (``poll``), keeps its latest snapshot,
and turns that snapshot into fresh Prometheus families at scrape time (``metrics``). Events that
cannot wait for the next interval (a rank exit, an OOM kill, a GPU XID) go out through the
``emit`` callback the agent hands in. A collector that cannot run here says why once
(``down_reason``) and the agent runs on without it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from prometheus_client.metrics_core import Metric

# emit(kind, fields): kind is a short event name ("rank_exit", "oom_kill", "gpu_xid", ...);
# fields are JSON-able and land in the event log as they are.
EmitFn = Callable[[str, dict[str, Any]], None]


@dataclass(frozen=True)
class TrackedProcess:
    """A training rank process the agent launched and wants watched."""

    pid: int
    job: str
    rank: int
    local_rank: int
    gpu: int | None = None
    """The GPU the agent gave the rank (None: the rank's own choice, by default ``local_rank``)."""


class CollectorUnavailable(RuntimeError):
    """Raised by ``start`` when the collector cannot run here; the message says why, for one log line."""


class Collector(Protocol):
    name: str

    def start(self) -> None:
        """Probe and acquire resources; raise CollectorUnavailable to be marked down."""

    def poll(self, now: float) -> None:
        """Read once; called every interval from the agent's main loop. Must not block long."""

    def track(self, processes: Mapping[int, TrackedProcess]) -> None:
        """The current set of rank processes (pid -> process). Called whenever ranks start or stop."""

    def metrics(self) -> Iterable[Metric]:
        """Fresh metric families built from the latest snapshot."""

    def stop(self) -> None:
        """Release everything; safe to call twice."""


def noop_emit(kind: str, fields: dict[str, Any]) -> None:
    """An emit callback for tests and tools that do not care about events."""
