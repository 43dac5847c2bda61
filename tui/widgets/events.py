"""The event log: every detection, decision and action with its cause, searchable."""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from rich.text import Text
from textual.widgets import DataTable

from trainguard.tui.model import EVENT_HEADERS, event_cause, event_text, event_where, matches

KEEP = 2000
SEVERITY_STYLE = {"warning": "yellow", "error": "bold red", "critical": "bold red"}
# Short, and loud in capitals where it matters (a monochrome terminal shows no colour).
SEVERITY_LABEL = {"info": "info", "debug": "dbg", "warning": "WARN", "error": "ERR", "critical": "CRIT"}


class EventsTable(DataTable[Text]):
    """Oldest first, follows the newest event while the cursor is on the last row."""

    def __init__(self, clock_text: Callable[[float], str], **kwargs: Any) -> None:
        super().__init__(cursor_type="row", **kwargs)
        self._clock_text = clock_text
        self._events: deque[Mapping[str, Any]] = deque(maxlen=KEEP)
        self._seen: set[tuple[str, int]] = set()
        self._by_key: dict[str, Mapping[str, Any]] = {}
        self.filter_text = ""
        self.with_node = False

    def on_mount(self) -> None:
        self.add_columns(*EVENT_HEADERS)

    @property
    def events(self) -> list[Mapping[str, Any]]:
        return list(self._events)

    def shown_count(self) -> int:
        return self.row_count

    def add_events(self, agent: str, events: Iterable[Mapping[str, Any]]) -> int:
        follow = self.row_count == 0 or self.cursor_row >= self.row_count - 1
        added = 0
        for e in events:
            ident = (agent, int(e.get("seq", -1)))
            if ident in self._seen:
                continue
            self._seen.add(ident)
            if len(self._events) == KEEP:
                old = self._events[0]
                self._seen.discard((str(old.get("_agent")), int(old.get("seq", -1))))
                self._by_key.pop(str(old.get("_key")), None)
            e = dict(e, _agent=agent, _key=f"{agent}#{e.get('seq')}")
            self._events.append(e)
            added += 1
            if not self.filter_text or matches(event_text(e), self.filter_text):
                self._add_row(e)
        if added and follow and self.row_count:
            self.move_cursor(row=self.row_count - 1, animate=False)
        return added

    def _add_row(self, e: Mapping[str, Any]) -> None:
        style = SEVERITY_STYLE.get(str(e.get("severity")), "")
        ts = e.get("ts")
        cells = (
            str(e.get("seq", "")),
            self._clock_text(float(ts)) if isinstance(ts, int | float) else "-",
            SEVERITY_LABEL.get(str(e.get("severity", "")), str(e.get("severity", ""))[:4]),
            str(e.get("kind", "")),
            event_where(e, self.with_node),
            str(e.get("message", "")),
            event_cause(e),
        )
        self._by_key[str(e["_key"])] = e
        self.add_row(*(Text(c, style=style) for c in cells), key=str(e["_key"]))

    def event_at(self, key: str | None) -> Mapping[str, Any] | None:
        return self._by_key.get(key) if key else None

    def detail(self, e: Mapping[str, Any]) -> str:
        """The whole event in one line: message, cause, action and the remaining fields."""
        ts = e.get("ts")
        fields = {k: v for k, v in (e.get("fields") or {}).items() if k != "action"}
        text = (f"#{e.get('seq')} {self._clock_text(float(ts)) if isinstance(ts, int | float) else '-'} "
                f"{e.get('severity', '')} {e.get('kind', '')} [{event_where(e, True)}] {e.get('message', '')}"
                f" | cause/action: {event_cause(e)}")
        if fields:
            text += " | " + json.dumps(fields, separators=(",", ":"), default=str)[:300]
        return text

    def filter(self, query: str) -> None:
        self.filter_text = query.strip()
        self.clear()
        self._by_key.clear()
        for e in self._events:
            if not self.filter_text or matches(event_text(e), self.filter_text):
                self._add_row(e)
        if self.row_count:
            self.move_cursor(row=self.row_count - 1, animate=False)
