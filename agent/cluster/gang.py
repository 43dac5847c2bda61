"""Jobs that span nodes: one leader-made placement per attempt, all nodes' ranks restarted
together, checkpoints written in per-node parts and put back together before a restore.

The job's etcd record (``jobs/<job>``, a ``JobRecordDoc``) carries a ``gang`` object::

    attempt      leader-numbered attempt; every node (re)starts its ranks when it grows
    blocks       [[node, first global rank, ranks], ...] of this attempt (tp groups never split)
    dp tp pp     the layout of this attempt (dp shrinks when nodes are lost)
    master_addr  the node holding global rank 0 (its advertised host): torch's c10d TCPStore
    master_port  chosen by that node when it sees the attempt (0 until then: others wait)
    restore_step checkpoint step every node restores (-1: from scratch), chosen by the leader
    sources      {part node: [nodes holding that part at restore_step]}, best first
    requests     {node: {"attempt", "cause", "bad_step"}}: a node's ranks failed, restart please
    done         {node: "succeeded"} for the current attempt
    nodes_seen   every node that ever held ranks (whose checkpoint parts may be needed)

Level-triggered like the rest of the job records: the leader (``decide``) turns a pending record,
a restart request of the current attempt, or a lost node into the next attempt; every agent
(``GangCoordinator.sync``) starts its block of the newest attempt, writes its requests and
completion, and stops ranks that the newest attempt no longer gives it. Writes use compare-and-
swap on the key's revision, so concurrent writers retry on the next change instead of clobbering.

Checkpoints: each node's local rank 0 commits that node's DCP files to its own memory tier under
``part_key(job, node)`` with the attempt's node list in the manifest (``trainguard/checkpointing.py``); the
replicator copies the part to the ring peer's RAM like any memory checkpoint. To restore step S
the leader looks up, for every part of S, which live nodes hold it (the writer's own memory tier
over the blob API, or a peer's held copy); each node then downloads the missing parts, checks
every file against its part's manifest and merges them into one directory: the full DCP
checkpoint, resharded by DCP on load when dp changed.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainguard.agent import health
from trainguard.agent.checkpoint.errors import CheckpointError
from trainguard.agent.checkpoint.manifest import MANIFEST_NAME, Manifest, read_manifest
from trainguard.agent.checkpoint.tier import Tier, step_dirname
from trainguard.agent.cluster.blobstore import CKPT_NS, INDEX, BlobStore
from trainguard.agent.cluster.jobs import JobRecordDoc, JobTable
from trainguard.agent.cluster.peertier import ClientFactory, PeerRef, fetch_remote_copy
from trainguard.agent.cluster.placement import Placement, PlacementError, place
from trainguard.agent.controller.batch_rule import follow_batch
from trainguard.agent.wire import Telemetry, WireError, decode_telemetry, part_key

if TYPE_CHECKING:
    from trainguard.agent.cluster.membership import EmitFn, NodeInfo
    from trainguard.agent.lifecycle.plans import PlanStore
    from trainguard.agent.lifecycle.supervisor import Supervisor

log = logging.getLogger("trainguard.cluster.gang")
TIER_HOLDER = "tier:"
"""Prefix of a holder that is a tier every node reaches (the object store), not a node."""


def decode_forwarded(job: str, messages: list[Any]) -> tuple[list[Telemetry], int]:
    """The messages another node forwarded for ``job``: (valid ones, how many were dropped)."""
    good, dropped = [], 0
    for raw in messages:
        try:
            msg = decode_telemetry(raw.encode() if isinstance(raw, str) else b"")
        except WireError:
            dropped += 1
            continue
        if msg.job != job:
            dropped += 1
            continue
        good.append(msg)
    return good, dropped


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


def decide(rec: JobRecordDoc, members: dict[str, NodeInfo], find_restore: RestoreFinder,
           now: float, *, leader: str | None = None, rejoin: bool = True) -> tuple[JobRecordDoc, str] | None:
    """The leader's decision for one spanning job: (new record, what happened) or None.
    ``leader`` gets global rank 0 when it has room; ``rejoin``: grow back to the submitted dp."""
    g = Gang.from_dict(rec.gang)
    failed_at = now
    # A node an operator drained this job off is no member for it (it is never placed there again).
    drained = [n for n in g.nodes if n in members and n in rec.drained]
    members = {n: i for n, i in members.items() if n not in rec.drained}
    if rec.state == "pending":
        cause = rec.cause or "submitted"
    elif rec.state == "running":
        lost = [n for n in g.nodes if n not in members and n not in drained]
        requests = {n: r for n, r in g.requests.items() if r.get("attempt") == g.attempt}
        failed_at = min([float(r.get("at", now)) for r in requests.values()] + [now])
        if lost:
            cause = f"node {', '.join(lost)} lost"
        elif drained:
            cause = f"node {', '.join(drained)} drained"
        elif requests:
            node, first = sorted(requests.items())[0]
            cause = f"{node}: {first.get('cause', 'ranks failed')}"
        elif g.blocks and all(g.done.get(n) == "succeeded" for n in g.nodes):
            return replace(rec, state="finished", cause="every node's ranks finished"), "finished"
        else:
            return None
    else:
        return None
    bad = [int(r["bad_step"]) for r in g.requests.values()
           if r.get("attempt") == g.attempt and isinstance(r.get("bad_step"), int)]
    max_step = min(bad) - 1 if bad else None
    apis = {n: i.api for n, i in members.items()}
    step, sources = find_restore(rec, g, apis, max_step) if g.nodes_seen else (-1, {})
    stalls = g.stalls + 1 if rec.state == "running" and step == g.restore_step else 0
    max_restarts = int(rec.spec.get("max_restarts", 3))
    if stalls > max_restarts:
        return (replace(rec, state="failed", cause=f"crash loop: {stalls - 1} restarts from step {step} "
                        f"without progress ({cause})"), "failed")
    want_dp = g.want_dp or _layout(rec.spec)[0]
    try:
        spec, placement, note = place_gang(rec.spec, {n: i.slots for n, i in members.items()},
                                           want_dp=want_dp if rejoin else 0, first=leader)
    except PlacementError as exc:
        if rec.state == "pending" and rec.cause == f"waiting: {exc}":
            return None
        return replace(rec, state="pending", cause=f"waiting: {exc}"), f"cannot place: {exc}"
    master = placement.master_node
    host = apis.get(master, "").rsplit(":", 1)[0] or "127.0.0.1"
    seen = list(dict.fromkeys([*g.nodes_seen, *(b.node for b in placement.blocks)]))
    new_gang = Gang(attempt=g.attempt + 1, blocks=[[b.node, b.rank_offset, b.nproc] for b in placement.blocks],
                    dp=placement.dp, tp=placement.tp, pp=placement.pp, master_addr=host, master_port=0,
                    restore_step=step, sources=sources, nodes_seen=seen, stalls=stalls,
                    failed_at=failed_at, want_dp=want_dp)
    what = f"attempt {new_gang.attempt}: {placement.describe()}" + (f"; {note}" if note else "") \
        + (f"; restore step {step}" if step >= 0 else "; no checkpoint, from step 0")
    history = [*rec.history, f"attempt {new_gang.attempt}: {cause}"][-20:]
    return replace(rec, spec=spec, node=master, state="running", cause=cause, history=history,
                   gang=new_gang.to_dict()), what


def _sorted_holders(part: str, holders: list[str]) -> list[str]:
    """The writer itself first (its RAM, no copy), then nodes holding copies, shared tiers last."""
    return sorted(set(holders), key=lambda n: (n != part, n.startswith(TIER_HOLDER), n))


class GangCoordinator:
    """This agent's side of spanning jobs (leader decisions and the local block)."""

    def __init__(self, node: str, table: JobTable, store: BlobStore, client_for: ClientFactory, *,
                 scratch: str, emit: EmitFn, is_leader: Callable[[], bool],
                 members: Callable[[], dict[str, NodeInfo]], wake: Callable[[], None],
                 on_restart: Callable[[str, float], None] | None = None,
                 clock: Callable[[], float] = time.time, rejoin: bool = True) -> None:
        self.node = node
        self.table = table
        self.store = store
        self.client_for = client_for
        self.scratch = Path(scratch)
        self.emit = emit
        self.is_leader = is_leader
        self.members = members
        self.wake = wake
        self.on_restart = on_restart
        self.clock = clock
        self.rejoin = rejoin
        self.supervisor: Supervisor | None = None
        self.plans: PlanStore | None = None
        """This agent's plan store: the rank-0 node publishes the job's plan settings to the record
        so that a new rank-0 node (after a node loss) starts from them."""
        self.lr_batch_rule = "sqrt"
        """How the LR follows a global batch the carry-over changes (controller.lr_batch_rule)."""
        self.shared_tiers: list[Tier] = []
        """Tiers every node reaches (the object store): the last resort for a part no live node holds."""
        self._launched: dict[str, int] = {}
        self._requests: dict[str, dict[str, Any]] = {}
        self.decisions = 0
        self.last: dict[str, dict[str, Any]] = {}
        # Telemetry of local ranks of jobs whose rank 0 runs elsewhere: job -> master node.
        self._forward_to: dict[str, str] = {}
        self._outbox: dict[str, deque[str]] = {}
        self._forwarder: threading.Thread | None = None
        self._stop = threading.Event()
        self.forward_interval_s = 0.25
        self.evidence_for: Callable[[str], dict[str, Any]] | None = None
        """This node's evidence on its ranks of a job (the straggler service's local_evidence):
        the judging node cannot read another node's /proc."""
        self.forwarded = 0
        self.forward_dropped = 0

    # -- telemetry forwarding ----------------------------------------------------------------------
    def on_telemetry(self, msg: Telemetry) -> None:
        """TelemetryServer hook (receiver thread): queue messages of ranks whose judge is elsewhere."""
        if msg.job in self._forward_to:
            box = self._outbox.get(msg.job)
            if box is None:
                box = self._outbox.setdefault(msg.job, deque(maxlen=8192))
            if len(box) == box.maxlen:
                self.forward_dropped += 1
            box.append(msg.encode().decode())

    def _forward_loop(self) -> None:
        while not self._stop.wait(self.forward_interval_s):
            health.beat(self, "gang-telemetry")
            self.flush_forward()

    def flush_forward(self) -> None:
        """One batch per job to the node holding its rank 0 (per node, not per rank: the leader's
        and the judge's load grows with nodes, not with ranks)."""
        apis = {n: i.api for n, i in self.members().items()}
        for job, master in list(self._forward_to.items()):
            box = self._outbox.get(job)
            if not box:
                continue
            batch = [box.popleft() for _ in range(len(box))]
            api = apis.get(master)
            try:
                if api is None:
                    raise ConnectionError(f"{master} is not a member")
                evidence = self.evidence_for(job) if self.evidence_for is not None else None
                self.client_for(PeerRef(master, api)).forward_telemetry(job, self.node, batch, evidence)
                self.forwarded += len(batch)
            except Exception as exc:  # noqa: BLE001 - telemetry is best effort; counted, never fatal
                self.forward_dropped += len(batch)
                log.info("gang %s: telemetry to %s dropped (%d messages): %s", job, master, len(batch), exc)

    def stop(self) -> None:
        self._stop.set()
        if self._forwarder is not None:
            self._forwarder.join(2.0)

    # -- submission --------------------------------------------------------------------------------
    def submit(self, spec: dict[str, Any]) -> None:
        """Record a new spanning job for the leader to place (ValueError if it is active)."""
        job = str(spec["job"])
        cur = self.table.read().get(job)
        if cur is not None and cur[0].state in ("pending", "running", "paused"):
            raise ValueError(f"job {job} is already {cur[0].state} in the cluster")
        rec = JobRecordDoc(job, spec, "", "", "pending", 0, "submitted", [f"submitted at {self.node}"],
                           gang=Gang().to_dict())
        if not self.table.write(rec, cur[1] if cur is not None else 0):
            raise ValueError(f"job {job} was submitted concurrently")
        self.wake()

    def is_spanning(self, job: str) -> bool:
        local = self.supervisor.jobs.get(job) if self.supervisor is not None else None
        return job in self.last or (local is not None and local.block is not None)

    def stop_job(self, job: str, reason: str) -> None:
        """Mark the job stopped in etcd; every node stops its ranks when it sees that."""
        for _ in range(5):
            cur = self.table.read().get(job)
            if cur is None:
                raise ValueError(f"job {job} has no cluster record")
            rec, rev = cur
            if rec.state in ("finished", "failed", "stopped"):
                return
            if self.table.write(replace(rec, state="stopped", cause=f"stopped: {reason}"), rev):
                self.wake()
                return
        raise ValueError(f"job {job}: its record kept changing; try again")

    # -- the loop ----------------------------------------------------------------------------------
    def sync(self, records: dict[str, tuple[JobRecordDoc, int]]) -> None:
        gangs = {j: r for j, r in records.items() if r[0].gang}
        self.last = {j: {"state": r.state, "cause": r.cause, "plan": r.plan, **Gang.from_dict(r.gang).to_dict()}
                     for j, (r, _) in gangs.items()}
        if self.is_leader():
            members = self.members()
            for job, (rec, rev) in sorted(gangs.items()):
                try:
                    out = decide(rec, members, self.find_restore, self.clock(), leader=self.node, rejoin=self.rejoin)
                except Exception as exc:  # noqa: BLE001 - one bad record must not stop the others
                    log.exception("gang %s: decision failed: %s", job, exc)
                    continue
                if out is None:
                    continue
                new, what = out
                if self.table.write(new, rev):
                    self.decisions += 1
                    gangs[job] = (new, -1)  # written: act on it at the next change (fresh revision)
                    placed = Gang.from_dict(new.gang)
                    self.emit("gang_placed" if new.state == "running" else f"gang_{new.state}",
                              f"job {job}: {what}" + (f" (cause: {new.cause})" if new.state == "running" else ""),
                              {"job": job, "attempt": placed.attempt, "cause_": new.cause,
                               "restore_step": placed.restore_step,
                               "severity": "warning" if new.state in ("failed",) or "lost" in new.cause else "info"})
        for job, (rec, rev) in sorted(gangs.items()):
            if rev < 0:
                continue
            try:
                self._member(rec, rev)
            except Exception as exc:  # noqa: BLE001
                log.exception("gang %s: local step failed: %s", job, exc)

    def on_local_failure(self, job: str, cause: str) -> None:
        """Supervisor hook (any thread): this node's ranks failed; ask the leader for a restart."""
        # The attempt of the ranks that failed, not the newest launched: ranks of an old attempt
        # that die while the next one is being assembled must not order yet another restart.
        local = self.supervisor.jobs.get(job) if self.supervisor is not None else None
        attempt = local.block.attempt if local is not None and local.block is not None else 0
        self._requests[job] = {"attempt": attempt, "cause": cause, "bad_step": None, "at": self.clock()}
        self.wake()

    def _write_gang(self, rec: JobRecordDoc, rev: int, g: Gang) -> bool:
        return self.table.write(replace(rec, gang=g.to_dict()), rev)

    def _member(self, rec: JobRecordDoc, rev: int) -> None:
        assert self.supervisor is not None
        from trainguard.agent.lifecycle.jobs import JobState

        job = rec.job
        g = Gang.from_dict(rec.gang)
        local = self.supervisor.jobs.get(job)
        running_here = local is not None and not local.state.finished
        if rec.state in ("finished", "failed", "stopped"):
            self._forward_to.pop(job, None)
            if running_here and rec.state != "finished":
                self.supervisor.stop(job, f"cluster: job {rec.state} ({rec.cause})")
            return
        if rec.state != "running":
            return
        mine = g.block_of(self.node)
        req = self._requests.get(job)
        if req is not None and req["attempt"] == g.attempt and mine is not None:
            if g.requests.get(self.node) != req:
                g.requests[self.node] = req
                if self._write_gang(rec, rev, g):
                    self._requests.pop(job, None)
                return
            self._requests.pop(job, None)
        elif req is not None and req["attempt"] < g.attempt:
            self._requests.pop(job, None)  # superseded by a newer attempt
        if mine is None:
            self._forward_to.pop(job, None)
            if running_here:
                self.supervisor.stop(job, f"cluster: attempt {g.attempt} places no ranks on {self.node}")
                self.emit("gang_left", f"job {job}: attempt {g.attempt} runs on {', '.join(g.nodes)}; "
                          f"stopping the ranks here", {"job": job, "severity": "warning"})
            return
        launched = self._launched.get(job, 0)
        if launched == g.attempt:
            if local is not None and local.state == JobState.SUCCEEDED and g.done.get(self.node) != "succeeded":
                g.done[self.node] = "succeeded"
                self._write_gang(rec, rev, g)
            elif mine[0] == 0 and self.plans is not None and running_here:
                plan = self.plans.get(job)
                settings = {"lr_scale": plan.lr_scale, "lr": plan.lr, "batch_sizes": plan.batch_sizes}
                if settings != rec.plan:
                    self.table.write(replace(rec, plan=settings), rev)
            return
        if launched > g.attempt:
            return
        if not g.master_port:
            if g.master_node == self.node:
                from trainguard.agent.lifecycle.launcher import free_port

                g.master_port = free_port(g.master_addr)
                self._write_gang(rec, rev, g)
            return
        self._launched[job] = g.attempt
        self._start_block(rec, g, mine)

    def _start_block(self, rec: JobRecordDoc, g: Gang, mine: tuple[int, int, int]) -> None:
        assert self.supervisor is not None
        from trainguard.agent.lifecycle.jobs import JobSpec
        from trainguard.agent.lifecycle.launcher import RankBlock

        job = rec.job
        group, offset, nproc = mine
        if offset % g.tp or nproc % g.tp:
            # A placement read back from etcd is checked again here: a tp group split across nodes
            # would run its per-layer collectives over the network.
            self.emit("gang_placement_refused", f"job {job} attempt {g.attempt}: ranks {offset}-{offset + nproc - 1} "
                      f"would split a tp={g.tp} group across nodes; not starting them",
                      {"job": job, "attempt": g.attempt, "severity": "error"})
            return
        env = {"TRAINGUARD_CKPT_PART": self.node, "TRAINGUARD_CKPT_PARTS": ",".join(g.nodes)}
        restore: dict[str, Any] | None = None
        if g.restore_step >= 0:
            try:
                path, how = self.assemble(job, g.restore_step, g.sources)
            except (CheckpointError, OSError) as exc:
                self.emit("checkpoint_restore_failed", f"job {job}: cannot assemble step {g.restore_step}: {exc}",
                          {"job": job, "step": g.restore_step, "severity": "error"})
                self._requests[job] = {"attempt": g.attempt, "cause": f"restore of step {g.restore_step} failed",
                                       "bad_step": g.restore_step, "at": self.clock()}
                self.wake()
                return
            env["TRAINGUARD_RESTORE"] = str(path)
            restore = {"tier": "assembled", "step": g.restore_step, "path": str(path), "parts": how}
        block = RankBlock(offset, nproc, g.world_size, g.master_addr, g.master_port, group, env, g.attempt, restore)
        if group == 0:
            self._forward_to.pop(job, None)
        else:
            self._forward_to[job] = g.master_node
            if self._forwarder is None:
                self._forwarder = threading.Thread(target=self._forward_loop, name="gang-telemetry", daemon=True)
                self._forwarder.start()
        try:
            spec = JobSpec.from_dict(rec.spec)
            local = self.supervisor.jobs.get(job)
            if self.on_restart is not None and g.attempt > 1:
                self.on_restart(job, g.failed_at or self.clock())
            if local is None or local.state.finished:
                self.supervisor.submit(spec, block=block, on_failure=self.on_local_failure)
                if group == 0:
                    self._carry_plan(rec, g)
            else:
                self.supervisor.relaunch(job, block, spec, f"cluster attempt {g.attempt}: {rec.cause}")
        except Exception as exc:  # noqa: BLE001 - the other nodes wait for us: say so, do not go quiet
            self.emit("gang_start_failed", f"job {job} attempt {g.attempt}: cannot start ranks here: {exc}",
                      {"job": job, "attempt": g.attempt, "severity": "error"})
            self._requests[job] = {"attempt": g.attempt, "cause": f"{self.node} could not start its ranks: {exc}",
                                   "bad_step": None, "at": self.clock()}
            self.wake()
            return
        self.emit("gang_ranks_started", f"job {job} attempt {g.attempt}: ranks {offset}-{offset + nproc - 1} of "
                  f"{g.world_size} here ({nproc // g.tp} whole tp={g.tp} group(s)), master {g.master_addr}:{g.master_port}"
                  + (f", restoring step {g.restore_step}" if restore else ""),
                  {"job": job, "attempt": g.attempt, "restore_step": g.restore_step})

    def _carry_plan(self, rec: JobRecordDoc, g: Gang) -> None:
        """The job's LR/batch settings as the previous rank-0 node had them (the per-dp-rank split
        only while dp is unchanged)."""
        if self.plans is None or not rec.plan:
            return
        fields: dict[str, Any] = {k: rec.plan[k] for k in ("lr_scale", "lr") if rec.plan.get(k) is not None}
        sizes = rec.plan.get("batch_sizes")
        reason = f"carried over to attempt {g.attempt} ({rec.cause})"
        if isinstance(sizes, list) and len(sizes) == g.dp:
            fields["batch_sizes"] = sizes
        elif isinstance(sizes, list) and sizes and "lr_scale" in fields:
            # The split was for the old dp and is dropped, so the global batch returns to the
            # configured one: the LR follows it by the same rule as the controller's on a
            # world-size change (this node has no history of the job to do it from; no noise scale).
            old = sum(int(x) for x in sizes)
            new = int((rec.spec.get("trainer") or {}).get("global_batch", old) or old)
            if old > 0 and new != old:
                factor, how = follow_batch(self.lr_batch_rule, old, new, None)
                fields["lr_scale"] = float(fields["lr_scale"]) * factor
                reason += f"; global batch {old} -> {new}, {how}"
        if not fields:
            return
        fields["reason"] = reason
        try:
            self.plans.update(rec.job, fields)
        except Exception as exc:  # noqa: BLE001 - a bad carried plan must not block the restart
            log.warning("gang %s: plan not carried over: %s", rec.job, exc)

    # -- checkpoints -------------------------------------------------------------------------------
    def _shared(self, holder: str) -> Tier:
        name = holder[len(TIER_HOLDER):]
        for tier in self.shared_tiers:
            if tier.name == name:
                return tier
        raise CheckpointError(f"no shared tier {name!r} here")

    def _index(self, holder: str, api: str, origin: str, key: str) -> list[int]:
        if holder.startswith(TIER_HOLDER):
            return [i.step for i in self._shared(holder).list(key)]
        if holder == self.node:
            return [i.step for i in self.store.held(origin).list(key)]
        raw = self.client_for(PeerRef(holder, api)).get_blob(CKPT_NS, f"{origin}/{key}/{INDEX}")
        return [int(r["step"]) for r in json.loads(raw)]

    def _parts_of(self, holder: str, api: str, origin: str, key: str, step: int) -> list[str]:
        if holder.startswith(TIER_HOLDER):
            probe = self.scratch / ".probe" / f"{key}-{step}"
            shutil.rmtree(probe, ignore_errors=True)
            try:
                manifest = read_manifest(self._shared(holder).fetch(key, step, probe))
            finally:
                shutil.rmtree(probe, ignore_errors=True)
        elif holder == self.node:
            manifest = read_manifest(self.store.held(origin).step_path(key, step))
        else:
            raw = self.client_for(PeerRef(holder, api)).get_blob(
                CKPT_NS, f"{origin}/{key}/{step_dirname(step)}/{MANIFEST_NAME}")
            manifest = Manifest.from_json(raw)
        parts = manifest.extra.get("parts")
        return [str(p) for p in parts] if isinstance(parts, list) else [origin]

    def find_restore(self, rec: JobRecordDoc, g: Gang, apis: dict[str, str],
                     max_step: int | None) -> tuple[int, dict[str, list[str]]]:
        """Newest step (<= ``max_step``) of which every part is held by a live node, and where."""
        have: dict[str, dict[int, list[str]]] = {}
        apis = {**apis, **{TIER_HOLDER + t.name: "" for t in self.shared_tiers}}
        for origin in g.nodes_seen:
            key = part_key(rec.job, origin)
            for holder, api in apis.items():
                try:
                    steps = self._index(holder, api, origin, key)
                except Exception as exc:  # noqa: BLE001 - an unreachable holder just holds nothing
                    log.info("gang %s: %s's listing of %s failed: %s", rec.job, holder, key, exc)
                    continue
                for s in steps:
                    have.setdefault(origin, {}).setdefault(s, []).append(holder)
        steps = sorted({s for by in have.values() for s in by if max_step is None or s <= max_step}, reverse=True)
        for step in steps:
            origin = next(o for o in have if step in have[o])
            holder = _sorted_holders("", have[origin][step])[0]
            try:
                parts = self._parts_of(holder, apis[holder], origin, part_key(rec.job, origin), step)
            except Exception as exc:  # noqa: BLE001
                log.info("gang %s: manifest of step %d unreadable on %s: %s", rec.job, step, holder, exc)
                continue
            if all(step in have.get(p, {}) for p in parts):
                return step, {p: _sorted_holders(p, have[p][step]) for p in parts}
        return -1, {}

    def assemble(self, job: str, step: int, sources: dict[str, list[str]]) -> tuple[Path, dict[str, str]]:
        """Every part of ``step`` into one local directory (verified); returns (path, part -> holder)."""
        dest = self.scratch / job / step_dirname(step)
        shutil.rmtree(self.scratch / job, ignore_errors=True)
        staging = self.scratch / job / ".parts"
        staging.mkdir(parents=True)
        apis = {n: i.api for n, i in self.members().items()}
        used: dict[str, str] = {}
        for part, holders in sorted(sources.items()):
            key = part_key(job, part)
            problems = []
            for holder in holders:
                target = staging / part
                try:
                    if holder.startswith(TIER_HOLDER):
                        self._shared(holder).fetch(key, step, target)
                    elif holder == self.node:
                        src = self.store.held(part).step_path(key, step)
                        result = self.store.held(part).verify(key, step)
                        if not result.ok:
                            raise CheckpointError(f"local copy corrupt: {result.error}")
                        shutil.copytree(src, target)
                    elif holder in apis:
                        fetch_remote_copy(self.client_for(PeerRef(holder, apis[holder])), holder, part, key, step,
                                          target, label=f"part {part}")
                    else:
                        raise CheckpointError(f"{holder} is not a member any more")
                except (CheckpointError, OSError) as exc:
                    problems.append(f"{holder}: {exc}")
                    shutil.rmtree(target, ignore_errors=True)
                    self.emit("checkpoint_part_unusable", f"job {job} step {step}: part {part} from {holder} "
                              f"unusable ({exc}); trying the next holder",
                              {"job": job, "step": step, "part": part, "holder": holder, "severity": "warning"})
                    continue
                used[part] = holder
                break
            if part not in used:
                raise CheckpointError(f"no usable copy of part {part}: " + "; ".join(problems or ["no holder"]))
        dest.mkdir()
        for part in used:
            root = staging / part
            for dirpath, _dirs, files in os.walk(root):
                for name in files:
                    if name == MANIFEST_NAME:
                        continue
                    src = Path(dirpath) / name
                    out = dest / src.relative_to(root)
                    out.parent.mkdir(parents=True, exist_ok=True)
                    os.replace(src, out)
        shutil.rmtree(staging, ignore_errors=True)
        return dest, used
