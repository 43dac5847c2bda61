"""How many healing actions the agent took, by job, action and cause (``trainguard_heal_actions_total``)."""

from __future__ import annotations


class ActionCounts:
    """One counter shared by every healing action (rollback, exclusion, a hung job's restart)."""

    def __init__(self) -> None:
        self._counts: dict[tuple[str, str, str], int] = {}

    def add(self, job: str, action: str, cause: str) -> None:
        key = (job, action, cause)
        self._counts[key] = self._counts.get(key, 0) + 1

    def items(self) -> list[tuple[tuple[str, str, str], int]]:
        """(job, action, cause) and its count, sorted."""
        return sorted(self._counts.items())
