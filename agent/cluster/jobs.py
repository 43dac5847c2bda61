"""Job state in etcd, and moving the jobs of a lost node (the leader's healing decision).

One key per job, without a lease (it must outlive the node that ran it)::

    /trainguard/<cluster>/jobs/<job>  {"spec": {...}, "node": owner, "peer": node holding the
                                       owner's peer-tier copy, "state": "running"|"finished",
                                       "epoch": n, "cause": why it was (re)assigned}

Level-triggered, so a leader change in the middle changes nothing:

* every agent publishes the jobs it runs (owner = itself, peer = where its checkpoints go);
* the leader moves every running job whose owner is not a member any more to the owner's peer
  (which holds the newest memory checkpoint of that node in RAM) or, failing that, to the next
  member by name; epoch + 1, written with compare-and-swap on the key's revision and on the
  leader key still holding this leader under its lease (one txn: a deposed leader's move fails);
* the agent named owner of a running job it does not run submits it; its recovery service then
  restores from the newest verified checkpoint across tiers (the peer tier holds the lost node's
  copy in this agent's own RAM);
* an agent that still runs a job whose record names another owner with a newer epoch (it was cut
  off long enough to be declared lost) stops its copy: one job never runs twice. Before that, an
  agent whose lease went unrefreshed for ``cluster.fence_after_s`` has already fenced it on its
  own clock (``ClusterService.fence_check``), and starts it again only by claiming a new epoch.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from trainguard.agent.cluster.etcd import EtcdClient, compare_held, op_put
from trainguard.agent.cluster.membership import LeaderClaim
from trainguard.agent.cluster.records import DropFn, RevisionDrops, load_signed
from trainguard.agent.cluster.signing import sign
from trainguard.agent.wire import valid_job_id

log = logging.getLogger("trainguard.cluster.jobs")


MAX_RECORD_BYTES = 1 << 20
MAX_HISTORY = 20
MAX_TEXT = 500
MAX_DRAINED = 256
RECORD_DOMAIN = "job-record"
_NODE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_STATES = frozenset({"pending", "running", "paused", "stopped", "finished", "failed"})


class JobRecordError(ValueError):
    """A job record from etcd that is not used: malformed, out of bounds, or not signed by an agent."""


def valid_node_name(value: object) -> bool:
    """A node name, safe as one path segment (letters, digits, '.', '_', '-'; not '.' first)."""
    return isinstance(value, str) and _NODE.match(value) is not None


def _canonical(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def _node_name(value: Any, what: str, *, empty_ok: bool) -> str:
    if value in (None, "") and empty_ok:
        return ""
    if not isinstance(value, str) or not _NODE.match(value):
        raise JobRecordError(f"{what} is not a node name: {str(value)[:80]!r}")
    return value


def _text(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise JobRecordError(f"{what} must be a string")
    return value[:MAX_TEXT]


@dataclass(frozen=True)
class JobRecordDoc:
    job: str
    spec: dict[str, Any]
    node: str
    peer: str = ""
    state: str = "running"
    epoch: int = 0
    cause: str = ""
    history: list[str] = field(default_factory=list)
    plan: dict[str, Any] = field(default_factory=dict)
    """The owner's current plan settings (lr_scale, lr, batch_sizes): carried over on a move."""
    gang: dict[str, Any] = field(default_factory=dict)
    """Set for a job that spans nodes (``agent.cluster.gang``): placement and attempt state. Such
    records are the leader's and their nodes' business; the single-owner logic here skips them."""
    drained: list[str] = field(default_factory=list)
    """Nodes an operator drained this job off: the leader moves it away from them at its next
    restart point (now: the newest checkpoint) and never places it there again."""

    def to_json(self, key: bytes = b"") -> bytes:
        """The record as stored in etcd; with the cluster ``key`` it carries ``sig``, an HMAC over
        the rest, by which every agent knows an agent wrote it."""
        doc = asdict(self)
        if key:
            doc["sig"] = sign(key, RECORD_DOMAIN, _canonical(doc))
        return json.dumps(doc, sort_keys=True).encode()

    @classmethod
    def parse(cls, data: bytes, key: bytes = b"") -> JobRecordDoc:
        """Validate a stored record; with ``key`` its signature must check. Raises JobRecordError
        (one line) for anything an agent must not act on, before any path is built from it."""
        doc = load_signed(data, key=key, domain=RECORD_DOMAIN, payload=_canonical, max_bytes=MAX_RECORD_BYTES,
                          error=JobRecordError)
        job, spec = doc.get("job"), doc.get("spec")
        if not isinstance(job, str) or not valid_job_id(job):
            raise JobRecordError(f"bad job id {str(job)[:80]!r}")
        if not isinstance(spec, dict) or spec.get("job") != job:
            raise JobRecordError(f"spec of job {job} must be an object naming the same job")
        epoch = doc.get("epoch", 0)
        if isinstance(epoch, bool) or not isinstance(epoch, int) or not 0 <= epoch < 1 << 62:
            raise JobRecordError(f"job {job}: epoch must be a non-negative integer")
        state = doc.get("state", "running")
        if state not in _STATES:
            raise JobRecordError(f"job {job}: unknown state {str(state)[:40]!r}")
        history, drained = doc.get("history", []), doc.get("drained") or []
        plan, gang = doc.get("plan") or {}, doc.get("gang") or {}
        if not isinstance(history, list) or not isinstance(drained, list) or len(drained) > MAX_DRAINED:
            raise JobRecordError(f"job {job}: history and drained must be (short) lists")
        if not isinstance(plan, dict) or not isinstance(gang, dict):
            raise JobRecordError(f"job {job}: plan and gang must be objects")
        return cls(job=job, spec=spec, node=_node_name(doc.get("node"), "node", empty_ok=True),
                   peer=_node_name(doc.get("peer"), "peer", empty_ok=True), state=state, epoch=epoch,
                   cause=_text(doc.get("cause", ""), "cause"),
                   history=[_text(h, "history entry") for h in history][-MAX_HISTORY:],
                   plan=plan, gang=gang,
                   drained=[_node_name(n, "drained node", empty_ok=False) for n in drained])

    @classmethod
    def from_json(cls, data: bytes, key: bytes = b"") -> JobRecordDoc | None:
        """``parse``, or None for a record that is not used."""
        try:
            return cls.parse(data, key)
        except JobRecordError:
            return None


def shrink_spec(spec: dict[str, Any], slots: int) -> tuple[dict[str, Any], str]:
    """Fit a job into ``slots`` ranks by lowering its data-parallel degree (tp x pp kept whole).

    Returns the new spec and a one-line reason ("" when unchanged). A node that cannot hold one
    model replica (tp x pp > slots) gets the spec unchanged; the launch there fails loudly.
    """
    nproc = int(spec.get("nproc", 1))
    if slots <= 0 or nproc <= slots:
        return spec, ""
    trainer = dict(spec.get("trainer", {}))
    parallel = dict(trainer.get("parallel", {}))
    tp, pp = int(parallel.get("tp", 1)), int(parallel.get("pp", 1))
    replica = tp * pp
    if replica > slots:
        return spec, ""
    dp = slots // replica
    parallel["dp"] = dp
    trainer["parallel"] = parallel
    new = {**spec, "nproc": dp * replica, "trainer": trainer}
    return new, f"dp {nproc // replica} -> {dp} to fit {slots} slots"


@dataclass(frozen=True)
class Move:
    job: str
    src: str
    dst: str
    epoch: int
    reason: str


def plan_moves(records: dict[str, tuple[JobRecordDoc, int]], members: dict[str, int]) -> list[tuple[JobRecordDoc, int, Move]]:
    """Which running jobs to move where. ``records``: job -> (record, mod_revision);
    ``members``: node -> slots. Pure: the leader applies the result with CAS."""
    out: list[tuple[JobRecordDoc, int, Move]] = []
    names = sorted(members)
    if not names:
        return out
    for job, (rec, rev) in sorted(records.items()):
        eligible = [n for n in names if n not in rec.drained]
        if rec.state != "running" or rec.node in eligible or rec.gang or not eligible:
            continue
        if rec.peer in eligible:
            dst = rec.peer
        else:
            after = [n for n in eligible if n > rec.node]
            dst = after[0] if after else eligible[0]
        spec, why = shrink_spec(rec.spec, members[dst])
        plan = dict(rec.plan)
        if why:
            plan.pop("batch_sizes", None)  # one size per dp rank: the old split does not fit the new dp
        cause = f"node {rec.node} drained" if rec.node in members else f"node {rec.node} lost"
        new = replace(rec, spec=spec, plan=plan, node=dst, epoch=rec.epoch + 1, cause=cause,
                      history=[*rec.history, f"{rec.node}->{dst}"][-20:])
        out.append((new, rev, Move(job, rec.node, dst, new.epoch, why)))
    return out


class JobTable:
    """Reads and writes job records under ``<prefix>jobs/``.

    With the cluster ``key`` every record written is signed and a record read is used only when
    its signature checks (so an etcd writer without the key cannot make an agent run anything); a
    record that fails (``JobRecordDoc.parse``) is left out, counted in ``dropped`` and reported to
    ``on_drop`` once per revision."""

    def __init__(self, client: EtcdClient, prefix: str, *, key: bytes = b"", on_drop: DropFn | None = None) -> None:
        self.client = client
        self.prefix = f"{prefix}jobs/"
        self.key = key
        self.drops = RevisionDrops("job record", on_drop)
        # job -> revision of a refused record under its key: a writer that finds no usable record
        # may replace it (a forged record must not block the real one forever).
        self._refused_rev: dict[str, int] = {}
        self.refused = 0
        """Guarded leader writes etcd turned down (the record changed, or the claim no longer holds)."""

    def read(self) -> dict[str, tuple[JobRecordDoc, int]]:
        kvs, _ = self.client.get_prefix(self.prefix)
        out = {}
        refused: dict[str, int] = {}
        for kv in kvs:
            try:
                rec = JobRecordDoc.parse(kv.value, self.key)
                if self.prefix + rec.job != kv.key:
                    raise JobRecordError(f"record of job {rec.job} stored under another key")
            except JobRecordError as exc:
                self.drops.drop(kv.key, kv.mod_revision, str(exc))
                name = kv.key[len(self.prefix):]
                if valid_job_id(name):
                    refused[name] = kv.mod_revision
                continue
            out[rec.job] = (rec, kv.mod_revision)
        self._refused_rev = refused
        return out

    def write(self, rec: JobRecordDoc, expect_revision: int | None, *, leader: LeaderClaim | None = None) -> bool:
        """Put the record; with ``expect_revision`` only if nobody changed it since (0: absent).
        ``leader``: a leader's decision, written only while the leader key still holds that claim
        (one txn), so a deposed leader's late decision never lands."""
        key = self.prefix + rec.job
        data = rec.to_json(self.key)
        if expect_revision == 0:
            expect_revision = self._refused_rev.get(rec.job, 0)
        if leader is not None:
            guards = compare_held(leader.key, leader.node, leader.lease)
            if expect_revision is None:
                ok = bool(self.client.txn(guards, [op_put(key, data)]).get("succeeded"))
            else:
                ok = self.client.put_if(key, data, expect_revision, guards)
            self.refused += not ok
            return ok
        if expect_revision is None:
            self.client.put(key, data)
            return True
        return self.client.replace(key, data, expect_revision)


ApplyFn = Callable[[Move], None]
