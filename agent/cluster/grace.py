"""When the leader first saw each node missing: jobs move off a lost node only a grace after that.

A node whose lease is not refreshed fences its own ranks before its TTL ends; its key disappears at
the TTL. The leader places the node's work elsewhere only ``fence_grace_s`` after it first saw the
key gone, so the old ranks have stopped before the new ones start (no two copies training).
"""

from __future__ import annotations

from collections.abc import Iterable


class MissingClock:
    """First-seen-missing times of nodes, as one leader observed them (its own clock)."""

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self._since: dict[str, float] = {}

    def observe(self, expected: Iterable[str], members: Iterable[str], now: float) -> None:
        """``expected``: nodes that should be alive (they run something); ``members``: nodes whose
        key exists. A node seen again is forgotten, so a later loss starts a fresh grace."""
        present = set(members)
        for node in list(self._since):
            if node in present:
                del self._since[node]
        for node in expected:
            if node not in present:
                self._since.setdefault(node, now)

    def since(self) -> dict[str, float]:
        return dict(self._since)

    def ready(self, node: str, now: float) -> bool:
        """True once ``node`` has been missing for the grace (a node not seen missing is not ready)."""
        first = self._since.get(node)
        return first is not None and now - first >= self.grace_s

    def next_due(self, now: float) -> float | None:
        """Seconds until the earliest pending grace ends (None: none pending)."""
        left = [first + self.grace_s - now for first in self._since.values() if now - first < self.grace_s]
        return max(0.0, min(left)) if left else None
