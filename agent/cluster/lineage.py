"""What each node committed of a spanning job, so a restore never rolls the lineage back silently.

Every node running a block of a spanning job writes, without a lease (the record must outlive the
node), the newest step of its checkpoint part it committed::

    /trainguard/<c>/commits/<job>/<node>   {"step": n, "attempt": a, "parts": [nodes], "at": t}

When the leader restarts the job it restores the newest step it can assemble from the nodes that
answer. If the records say a newer step was committed in full and a part of it lies only with a
node it cannot reach, it waits (bounded by ``cluster.lineage_wait_s``) for that node to come back,
then goes on from what it has and says which steps it gave up (``newer_elsewhere`` decides).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any

from trainguard.agent.cluster.etcd import EtcdClient

log = logging.getLogger("trainguard.cluster.lineage")


@dataclass(frozen=True)
class CommitRecord:
    node: str
    step: int
    attempt: int
    parts: tuple[str, ...] = ()
    """The parts (nodes) the checkpoint of ``step`` consists of; empty: the node's own only."""
    at: float = 0.0

    def to_json(self) -> bytes:
        return json.dumps({"step": self.step, "attempt": self.attempt, "parts": list(self.parts),
                           "at": self.at}, sort_keys=True).encode()

    @classmethod
    def from_json(cls, node: str, data: bytes) -> CommitRecord | None:
        """The record, or None when it is not one (a bad record is dropped, never trusted)."""
        try:
            doc = json.loads(data)
            step, attempt = doc["step"], doc["attempt"]
            parts = doc.get("parts") or []
            if (isinstance(step, bool) or not isinstance(step, int) or step < 0
                    or isinstance(attempt, bool) or not isinstance(attempt, int) or attempt < 0
                    or not isinstance(parts, list) or not all(isinstance(p, str) and p for p in parts)):
                return None
            return cls(node, step, attempt, tuple(parts), float(doc.get("at", 0.0)))
        except (ValueError, KeyError, TypeError):
            return None


class CommitTable:
    """Reads and writes commit records under ``<prefix>commits/``."""

    def __init__(self, client: EtcdClient, prefix: str) -> None:
        self.client = client
        self.prefix = f"{prefix}commits/"
        self.dropped = 0
        """Records that did not parse (counted, ignored)."""

    def read(self, job: str) -> dict[str, CommitRecord]:
        kvs, _ = self.client.get_prefix(f"{self.prefix}{job}/")
        out = {}
        for kv in kvs:
            node = kv.key.rsplit("/", 1)[-1]
            rec = CommitRecord.from_json(node, kv.value)
            if rec is None:
                self.dropped += 1
                log.warning("commit record %s unreadable; ignored", kv.key)
                continue
            out[node] = rec
        return out

    def write(self, job: str, rec: CommitRecord) -> None:
        self.client.put(f"{self.prefix}{job}/{rec.node}", rec.to_json())

    def clear(self, job: str) -> None:
        """Forget a job's records (a new submission under the same name starts a new lineage)."""
        kvs, _ = self.client.get_prefix(f"{self.prefix}{job}/")
        for kv in kvs:
            self.client.delete(kv.key)


@dataclass(frozen=True)
class Newer:
    """A step committed in full that the leader cannot restore now."""

    step: int
    unreachable: tuple[str, ...]
    """Nodes holding a part of ``step`` that did not answer (empty: nobody can give it any more)."""
    committed: dict[str, int] = field(default_factory=dict)
    """Every node whose record is newer than the step to be restored -> its newest step."""

    @property
    def waitable(self) -> bool:
        return bool(self.unreachable)

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "unreachable": list(self.unreachable), "committed": dict(self.committed)}


def newer_elsewhere(restorable: int, commits: dict[str, CommitRecord], reachable: set[str], *,
                    max_step: int | None = None, floor: int = 0) -> Newer | None:
    """The newest step above ``restorable`` (and at most ``max_step``) that the records say was
    committed by every one of its parts, or None. ``reachable``: nodes that answered in this
    decision. Records of attempts below ``floor`` belong to a lineage already given up."""
    live = {n: r for n, r in commits.items() if r.attempt >= floor}
    best: Newer | None = None
    for rec in live.values():
        step = rec.step
        if step <= restorable or (max_step is not None and step > max_step):
            continue
        parts = rec.parts or (rec.node,)
        if not all(p in live and live[p].step >= step for p in parts):
            continue  # not every part got that far: it never was a whole checkpoint
        if best is None or step > best.step:
            best = Newer(step, tuple(sorted(p for p in parts if p not in reachable)))
    if best is None:
        return None
    committed = {n: r.step for n, r in sorted(live.items()) if r.step > restorable}
    return Newer(best.step, best.unreachable, committed)
