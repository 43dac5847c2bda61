"""The cluster part of one agent: membership, leader, peer tier, blob store, job records.

Daemon wiring (``agent.daemon.Agent._start_recovery`` and ``start``)::

    cluster = ClusterService(cfg.cluster, node=cfg.agent.node, memory_root=..., token=...,
                             emit=...)                      # before the checkpoint manager
    CheckpointManager(..., extra_tiers=cluster.tiers, extra_intervals=cluster.intervals,
                      extra_keep=cluster.keep)
    AgentControl serves cluster.store                       # the blob routes
    cluster.start(api_address, agent.supervisor)            # after the API is bound
    cluster.stop()                                          # first thing in shutdown

Without etcd endpoints: no peer tier, no threads; the agent is its own leader.
"""

from __future__ import annotations

import logging
import os
import signal
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from etcd3gw import exceptions as etcd_exc
from prometheus_client.metrics_core import Metric

from trainguard.agent import health
from trainguard.agent.checkpoint.tier import Tier
from trainguard.agent.cluster.blobstore import BlobStore
from trainguard.agent.cluster.config import ClusterConfig
from trainguard.agent.cluster.etcd import EtcdClient, EtcdUnavailable, LeaseExpired
from trainguard.agent.cluster.gang import GangCoordinator
from trainguard.agent.cluster.grace import MissingClock
from trainguard.agent.cluster.jobs import JobTable
from trainguard.agent.cluster.jobsync import JobRecords
from trainguard.agent.cluster.lineage import CommitTable
from trainguard.agent.cluster.membership import EmitFn, LeaderClaim, Membership, NodeInfo
from trainguard.agent.cluster.netif import socket_ifname
from trainguard.agent.cluster.peertier import PeerRef, PeerTier, ring_peer, token_client_factory
from trainguard.agent.cluster.signing import load_key
from trainguard.agent.metricspec import MetricSpec

if TYPE_CHECKING:
    from trainguard.agent.lifecycle.plans import PlanStore
    from trainguard.agent.lifecycle.supervisor import Supervisor

log = logging.getLogger("trainguard.cluster")
_ETCD_ERRORS = (EtcdUnavailable, etcd_exc.Etcd3Exception, LeaseExpired)

MEMBERS = MetricSpec("trainguard_cluster_members", "gauge", "", (), "Agents registered in etcd, as this agent last read them.")
IS_LEADER = MetricSpec("trainguard_cluster_is_leader", "gauge", "", (), "1 while this agent is the cluster leader.")
ETCD_UP = MetricSpec("trainguard_cluster_etcd_up", "gauge", "", (), "1 while the last etcd read succeeded (0: view frozen).")
REFRESH_FAILURES = MetricSpec("trainguard_cluster_lease_refresh_failures_total", "counter", "", (),
                              "Lease refreshes that did not reach etcd (retried within the TTL; not node loss).")
MOVES = MetricSpec("trainguard_cluster_jobs_moved_total", "counter", "", (), "Jobs this agent, as leader, moved off lost nodes.")
ADOPTIONS = MetricSpec("trainguard_cluster_jobs_adopted_total", "counter", "", (), "Jobs of lost nodes this agent took over.")
HELD_BYTES = MetricSpec("trainguard_cluster_peer_held_bytes", "gauge", "bytes", (),
                        "Peer-tier checkpoint bytes other nodes keep in this agent's RAM.")
GANG_DECISIONS = MetricSpec("trainguard_cluster_spanning_decisions_total", "counter", "", (),
                            "Attempts of jobs spanning nodes this agent, as leader, placed (start, restart, node loss).")
FORWARDED = MetricSpec("trainguard_cluster_telemetry_forwarded_total", "counter", "", (),
                       "Rank telemetry messages sent on to the node holding rank 0 of their job (one batch per job per 0.25 s).")
FORWARD_DROPPED = MetricSpec("trainguard_cluster_telemetry_forward_dropped_total", "counter", "", (),
                             "Rank telemetry messages that could not be sent on (rank-0 node unreachable, queue full).")
UNREACHABLE = MetricSpec("trainguard_cluster_members_unreachable_total", "counter", "", (),
                         "Members that did not answer within a decision's deadline (cluster.decision_timeout_s), "
                         "counted per decision: not placed, their copies not used.")
LINEAGE_WAITS = MetricSpec("trainguard_cluster_lineage_waits_total", "counter", "", (),
                           "Restarts of spanning jobs held to wait for an unreachable node that holds part of a newer "
                           "committed step.")
LINEAGE_GIVEN_UP = MetricSpec("trainguard_cluster_lineage_given_up_total", "counter", "", (),
                              "Restarts of spanning jobs that went on from an older step than one committed "
                              "(event lineage_steps_given_up).")
RECORDS_REFUSED = MetricSpec("trainguard_cluster_job_records_refused_total", "counter", "", (),
                             "Job records in etcd not acted on (unsigned, bad signature, invalid), once per revision.")
COMMITS_REFUSED = MetricSpec("trainguard_cluster_commit_records_refused_total", "counter", "", (),
                             "Lineage commit records in etcd not used (unsigned, bad signature, invalid), once per revision.")
UPLOADS_REFUSED = MetricSpec("trainguard_cluster_peer_uploads_refused_total", "counter", "", (),
                             "Peer-copy uploads refused here (byte quota, free space, missing origin signature).")
METRICS = (MEMBERS, IS_LEADER, ETCD_UP, REFRESH_FAILURES, MOVES, ADOPTIONS, HELD_BYTES, GANG_DECISIONS, FORWARDED,
           FORWARD_DROPPED, UNREACHABLE, LINEAGE_WAITS, LINEAGE_GIVEN_UP, RECORDS_REFUSED, COMMITS_REFUSED,
           UPLOADS_REFUSED)


def _noop(kind: str, message: str, fields: dict[str, Any]) -> None:
    pass


class ClusterService(JobRecords):
    def __init__(self, cfg: ClusterConfig, *, node: str, memory_root: str, token: str | None = None,
                 emit: EmitFn = _noop, clock: Callable[[], float] = time.time,
                 on_adopt: Callable[[str, float], None] | None = None, scratch: str = "",
                 tls: ssl.SSLContext | None = None) -> None:
        """``on_adopt(job, when)``: a job of a lost node is started here (the daemon passes
        ``recovery.note_failure``-like so the recovery clock runs and ``job_resumed`` follows);
        ``tls``: the client context other agents' APIs are called with (None: plain HTTP)."""
        self.cfg = cfg
        self.on_adopt = on_adopt
        self.node = node
        self.emit = emit
        self._clock = clock
        # The cluster key signs job records and peer copies (required with etcd by the config).
        self.key = load_key(cfg.key_file) if cfg.key_file else b""
        blob_root = cfg.blob_root or os.path.join(memory_root, ".peer-held")
        total, per_origin, min_free = cfg.blob_quotas(blob_root)
        self.store = BlobStore(blob_root, own_node=node, own_root=memory_root, max_bytes=total,
                               max_origin_bytes=per_origin, min_free_bytes=min_free, key=self.key,
                               on_refuse=self._on_blob_refused)
        if cfg.etcd_plaintext and not cfg.solo:
            log.warning("cluster: etcd is spoken to over plain HTTP (cluster.etcd_plaintext = true): whoever "
                        "reaches %s reads and writes every job record", ",".join(cfg.etcd_endpoints))
            emit("etcd_plaintext", "etcd is spoken to over plain HTTP without client certificates "
                 "(cluster.etcd_plaintext)", {"endpoints": list(cfg.etcd_endpoints), "severity": "warning"})
        self.client = None if cfg.solo else EtcdClient(cfg.etcd_endpoints, timeout_s=cfg.etcd_timeout_s,
                                                       ca=cfg.etcd_ca, cert=cfg.etcd_cert, key=cfg.etcd_key,
                                                       plaintext=cfg.etcd_plaintext)
        self.peer_tier: PeerTier | None = None
        peers = token_client_factory(token, cfg.peer_timeout_s, tls)
        if self.client is not None:
            self.peer_tier = PeerTier(node, self.store, self.peer, peers, key=self.key)
        self.membership: Membership | None = None
        self.jobs = (JobTable(self.client, f"/trainguard/{cfg.name}/", key=self.key, on_drop=self._on_record_dropped)
                     if self.client is not None else None)
        self.gangs: GangCoordinator | None = None
        if self.jobs is not None:
            self.gangs = GangCoordinator(
                node, self.jobs, self.store, peers,
                scratch=scratch or os.path.join(memory_root, ".assembled"), emit=emit,
                is_leader=lambda: self.is_leader, members=self.members, wake=self._wake, on_restart=on_adopt,
                clock=clock, rejoin=cfg.rejoin,
                quick_client_for=token_client_factory(token, min(cfg.peer_timeout_s, cfg.decision_timeout), tls),
                commits=CommitTable(self.client, f"/trainguard/{cfg.name}/", key=self.key,
                                    on_drop=self._on_commit_dropped) if self.client is not None else None,
                decision_timeout_s=cfg.decision_timeout, fence_grace_s=cfg.fence_grace_s,
                lineage_wait_s=cfg.lineage_wait)
            self.gangs.cluster_key = self.key
            self.gangs.leader_claim = self._claim
        self._missing = MissingClock(cfg.fence_grace_s)
        self.supervisor: Supervisor | None = None
        self.plans: PlanStore | None = None
        self._epochs: dict[str, int] = {}
        self._uids: dict[str, str] = {}
        self._conflicts: set[str] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.moves = 0
        self.adoptions = 0
        self._next_gc = 0.0
        self._fenced: dict[str, str] = {}
        """Jobs whose ranks this agent stopped because its lease went unrefreshed -> why. Such a job
        is neither published nor restarted here until its etcd record says where it runs."""
        self._fence_thread: threading.Thread | None = None
        self.fences = 0

    def _claim(self) -> LeaderClaim:
        """This agent's leadership as etcd must still hold it for a leader's write to land."""
        if self.membership is None:
            return LeaderClaim(f"/trainguard/{self.cfg.name}/leader", self.node, 0)
        return self.membership.claim()

    def _on_blob_refused(self, origin: str, reason: str, size: int) -> None:
        self.emit("peer_copy_refused", f"upload from {origin} refused: {reason}",
                  {"origin": origin, "bytes": size, "reason": reason, "severity": "warning"})

    def _on_record_dropped(self, key: str, revision: int, reason: str) -> None:
        self.emit("job_record_refused", f"job record {key} (revision {revision}) not used: {reason}",
                  {"key": key, "revision": revision, "reason": reason, "severity": "error"})

    def _on_commit_dropped(self, key: str, revision: int, reason: str) -> None:
        self.emit("commit_record_refused", f"commit record {key} (revision {revision}) not used: {reason}",
                  {"key": key, "revision": revision, "reason": reason, "severity": "error"})

    def _wake(self) -> None:
        if self.membership is not None:
            self.membership._bump()

    # -- checkpoint manager wiring ---------------------------------------------------------------
    @property
    def tiers(self) -> list[Tier]:
        return [self.peer_tier] if self.peer_tier is not None else []

    @property
    def intervals(self) -> dict[str, int]:
        return {"peer": self.cfg.peer_interval} if self.peer_tier is not None else {}

    @property
    def keep(self) -> dict[str, int]:
        return {"peer": self.cfg.peer_keep} if self.peer_tier is not None else {}

    # -- life cycle ------------------------------------------------------------------------------
    def start(self, api_address: str | None, supervisor: Supervisor | None = None,
              plans: PlanStore | None = None, lr_batch_rule: str = "sqrt") -> None:
        """``api_address``: HOST:PORT of this agent's bound TCP API (None: peers cannot reach us).
        ``plans``: the agent's plan store, so a moved job keeps its LR/batch settings, the LR
        following a changed global batch by ``lr_batch_rule`` (controller.lr_batch_rule)."""
        self.supervisor = supervisor
        self.plans = plans
        if self.gangs is not None:
            self.gangs.supervisor = supervisor
            self.gangs.plans = plans
            self.gangs.lr_batch_rule = lr_batch_rule
        advertise = self.cfg.advertise or (api_address or "")
        if advertise.startswith("0.0.0.0:"):
            log.warning("cluster: API bound to 0.0.0.0; set cluster.advertise so peers can reach this node")
        me = NodeInfo(self.node, advertise, self.cfg.slots, self._clock())
        if self.gangs is not None:
            ifname, warning = socket_ifname(advertise)
            self.gangs.socket_ifname = ifname
            if warning:
                self.emit("gloo_loopback", warning, {"severity": "warning", "advertise": advertise})
        self.store.cleanup_tmp()
        self.membership = Membership(self.client, self.cfg.name, me, ttl=self.cfg.lease_ttl_s,
                                     poll_s=self.cfg.poll_s, emit=self.emit, watch=self.cfg.watch,
                                     resync_s=self.cfg.resync_s)
        self.membership.start()
        if self.client is not None and supervisor is not None and not self.membership.refused:
            self._thread = threading.Thread(target=self._job_loop, name="cluster-jobs", daemon=True)
            self._thread.start()
            self._fence_thread = threading.Thread(target=self._fence_loop, name="cluster-fence", daemon=True)
            self._fence_thread.start()

    def stop(self, leave: bool = True) -> None:
        """Leave the cluster. On a clean leave the jobs this node runs are marked ``paused`` first:
        stopping an agent is an operator's act, not a failure, so the leader must not move them
        (with ``on_stop = "leave_ranks"`` they even keep running here)."""
        self._stop.set()
        if self.gangs is not None:
            self.gangs.stop()
        if self.membership is not None:
            self.membership._bump()  # wake the job loop now
        if self._thread is not None:
            self._thread.join(5.0)
        if self._fence_thread is not None:
            self._fence_thread.join(5.0)
        if leave:
            self._pause_own_jobs()
        if self.membership is not None:
            self.membership.stop(leave=leave)

    # -- queries ---------------------------------------------------------------------------------
    @property
    def is_leader(self) -> bool:
        return self.membership is not None and self.membership.is_leader

    @property
    def leader(self) -> str | None:
        return self.membership.leader if self.membership is not None else self.node

    def members(self) -> dict[str, NodeInfo]:
        return self.membership.members() if self.membership is not None else {}

    def peer(self) -> PeerRef | None:
        """Where this node's peer-tier copies go now (configured peer, else the ring successor)."""
        members = {n: i.api for n, i in self.members().items()}
        return ring_peer(self.node, members, self.cfg.peer)

    def status(self) -> dict[str, Any]:
        peer = self.peer()
        return {
            "cluster": self.cfg.name,
            "node": self.node,
            "leader": self.leader,
            "is_leader": self.is_leader,
            "etcd": self.cfg.etcd_endpoints,
            "etcd_reachable": self.membership.etcd_reachable if self.membership else False,
            "members": {n: {"api": i.api, "slots": i.slots} for n, i in sorted(self.members().items())},
            "peer": peer.node if peer else None,
            "held_origins": self.store.origins(),
            "spanning_jobs": self.gangs.last if self.gangs is not None else {},
            "fenced": dict(self._fenced),
            "join_refused": self.membership.refused if self.membership is not None else "",
        }

    def metrics(self) -> Iterator[Metric]:
        """Families for the exporter (the daemon appends this service to ``exporter.sources``)."""
        m = self.membership
        for spec, value in ((MEMBERS, len(self.members())), (IS_LEADER, int(self.is_leader)),
                            (ETCD_UP, int(m is not None and not m.solo and m.etcd_reachable)),
                            (HELD_BYTES, self.store.held_bytes())):
            g = spec.gauge()
            g.add_metric([], value)
            yield g
        gangs = self.gangs
        for spec, value in ((REFRESH_FAILURES, m.refresh_failures if m is not None else 0),
                            (MOVES, self.moves), (ADOPTIONS, self.adoptions),
                            (GANG_DECISIONS, gangs.decisions if gangs else 0),
                            (FORWARDED, gangs.forwarded if gangs else 0),
                            (FORWARD_DROPPED, gangs.forward_dropped if gangs else 0),
                            (UNREACHABLE, gangs.unreachable_total if gangs else 0),
                            (LINEAGE_WAITS, gangs.lineage_waits if gangs else 0),
                            (LINEAGE_GIVEN_UP, gangs.lineage_given_up if gangs else 0),

                            (RECORDS_REFUSED, self.jobs.drops.dropped if self.jobs is not None else 0),
                            (COMMITS_REFUSED, gangs.commits.drops.dropped if gangs and gangs.commits else 0),
                            (UPLOADS_REFUSED, self.store.refused)):
            c = spec.counter()
            c.add_metric([], value)
            yield c

    # -- jobs ------------------------------------------------------------------------------------
    def _local_fingerprint(self) -> tuple[Any, ...]:
        """What of this agent's own state goes into etcd: job states and plan versions."""
        assert self.supervisor is not None
        jobs = sorted((j, r.state.value) for j, r in list(self.supervisor.jobs.items()))
        plans = tuple(self.plans.get(j).version for j, _ in jobs) if self.plans is not None else ()
        return (tuple(jobs), plans)

    def _job_loop(self) -> None:
        """Sync when etcd changed (watch), when this agent's jobs or plans changed, and every
        ``resync_s``; every ``poll_s`` while no watch stream is up."""
        assert self.membership is not None
        m = self.membership
        seen, last_fp, last_sync = -1, None, 0.0
        while not self._stop.is_set():
            health.beat(self, "cluster-jobs")
            gen = m.wait_change(seen, self.cfg.poll_s)
            if self._stop.is_set():
                return
            fp = self._local_fingerprint()
            now = time.monotonic()
            if gen == seen and fp == last_fp and m.watching and now - last_sync < self.cfg.resync_s:
                continue
            seen, last_fp, last_sync = gen, fp, now
            try:
                self.sync_jobs()
            except _ETCD_ERRORS as exc:
                log.debug("job sync skipped, etcd unavailable: %s", exc)
            except Exception as exc:  # noqa: BLE001 - the loop must survive anything
                log.exception("job sync failed: %s", exc)

    def sync_jobs(self) -> None:
        """Publish our jobs, adopt jobs assigned to us, and (leader) move jobs of lost nodes."""
        if self.jobs is None or self.supervisor is None or self.membership is None:
            return
        if not self.membership.etcd_reachable or self.membership.refused:
            return  # a frozen view must not drive decisions; a refused name owns no jobs
        records = self.jobs.read()
        self._uids = {j: uid for j, (rec, _) in records.items() if isinstance(uid := rec.spec.get("uid"), str)}
        single = {j: r for j, r in records.items() if not r[0].gang}
        self._publish(single, set(records) - set(single))
        self._adopt(single)
        if self.cfg.heal and self.is_leader:
            self._heal(single)
        if self.gangs is not None:
            self.gangs.sync(records)
        self.gc_held()

    # -- fencing ---------------------------------------------------------------------------------
    def _fence_loop(self) -> None:
        """Checks the lease's age on its own thread: a job sync stuck in etcd timeouts must not
        delay the fence past the TTL."""
        tick = min(0.25, max(0.05, (self.cfg.lease_ttl_s - self.cfg.fence_after_s) / 4))
        while not self._stop.wait(tick):
            try:
                self.fence_check()
            except Exception as exc:  # noqa: BLE001 - the fence must keep watching
                log.exception("fence check failed: %s", exc)

    def fence_check(self) -> list[str]:
        """Fence every job the cluster could move elsewhere once the lease went unrefreshed for
        ``cluster.fence_after_s``: the lease may expire on the server before the next refresh, and
        the leader then places the job on other nodes. Needs no etcd. Returns the jobs fenced."""
        m = self.membership
        if m is None or m.solo:
            return []
        age = m.refresh_age()
        if age is None or age < self.cfg.fence_after_s:
            return []
        if m.leader == self.node:
            # A leader fenced on its own clock may lose its key any moment: it hands leadership on
            # at once instead of leaving the others leaderless until the key's lease expires.
            m.resign(f"lease not refreshed for {age:.1f} s")
        if self.supervisor is None:
            return []
        out = []
        for job, record in list(self.supervisor.jobs.items()):
            if record.state.finished or record.state.value == "stopping":
                continue
            if record.block is None and not (self.cfg.heal and job in self._epochs):
                continue  # a job the cluster does not know of runs here only: no one else starts it
            self._fence(job, record, age)
            out.append(job)
        return out

    def _fence(self, job: str, record: Any, age: float) -> None:
        assert self.supervisor is not None
        cause = f"lease not refreshed for {age:.1f} s"
        spanning = record.block is not None
        if not spanning:
            self._fenced[job] = cause
            self._epochs.pop(job, None)  # the record decides what runs here next
        stopped = []
        for rank in list(record.ranks):
            try:
                os.killpg(rank.pid, signal.SIGSTOP)  # at once: not one more step, not one more write
                stopped.append(rank.pid)
            except (ProcessLookupError, PermissionError):
                pass
        self.fences += 1
        self.emit("job_fenced", f"job {job}: {cause} (limit {self.cfg.fence_after_s:.1f} s of the "
                  f"{self.cfg.lease_ttl_s} s TTL); ranks stopped, the leader may place the job elsewhere; "
                  "not restarted here until its etcd record says so",
                  {"job": job, "cause_": cause, "age_s": round(age, 3), "pids": stopped, "spanning": spanning,
                   "action": "fence", "severity": "error"})
        try:
            self.supervisor.stop(job, f"fenced: {cause}", hard=True)
        except KeyError:
            return
        if spanning and self.gangs is not None:
            # Once etcd answers, the leader learns the block is gone and orders a new attempt.
            self.gangs.on_local_failure(job, f"{self.node} fenced its ranks: {cause}")

    def job_uid(self, job: str) -> str:
        """The submission uid of ``job`` by its signed etcd record at the last read ("": unknown),
        for a node that reads the job's object-tier checkpoints before it runs the job."""
        return self._uids.get(job, "")

    def epoch_of(self, job: str) -> int:
        """The epoch under which this node runs ``job`` (0: not claimed through etcd)."""
        return self._epochs.get(job, 0)

    def submit_spanning(self, spec: dict[str, Any]) -> None:
        """A job over several nodes: recorded in etcd; the leader places it (ValueError: refused)."""
        if self.gangs is None:
            raise ValueError("nodes > 1 needs a cluster: set [cluster] etcd_endpoints")
        if self.membership is None or not self.membership.etcd_reachable:
            raise ValueError("etcd is unreachable: cannot record the job")
        self.gangs.submit(spec)

    def _pause_own_jobs(self) -> None:
        if self.jobs is None or self.supervisor is None:
            return
        try:
            records = self.jobs.read()
            for job, (rec, rev) in records.items():
                local = self.supervisor.jobs.get(job)
                if rec.node == self.node and rec.state == "running" and local is not None and not rec.gang:
                    self.jobs.write(replace(rec, state="paused", cause="agent stopped"), rev)
        except _ETCD_ERRORS as exc:
            log.warning("could not mark jobs paused in etcd (the leader may move them): %s", exc)

    def gc_held(self, now: float | None = None) -> list[str]:
        """Drop copies held for nodes that left and have not pushed for ``held_retention_s``."""
        now = self._clock() if now is None else now
        if now < self._next_gc:
            return []
        self._next_gc = now + min(60.0, self.cfg.held_retention_s / 4)
        removed = self.store.drop_stale(set(self.members()), self.cfg.held_retention_s, now)
        for origin in removed:
            self.emit("peer_copies_dropped", f"dropped checkpoint copies held for departed node {origin}",
                      {"node": origin})
        return removed
