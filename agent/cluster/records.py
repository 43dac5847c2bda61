"""Records agents keep for each other in etcd (job records, lineage commit records): read within a
size bound with the cluster key's signature checked, and a record not used reported once per
revision, so a writer without the key can neither steer agents nor flood the event log."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

from trainguard.agent.cluster.signing import verify

log = logging.getLogger("trainguard.cluster")

DropFn = Callable[[str, int, str], None]
"""(etcd key, mod revision, reason) of a record not used."""


def load_signed(data: bytes, *, key: bytes, domain: str, payload: Callable[[dict[str, Any]], bytes],
                max_bytes: int, error: type[ValueError]) -> dict[str, Any]:
    """The record's JSON object without its ``sig``; with ``key`` the signature over
    ``payload(doc)`` in ``domain`` must check. Raises ``error`` (one line) otherwise."""
    if len(data) > max_bytes:
        raise error(f"record of {len(data)} bytes is larger than {max_bytes}")
    try:
        doc = json.loads(data)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise error(f"not JSON: {str(exc)[:80]}") from None
    if not isinstance(doc, dict):
        raise error("not a JSON object")
    sig = doc.pop("sig", None)
    if key:
        if sig is None:
            raise error("not signed with the cluster key (written by something other than an agent)")
        if not verify(key, domain, payload(doc), sig):
            raise error("bad signature (not written with this cluster's key for this record, or altered since)")
    return doc


class RevisionDrops:
    """Counts records not used and reports each (key, revision) once: a bad record read again at
    every sync is one drop, not one a second."""

    def __init__(self, what: str, on_drop: DropFn | None = None, remember: int = 10_000) -> None:
        self.what = what
        self.on_drop = on_drop
        self.dropped = 0
        self._remember = remember
        self._seen: set[tuple[str, int]] = set()

    def drop(self, key: str, revision: int, reason: str) -> None:
        if (key, revision) in self._seen:
            return
        if len(self._seen) >= self._remember:
            self._seen.clear()
        self._seen.add((key, revision))
        self.dropped += 1
        log.warning("cluster: %s %s (revision %d) not used: %s", self.what, key[:200], revision, reason)
        if self.on_drop is not None:
            self.on_drop(key[:200], revision, reason)
