"""A stand-in for the agent's EventLog: records what a service emits, so a test can ask for the
fields of every event of one kind."""

from __future__ import annotations

from typing import Any


class EventRecorder:
    def __init__(self) -> None:
        self.seen: list[tuple[str, str, dict[str, Any]]] = []

    def emit(self, kind: str, message: str, **fields: Any) -> None:
        self.seen.append((kind, message, fields))

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [f for k, _, f in self.seen if k == kind]
