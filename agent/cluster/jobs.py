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
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from trainguard.agent.cluster.etcd import EtcdClient, compare_held, op_put
from trainguard.agent.cluster.membership import LeaderClaim

log = logging.getLogger("trainguard.cluster.jobs")


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

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> JobRecordDoc | None:
        try:
            doc = json.loads(data)
            return cls(job=str(doc["job"]), spec=dict(doc["spec"]), node=str(doc["node"]),
                       peer=str(doc.get("peer", "")), state=str(doc.get("state", "running")),
                       epoch=int(doc.get("epoch", 0)), cause=str(doc.get("cause", "")),
                       history=[str(h) for h in doc.get("history", [])][-20:],
                       plan=dict(doc.get("plan") or {}), gang=dict(doc.get("gang") or {}),
                       drained=[str(n) for n in doc.get("drained") or []])
        except (ValueError, KeyError, TypeError):
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
    """Reads and writes job records under ``<prefix>jobs/``."""

    def __init__(self, client: EtcdClient, prefix: str) -> None:
        self.client = client
        self.prefix = f"{prefix}jobs/"
        self.refused = 0
        """Guarded leader writes etcd turned down (the record changed, or the claim no longer holds)."""

    def read(self) -> dict[str, tuple[JobRecordDoc, int]]:
        kvs, _ = self.client.get_prefix(self.prefix)
        out = {}
        for kv in kvs:
            rec = JobRecordDoc.from_json(kv.value)
            if rec is not None:
                out[rec.job] = (rec, kv.mod_revision)
        return out

    def write(self, rec: JobRecordDoc, expect_revision: int | None, *, leader: LeaderClaim | None = None) -> bool:
        """Put the record; with ``expect_revision`` only if nobody changed it since (0: absent).
        ``leader``: a leader's decision, written only while the leader key still holds that claim
        (one txn), so a deposed leader's late decision never lands."""
        key = self.prefix + rec.job
        if leader is not None:
            guards = compare_held(leader.key, leader.node, leader.lease)
            if expect_revision is None:
                ok = bool(self.client.txn(guards, [op_put(key, rec.to_json())]).get("succeeded"))
            else:
                ok = self.client.put_if(key, rec.to_json(), expect_revision, guards)
            self.refused += not ok
            return ok
        if expect_revision is None:
            self.client.put(key, rec.to_json())
            return True
        return self.client.replace(key, rec.to_json(), expect_revision)


ApplyFn = Callable[[Move], None]
