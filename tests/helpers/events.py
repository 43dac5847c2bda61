"""Events in tests: a stand-in for the agent's EventLog that records what a service emits, and
readers of the event logs (JSON lines) that running agents write."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any


def logged(paths: Iterable[Path]) -> list[dict[str, Any]]:
    """Every event in the logs at ``paths``, in order; a log not written yet, or a line being
    written, is skipped."""
    out = []
    for path in paths:
        try:
            lines = path.read_text().splitlines()
        except FileNotFoundError:
            continue
        for line in lines:
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


def memory_checkpoints(paths: Iterable[Path]) -> list[int]:
    """Steps of the memory-tier checkpoints committed, from the event logs at ``paths``."""
    return [int(e["fields"]["step"]) for e in logged(paths)
            if e["kind"] == "checkpoint_committed" and e["fields"].get("tier") == "memory"]


class EventRecorder:
    def __init__(self) -> None:
        self.seen: list[tuple[str, str, dict[str, Any]]] = []

    def emit(self, kind: str, message: str, **fields: Any) -> None:
        self.seen.append((kind, message, fields))

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [f for k, _, f in self.seen if k == kind]
