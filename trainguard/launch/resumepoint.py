"""What a rendezvous round's ranks resume from: each node offers what its ranks hold
(``Holdings``), and the nodes agree on one point for every rank (``Agreed``). Kept apart from
``rendezvous`` (which imports torch) so that the node-side code reads it without torch."""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class Holdings:
    """What one node's ranks could resume from: the snapshot steps all of them hold at the round's
    world size, and the newest whole checkpoint (every rank's state in one place) of its tiers."""

    snapshots: tuple[int, ...] = ()
    checkpoint: int | None = None

    @classmethod
    def parse(cls, text: str) -> Holdings:
        """A node's offer as the store holds it; a malformed one offers nothing."""
        try:
            body = json.loads(text)
            snapshots = tuple(s for s in body["snapshots"] if isinstance(s, int) and not isinstance(s, bool) and s >= 0)
            checkpoint = body.get("checkpoint")
            ok = isinstance(checkpoint, int) and not isinstance(checkpoint, bool) and checkpoint >= 0
            return cls(snapshots, checkpoint if ok else None)
        except (ValueError, TypeError, KeyError):
            return cls()


@dataclass(frozen=True)
class Agreed:
    """What a round's ranks resume from: every rank's snapshot of ``snapshot_step``, or the whole
    checkpoint of ``checkpoint_step`` that the nodes ``holders`` (group ranks) hold; neither
    when nothing is common."""

    snapshot_step: int | None
    checkpoint_step: int | None
    holders: tuple[int, ...]
