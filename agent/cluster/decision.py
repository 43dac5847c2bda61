"""A spanning job's ``gang`` record and the leader's decision over it, pure (inputs in, record out).

``decide`` turns a pending record, a restart request of the current attempt, or a lost node into
the next attempt. Everything it needs from the outside comes in as arguments: the live members,
what a survey of them found (``find_restore``, ``DecisionInputs.unreachable``), when each lost
node was first seen missing, and the job's commit records. The I/O lives in
``gang.GangCoordinator``; the record's fields are described in ``agent.cluster.gang``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

from trainguard.agent.cluster.jobs import JobRecordDoc
from trainguard.agent.cluster.lineage import CommitRecord, newer_elsewhere
from trainguard.agent.cluster.placement import Placement, PlacementError, place

if TYPE_CHECKING:
    from trainguard.agent.cluster.membership import NodeInfo


@dataclass
class Gang:
    attempt: int = 0
    blocks: list[list[Any]] = field(default_factory=list)
    dp: int = 0
    tp: int = 1
    pp: int = 1
    master_addr: str = ""
    master_port: int = 0
    restore_step: int = -1
    sources: dict[str, list[str]] = field(default_factory=dict)
    requests: dict[str, dict[str, Any]] = field(default_factory=dict)
    done: dict[str, str] = field(default_factory=dict)
    nodes_seen: list[str] = field(default_factory=list)
    stalls: int = 0
    """Consecutive restarts that restored the same step (no progress): the crash-loop guard."""
    failed_at: float = 0.0
    """Wall time of the failure that led to this attempt (for the recovery clock)."""
    want_dp: int = 0
    """The data-parallel degree as submitted: a job shrunk by a node loss grows back towards it
    at its next restart point when nodes have returned (``cluster.rejoin``)."""
    lineage_wait: dict[str, Any] = field(default_factory=dict)
    """Set while the leader waits for a node that holds part of a newer committed step:
    {"since", "until", "step", "nodes", "restorable", "cause"} (kept across leader changes)."""
    given_up: dict[str, Any] = field(default_factory=dict)
    """Set on the attempt that went on without newer committed steps: {"restore_step", "newest",
    "committed" (node -> step), "unreachable", "waited_s"}."""
    lineage_floor: int = 0
    """Commit records of attempts below this one belong to a lineage given up; they are ignored."""
    abandoned: list[list[float]] = field(default_factory=list)
    """[restore step, leader's wall time] of each give-up: copies of later steps committed before
    that moment are the branch given up and never restored (a node that returns with them would
    otherwise fork the lineage)."""

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> Gang:
        names = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in doc.items() if k in names})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def master_node(self) -> str:
        return str(self.blocks[0][0]) if self.blocks else ""

    @property
    def nodes(self) -> list[str]:
        return [str(b[0]) for b in self.blocks]

    def block_of(self, node: str) -> tuple[int, int, int] | None:
        """(group rank, first global rank, ranks) of ``node`` in this attempt."""
        for i, (n, offset, nproc) in enumerate(self.blocks):
            if n == node:
                return i, int(offset), int(nproc)
        return None

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp


def _layout(spec: dict[str, Any]) -> tuple[int, int, int]:
    par = (spec.get("trainer") or {}).get("parallel") or {}
    tp, pp = int(par.get("tp", 1)), int(par.get("pp", 1))
    dp = int(par.get("dp", int(spec.get("nproc", 1)) // max(1, tp * pp)))
    return dp, tp, pp


def place_gang(spec: dict[str, Any], slots: dict[str, int], *, want_dp: int = 0,
               first: str | None = None) -> tuple[dict[str, Any], Placement, str]:
    """Place a spanning job on the live nodes: spread over ``spec['nodes']`` nodes when they have
    room, else pack; lower dp (never tp or pp) until it fits, starting from ``want_dp`` when given
    (a shrunk job grows back). ``first``: the node for global rank 0 (the leader: job-wide
    decisions and the plan live with rank 0). Returns (spec for this attempt, placement, note on
    what changed). Raises PlacementError when not one model replica fits."""
    dp0, tp, pp = _layout(spec)
    want_nodes = max(1, int(spec.get("nodes", 1)))
    for dp in range(max(want_dp, dp0), 0, -1):
        world = dp * tp * pp
        share = -(-world // want_nodes)  # even spread, in whole tp groups
        share = -(-share // tp) * tp
        spread = {n: min(s, share) if s else share for n, s in slots.items()}
        packed = {n: s if s else share for n, s in slots.items()}
        for room in (spread, packed):
            try:
                placement = place(dp, tp, pp, room, first=first)
            except PlacementError:
                continue
            new = spec
            note = ""
            if dp != dp0:
                trainer = dict(spec.get("trainer") or {})
                trainer["parallel"] = {**(trainer.get("parallel") or {}), "dp": dp, "tp": tp, "pp": pp}
                new = {**spec, "nproc": world, "trainer": trainer}
                note = f"dp {dp0} -> {dp} " + ("to fit the live nodes" if dp < dp0 else "as nodes rejoined")
            return new, placement, note
    raise PlacementError(f"no live node set holds one replica of tp={tp} x pp={pp} (slots {slots})")


RestoreFinder = Callable[[JobRecordDoc, Gang, dict[str, str], int | None], tuple[int, dict[str, list[str]]]]


@dataclass(frozen=True)
class DecisionInputs:
    """What the leader learned before a decision (the caller does the I/O; ``decide`` stays pure)."""

    unreachable: frozenset[str] = frozenset()
    """Members whose API did not answer within this decision's deadline: not placed."""
    missing_since: dict[str, float] = field(default_factory=dict)
    """When the leader first saw each lost node's key gone (its clock)."""
    fence_grace_s: float = 0.0
    """A lost node's blocks are re-placed only this long after it was first seen missing."""
    commits: dict[str, CommitRecord] = field(default_factory=dict)
    """The job's commit records (node -> newest committed step of its part)."""
    lineage_wait_s: float = 0.0
    """Longest wait for an unreachable node that holds part of a newer committed step."""


def trigger(rec: JobRecordDoc, members: dict[str, NodeInfo], now: float,
            inputs: DecisionInputs | None = None) -> tuple[str, str] | None:
    """Why the leader must act on this job: ("place", cause), ("finished", cause), ("grace",
    why it waits), or None. Pure and cheap: the leader surveys members only for "place"."""
    inputs = inputs or DecisionInputs()
    g = Gang.from_dict(rec.gang)
    drained = [n for n in g.nodes if n in members and n in rec.drained]
    members = {n: i for n, i in members.items() if n not in rec.drained}
    if rec.state == "pending":
        return "place", str(g.lineage_wait.get("cause") or rec.cause or "submitted")
    if rec.state != "running":
        return None
    lost = [n for n in g.nodes if n not in members and n not in drained]
    requests = {n: r for n, r in g.requests.items() if r.get("attempt") == g.attempt}
    if lost:
        # The lost node fences its own ranks before its TTL ends; its key went at the TTL; the grace
        # after the leader first saw it gone makes sure they stopped before new ranks start.
        early = [n for n in lost if now - inputs.missing_since.get(n, now) < inputs.fence_grace_s]
        if early:
            return "grace", f"node {', '.join(early)} lost; re-placing after {inputs.fence_grace_s:g} s of grace"
        return "place", f"node {', '.join(lost)} lost"
    if drained:
        return "place", f"node {', '.join(drained)} drained"
    if requests:
        node, first = sorted(requests.items())[0]
        return "place", f"{node}: {first.get('cause', 'ranks failed')}"
    if g.blocks and all(g.done.get(n) == "succeeded" for n in g.nodes):
        return "finished", "every node's ranks finished"
    return None


def decide(rec: JobRecordDoc, members: dict[str, NodeInfo], find_restore: RestoreFinder,
           now: float, *, leader: str | None = None, rejoin: bool = True,
           inputs: DecisionInputs | None = None) -> tuple[JobRecordDoc, str] | None:
    """The leader's decision for one spanning job: (new record, what happened) or None.
    ``leader`` gets global rank 0 when it has room; ``rejoin``: grow back to the submitted dp;
    ``inputs``: what the leader's survey and records said (unreachable members, loss times,
    commit records)."""
    inputs = inputs or DecisionInputs()
    why = trigger(rec, members, now, inputs)
    if why is None or why[0] == "grace":
        return None
    kind, cause = why
    if kind == "finished":
        return replace(rec, state="finished", cause=cause), "finished"
    g = Gang.from_dict(rec.gang)
    # Every member that answers may hold checkpoint parts; a node an operator drained this job off
    # is no member for placing it (it is never placed there again).
    holders = {n: i.api for n, i in members.items() if n not in inputs.unreachable}
    members = {n: i for n, i in members.items() if n not in rec.drained}
    requests = {n: r for n, r in g.requests.items() if r.get("attempt") == g.attempt}
    failed_at = float(g.lineage_wait.get("failed_at", now))  # a wait does not restart the recovery clock
    if rec.state == "running":
        failed_at = min([float(r.get("at", now)) for r in requests.values()] + [now])
    bad = [int(r["bad_step"]) for r in g.requests.values()
           if r.get("attempt") == g.attempt and isinstance(r.get("bad_step"), int)]
    max_step = min(bad) - 1 if bad else None
    placeable = {n: i for n, i in members.items() if n not in inputs.unreachable}
    step, sources = find_restore(rec, g, holders, max_step) if g.nodes_seen else (-1, {})
    given_up: dict[str, Any] = {}
    newer = newer_elsewhere(step, inputs.commits, set(holders), max_step=max_step,
                            floor=g.lineage_floor) if g.nodes_seen else None
    if newer is not None:
        since = float(g.lineage_wait.get("since", now))
        if newer.waitable and now - since < inputs.lineage_wait_s:
            if g.lineage_wait and rec.state == "pending":
                return None  # already waiting; the record says so
            nodes = ", ".join(newer.unreachable)
            have = f"step {step}" if step >= 0 else "no checkpoint"
            wait = {"since": since, "until": since + inputs.lineage_wait_s, "step": newer.step,
                    "nodes": list(newer.unreachable), "restorable": step, "cause": cause, "failed_at": failed_at}
            text = (f"waiting: step {newer.step} was committed and part of it is only on {nodes} (unreachable); "
                    f"restorable now: {have}; waiting up to {inputs.lineage_wait_s:g} s for {nodes} ({cause})")
            return replace(rec, state="pending", cause=text, gang=replace(g, lineage_wait=wait).to_dict()), text
        given_up = {"restore_step": step, "newest": newer.step, "committed": newer.committed,
                    "unreachable": list(newer.unreachable),
                    "waited_s": round(now - since, 3) if g.lineage_wait else 0.0}
    stalls = g.stalls + 1 if (rec.state == "running" or g.lineage_wait) and step == g.restore_step else 0
    max_restarts = int(rec.spec.get("max_restarts", 3))
    if stalls > max_restarts:
        return (replace(rec, state="failed", cause=f"crash loop: {stalls - 1} restarts from step {step} "
                        f"without progress ({cause})"), "failed")
    want_dp = g.want_dp or _layout(rec.spec)[0]
    slots = {n: i.slots for n, i in placeable.items()}
    try:
        spec, placement, note = place_gang(rec.spec, slots, want_dp=want_dp if rejoin else 0, first=leader)
    except PlacementError as exc:
        if rec.state == "pending" and rec.cause == f"waiting: {exc}":
            return None
        return replace(rec, state="pending", cause=f"waiting: {exc}"), f"cannot place: {exc}"
    # A node whose ranks could not start in this attempt sits the next one out when the others
    # hold the job at the same size.
    avoid = sorted(n for n, r in requests.items() if r.get("start_failed") and placement.block(n) is not None)
    if avoid:
        try:
            alt = place_gang(rec.spec, {n: s for n, s in slots.items() if n not in avoid},
                             want_dp=want_dp if rejoin else 0, first=leader)
        except PlacementError:
            alt = None
        if alt is not None and alt[1].dp == placement.dp:
            spec, placement, note = alt
            note = "; ".join(x for x in (note, f"{', '.join(avoid)} left out (ranks could not start there)") if x)
    left_out = sorted(n for n in inputs.unreachable if n in members)
    if left_out:
        note = "; ".join(x for x in (note, f"{', '.join(left_out)} not placed (API did not answer)") if x)
    master = placement.master_node
    host = holders.get(master, "").rsplit(":", 1)[0] or "127.0.0.1"
    seen = list(dict.fromkeys([*g.nodes_seen, *(b.node for b in placement.blocks)]))
    attempt = g.attempt + 1
    new_gang = Gang(attempt=attempt, blocks=[[b.node, b.rank_offset, b.nproc] for b in placement.blocks],
                    dp=placement.dp, tp=placement.tp, pp=placement.pp, master_addr=host, master_port=0,
                    restore_step=step, sources=sources, nodes_seen=seen, stalls=stalls,
                    failed_at=failed_at, want_dp=want_dp, given_up=given_up,
                    lineage_floor=attempt if given_up else g.lineage_floor,
                    abandoned=([*g.abandoned, [step, now]] if given_up else g.abandoned)[-8:])
    what = f"attempt {new_gang.attempt}: {placement.describe()}" + (f"; {note}" if note else "") \
        + (f"; restore step {step}" if step >= 0 else "; no checkpoint, from step 0")
    history = [*rec.history, f"attempt {new_gang.attempt}: {cause}"]
    if given_up:
        history.append(f"attempt {attempt}: gave up steps {step + 1}-{newer.step if newer else step} "
                       f"({', '.join(f'{n}: {s}' for n, s in given_up['committed'].items())})")
    return replace(rec, spec=spec, node=master, state="running", cause=cause, history=history[-20:],
                   gang=new_gang.to_dict()), what
