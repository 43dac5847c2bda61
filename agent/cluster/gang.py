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
    requests     {node: {"attempt", "cause", "bad_step", "start_failed"}}: a node's ranks failed
                 (or could not start there), restart please
    done         {node: "succeeded"} for the current attempt
    nodes_seen   every node that ever held ranks (whose checkpoint parts may be needed)
    lineage_wait while the leader waits for an unreachable node holding a newer committed step
    given_up     on the attempt that went on without such a step: which steps and nodes
    lineage_floor  attempt from which commit records count (older ones were given up)
    abandoned    [restore step, time] of each give-up: later copies from before it are never used

Level-triggered like the rest of the job records: the leader (``decision.decide``) turns a pending record,
a restart request of the current attempt, or a lost node into the next attempt; every agent
(``GangCoordinator.sync``) starts its block of the newest attempt, writes its requests and
completion, and stops ranks that the newest attempt no longer gives it. Writes use compare-and-
swap on the key's revision, so concurrent writers retry on the next change instead of clobbering.

Checkpoints: each node's local rank 0 commits that node's DCP files to its own memory tier under
``part_key(job, node)`` with the attempt's node list in the manifest (``trainguard/checkpoint/tier.py``); the
replicator copies the part to the ring peer's RAM like any memory checkpoint. To restore step S
the leader looks up, for every part of S, which live nodes hold it (the writer's own memory tier
over the blob API, or a peer's held copy), asking every holder at once under one deadline
(``survey.py``); each node then downloads the missing parts, checks
every file against its part's manifest and merges them into one directory: the full DCP
checkpoint, resharded by DCP on load when dp changed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainguard.agent import health
from trainguard.agent.batch_rule import follow_batch
from trainguard.agent.checkpoint.errors import CheckpointError
from trainguard.agent.checkpoint.tier import Tier
from trainguard.agent.cluster.blobstore import BlobStore
from trainguard.agent.cluster.decision import DecisionInputs, Gang, RestoreFinder, decide, place_gang, trigger
from trainguard.agent.cluster.gangparts import GangParts
from trainguard.agent.cluster.grace import MissingClock
from trainguard.agent.cluster.jobs import JobRecordDoc, JobTable
from trainguard.agent.cluster.lineage import CommitRecord, CommitTable
from trainguard.agent.cluster.peertier import ClientFactory, PeerRef
from trainguard.agent.cluster.survey import TIER_HOLDER, Survey
from trainguard.agent.wire import Telemetry, WireError, decode_telemetry, part_key

if TYPE_CHECKING:
    from trainguard.agent.cluster.membership import EmitFn, LeaderClaim, NodeInfo
    from trainguard.agent.lifecycle.plans import PlanStore
    from trainguard.agent.lifecycle.supervisor import Supervisor

log = logging.getLogger("trainguard.cluster.gang")
# The record and the leader's pure decision live in ``decision``; re-exported for existing callers.
__all__ = ["TIER_HOLDER", "DecisionInputs", "Gang", "GangCoordinator", "RestoreFinder", "decide",
           "decode_forwarded", "place_gang", "trigger"]


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


def _no_survey(rec: JobRecordDoc, g: Gang, apis: dict[str, str], max_step: int | None) -> tuple[int, dict[str, list[str]]]:
    raise RuntimeError("no placement is due: no checkpoint survey was taken")


class GangCoordinator(GangParts):
    """This agent's side of spanning jobs (leader decisions and the local block)."""

    def __init__(self, node: str, table: JobTable, store: BlobStore, client_for: ClientFactory, *,
                 scratch: str, emit: EmitFn, is_leader: Callable[[], bool],
                 members: Callable[[], dict[str, NodeInfo]], wake: Callable[[], None],
                 on_restart: Callable[[str, float], None] | None = None,
                 clock: Callable[[], float] = time.time, rejoin: bool = True,
                 quick_client_for: ClientFactory | None = None, commits: CommitTable | None = None,
                 decision_timeout_s: float = 2.0, fence_grace_s: float = 0.0,
                 lineage_wait_s: float = 0.0) -> None:
        """``quick_client_for``: clients whose socket timeout is the decision deadline (probes,
        listings, manifests; ``client_for`` keeps the long one for transfers); ``commits``: where
        nodes record what they committed (None: no lineage records, no waiting)."""
        self.node = node
        self.table = table
        self.store = store
        self.client_for = client_for
        self.scratch = Path(scratch)
        self.cluster_key = b""  # set by the cluster service: parts fetched from other nodes are checked by it
        self.emit = emit
        self.is_leader = is_leader
        self.members = members
        self.wake = wake
        self.on_restart = on_restart
        self.clock = clock
        self.rejoin = rejoin
        self.quick_client_for = quick_client_for or client_for
        self.commits = commits
        self.decision_timeout_s = decision_timeout_s
        self.missing = MissingClock(fence_grace_s)
        self.lineage_wait_s = lineage_wait_s
        self.last_survey_s = 0.0
        """How long the last decision's survey of the members took (seconds)."""
        self.unreachable_total = 0
        """Members that did not answer within a decision's deadline, counted per decision."""
        self.lineage_waits = 0
        self.lineage_given_up = 0
        self._unreachable_said: dict[str, frozenset[str]] = {}
        self._recorded: dict[str, tuple[int, int]] = {}
        self._launched_at: dict[str, float] = {}
        self._timer: threading.Timer | None = None
        self._timer_at = 0.0
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
        self.socket_ifname = ""
        self.leader_claim: Callable[[], LeaderClaim | None] = lambda: None
        """This agent's leader claim: the leader's decisions are written only while etcd's leader key holds it."""
        """The interface holding this node's advertised address, for the ranks' gloo/NCCL sockets."""

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
        if self._timer is not None:
            self._timer.cancel()
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
        if self.commits is not None:
            self.commits.clear(job)  # an earlier job of this name left its own lineage
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
            self._lead(gangs)
        for job, (rec, rev) in sorted(gangs.items()):
            if rev < 0:
                continue
            try:
                self._member(rec, rev)
            except Exception as exc:  # noqa: BLE001
                log.exception("gang %s: local step failed: %s", job, exc)

    def _lead(self, gangs: dict[str, tuple[JobRecordDoc, int]]) -> None:
        """The leader's decisions; a written record is marked (revision -1) so the member step
        waits for its fresh revision."""
        members = self.members()
        now = self.clock()
        running = [n for rec, _ in gangs.values() if rec.state == "running" for n in Gang.from_dict(rec.gang).nodes]
        self.missing.observe(running, members, now)
        for job, (rec, rev) in sorted(gangs.items()):
            try:
                out = self._decide(rec, members, now)
            except Exception as exc:  # noqa: BLE001 - one bad record must not stop the others
                log.exception("gang %s: decision failed: %s", job, exc)
                continue
            if out is None:
                continue
            new, what = out
            if not self.table.write(new, rev, leader=self.leader_claim()):
                continue
            self.decisions += 1
            gangs[job] = (new, -1)
            self._announce(rec, new, what)
        due = self.missing.next_due(now)
        if due is not None:
            self.wake_in(due)

    def _decide(self, rec: JobRecordDoc, members: dict[str, NodeInfo], now: float) -> tuple[JobRecordDoc, str] | None:
        """Survey the members (only when a placement is due), then the pure decision."""
        inputs = DecisionInputs(missing_since=self.missing.since(), fence_grace_s=self.missing.grace_s,
                                lineage_wait_s=self.lineage_wait_s)
        why = trigger(rec, members, now, inputs)
        if why is None or why[0] != "place":
            return decide(rec, members, _no_survey, now, leader=self.node, rejoin=self.rejoin, inputs=inputs)
        g = Gang.from_dict(rec.gang)
        survey = self.survey(rec, g, {n: i.api for n, i in members.items()}, probe=members)
        self.last_survey_s = survey.elapsed_s
        unreachable = frozenset(n for n in survey.unreachable if n != self.node)
        self._say_unreachable(rec.job, survey, unreachable)
        commits = self.commits.read(rec.job) if self.commits is not None and g.nodes_seen else {}
        inputs = replace(inputs, unreachable=frozenset(n for n in unreachable if n in members), commits=commits)
        out = decide(rec, members, survey.finder(), now, leader=self.node, rejoin=self.rejoin, inputs=inputs)
        if out is not None and out[0].state == "pending":
            until = Gang.from_dict(out[0].gang).lineage_wait.get("until")
            if isinstance(until, int | float):
                self.wake_in(max(0.0, float(until) - now))
        return out

    def _say_unreachable(self, job: str, survey: Survey, unreachable: frozenset[str]) -> None:
        """Once per decision in the log; as an event when the set of silent members changes."""
        if unreachable:
            self.unreachable_total += len(unreachable)
            why = "; ".join(f"{n}: {survey.unreachable[n]}" for n in sorted(unreachable))
            log.warning("gang %s: %d member(s) unreachable for this decision (%.2f s): %s", job,
                        len(unreachable), survey.elapsed_s, why)
        if self._unreachable_said.get(job, frozenset()) != unreachable:
            self._unreachable_said[job] = unreachable
            if unreachable:
                self.emit("gang_members_unreachable",
                          f"job {job}: {', '.join(sorted(unreachable))} did not answer within "
                          f"{self.decision_timeout_s:g} s: not placed, their copies not used in this decision",
                          {"job": job, "nodes": sorted(unreachable), "elapsed_s": round(survey.elapsed_s, 3),
                           "severity": "warning"})

    def _announce(self, old: JobRecordDoc, new: JobRecordDoc, what: str) -> None:
        job = new.job
        placed = Gang.from_dict(new.gang)
        was = Gang.from_dict(old.gang)
        if new.state == "pending" and placed.lineage_wait and not was.lineage_wait:
            lw = placed.lineage_wait
            self.lineage_waits += 1
            self.emit("lineage_waiting", f"job {job}: {new.cause}",
                      {"job": job, "step": lw.get("step"), "nodes": lw.get("nodes"), "restorable": lw.get("restorable"),
                       "wait_s": self.lineage_wait_s, "severity": "warning"})
            return
        self.emit("gang_placed" if new.state == "running" else f"gang_{new.state}",
                  f"job {job}: {what}" + (f" (cause: {new.cause})" if new.state == "running" else ""),
                  {"job": job, "attempt": placed.attempt, "cause_": new.cause,
                   "restore_step": placed.restore_step,
                   "severity": "warning" if new.state in ("failed",) or "lost" in new.cause else "info"})
        if new.state == "running" and placed.given_up:
            gu = placed.given_up
            self.lineage_given_up += 1
            nodes = ", ".join(f"{n} (step {s})" for n, s in sorted(gu.get("committed", {}).items()))
            self.emit("lineage_steps_given_up",
                      f"job {job} attempt {placed.attempt}: restarting from "
                      + (f"step {placed.restore_step}" if placed.restore_step >= 0 else "step 0")
                      + f"; steps {placed.restore_step + 1}-{gu.get('newest')} committed on {nodes} are given up"
                      + (f" after waiting {gu.get('waited_s')} s for {', '.join(gu.get('unreachable', []))}"
                         if gu.get("unreachable") else " (no node holds them any more)"),
                      {"job": job, "attempt": placed.attempt, "restore_step": placed.restore_step,
                       "newest": gu.get("newest"), "committed": gu.get("committed"),
                       "unreachable": gu.get("unreachable"), "waited_s": gu.get("waited_s"), "severity": "error"})

    def wake_in(self, delay: float) -> None:
        """Run the job loop again after ``delay`` seconds (a grace or a wait ends then)."""
        at = time.monotonic() + delay
        if self._timer is not None and self._timer.is_alive() and self._timer_at <= at:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = at
        self._timer = threading.Timer(delay + 0.05, self.wake)
        self._timer.daemon = True
        self._timer.start()

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
            self._record_commit(job, g.attempt)
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
        self._launched_at[job] = time.time()
        self._start_block(rec, g, mine)

    def note_commit(self, tier_job: str) -> None:
        """Checkpoint-manager hook: a memory checkpoint of ``tier_job`` was committed here. A part of
        a spanning job wakes the job loop so its commit record follows at once."""
        if ".part-" in tier_job:
            self.wake()

    def _record_commit(self, job: str, attempt: int) -> None:
        """Write this node's commit record when its newest committed part of ``job`` changed. Only
        steps committed since this node started the attempt count (older ones in the memory tier
        may belong to a lineage the leader gave up)."""
        if self.commits is None:
            return
        key = part_key(job, self.node)
        try:
            infos = self.store.held(self.node).list(key)
        except (CheckpointError, OSError) as exc:
            log.debug("gang %s: own part not listable: %s", job, exc)
            return
        started = self._launched_at.get(job, 0.0)
        fresh = [i for i in infos if i.created >= started]
        if not fresh:
            return
        newest = fresh[-1]
        if self._recorded.get(job) == (newest.step, attempt):
            return
        try:
            parts, _created = self._parts_of(self.node, "", self.node, key, newest.step)
        except (CheckpointError, OSError, ValueError) as exc:
            log.info("gang %s: manifest of own step %d unreadable: %s", job, newest.step, exc)
            return
        try:
            self.commits.write(job, CommitRecord(self.node, newest.step, attempt, tuple(parts), self.clock()))
        except Exception as exc:  # noqa: BLE001 - etcd down: written at the next sync
            log.info("gang %s: commit record not written: %s", job, exc)
            return
        self._recorded[job] = (newest.step, attempt)

    def _start_block(self, rec: JobRecordDoc, g: Gang, mine: tuple[int, int, int]) -> None:
        assert self.supervisor is not None
        from trainguard.agent.lifecycle.jobs import JobSpec
        from trainguard.agent.lifecycle.ranks import RankBlock

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
        block = RankBlock(offset, nproc, g.world_size, g.master_addr, g.master_port, group, env, g.attempt, restore,
                          self.socket_ifname)
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
                                   "bad_step": None, "at": self.clock(), "start_failed": True}
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
