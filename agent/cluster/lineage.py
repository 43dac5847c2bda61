"""What each node committed of a spanning job, so a restore never rolls the lineage back silently.

Every node running a block of a spanning job writes, without a lease (the record must outlive the
node), the newest step of its checkpoint part it committed::

    /trainguard/<c>/commits/<job>/<node>   {"step": n, "attempt": a, "parts": [nodes], "at": t}

When the leader restarts the job it restores the newest step it can assemble from the nodes that
answer. If the records say a newer step was committed in full and a part of it lies only with a
node it cannot reach, it waits (bounded by ``cluster.lineage_wait_s``) for that node to come back,
then goes on from what it has and says which steps it gave up (``newer_elsewhere`` decides).

With the cluster key every record carries ``sig``, an HMAC over the record with its job and node,
so a record is used only under the key it was written for; one without a valid signature (an etcd
writer without the key making the leader wait on a step nobody committed) is a counted drop,
reported once per revision.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any

from trainguard.agent.cluster.etcd import EtcdClient
from trainguard.agent.cluster.jobs import valid_node_name
from trainguard.agent.cluster.records import DropFn, RevisionDrops, load_signed
from trainguard.agent.cluster.signing import sign

log = logging.getLogger("trainguard.cluster.lineage")

COMMIT_DOMAIN = "commit-record"
MAX_COMMIT_BYTES = 64 << 10
MAX_PARTS = 4096


class CommitRecordError(ValueError):
    """A commit record that is not used: malformed, out of bounds, or not signed by an agent."""


def _payload(job: str, node: str, doc: dict[str, Any]) -> bytes:
    body = {k: v for k, v in doc.items() if k != "sig"}
    return json.dumps({"job": job, "node": node, "record": body}, sort_keys=True, separators=(",", ":")).encode()


@dataclass(frozen=True)
class CommitRecord:
    node: str
    step: int
    attempt: int
    parts: tuple[str, ...] = ()
    """The parts (nodes) the checkpoint of ``step`` consists of; empty: the node's own only."""
    at: float = 0.0

    def to_json(self, job: str = "", key: bytes = b"") -> bytes:
        """The record as stored; with the cluster ``key`` signed for ``job`` and this node."""
        doc: dict[str, Any] = {"step": self.step, "attempt": self.attempt, "parts": list(self.parts), "at": self.at}
        if key:
            doc["sig"] = sign(key, COMMIT_DOMAIN, _payload(job, self.node, doc))
        return json.dumps(doc, sort_keys=True).encode()

    @classmethod
    def parse(cls, node: str, data: bytes, job: str = "", key: bytes = b"") -> CommitRecord:
        """Validate a stored record of ``job`` under ``node``'s key; with ``key`` its signature must
        check. Raises CommitRecordError (one line) for anything the leader must not act on."""
        doc = load_signed(data, key=key, domain=COMMIT_DOMAIN, payload=lambda d: _payload(job, node, d),
                          max_bytes=MAX_COMMIT_BYTES, error=CommitRecordError)
        step, attempt, parts, at = doc.get("step"), doc.get("attempt"), doc.get("parts") or [], doc.get("at", 0.0)
        if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < 1 << 62:
            raise CommitRecordError("step must be a non-negative integer")
        if isinstance(attempt, bool) or not isinstance(attempt, int) or not 0 <= attempt < 1 << 62:
            raise CommitRecordError("attempt must be a non-negative integer")
        if not valid_node_name(node):
            raise CommitRecordError(f"stored under {node[:80]!r}, not a node name")
        if not isinstance(parts, list) or len(parts) > MAX_PARTS or not all(valid_node_name(p) for p in parts):
            raise CommitRecordError("parts must be a list of node names")
        if isinstance(at, bool) or not isinstance(at, int | float):
            raise CommitRecordError("at must be a number")
        return cls(node, step, attempt, tuple(parts), float(at))

    @classmethod
    def from_json(cls, node: str, data: bytes, job: str = "", key: bytes = b"") -> CommitRecord | None:
        """``parse``, or None when it is not a usable record (dropped, never trusted)."""
        try:
            return cls.parse(node, data, job, key)
        except CommitRecordError:
            return None


class CommitTable:
    """Reads and writes commit records under ``<prefix>commits/``; with the cluster ``key`` they
    are signed on write and checked on read (a failing one is counted in ``dropped`` and reported
    to ``on_drop`` once per revision)."""

    def __init__(self, client: EtcdClient, prefix: str, *, key: bytes = b"", on_drop: DropFn | None = None) -> None:
        self.client = client
        self.prefix = f"{prefix}commits/"
        self.key = key
        self.drops = RevisionDrops("commit record", on_drop)

    def read(self, job: str) -> dict[str, CommitRecord]:
        kvs, _ = self.client.get_prefix(f"{self.prefix}{job}/")
        out = {}
        for kv in kvs:
            node = kv.key.rsplit("/", 1)[-1]
            try:
                rec = CommitRecord.parse(node, kv.value, job, self.key)
            except CommitRecordError as exc:
                self.drops.drop(kv.key, kv.mod_revision, str(exc))
                continue
            out[node] = rec
        return out

    def write(self, job: str, rec: CommitRecord) -> None:
        self.client.put(f"{self.prefix}{job}/{rec.node}", rec.to_json(job, self.key))

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
