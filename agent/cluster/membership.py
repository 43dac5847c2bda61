"""Cluster membership and leader election in etcd.

Keys (``<cluster>`` is the configured cluster name)::

    /trainguard/<cluster>/nodes/<node>   NodeInfo JSON, bound to the node's lease, created only
                                          if absent (a name another live agent holds is refused)
    /trainguard/<cluster>/leader         the leader's node name, bound to the leader's lease,
                                          created only if absent (one txn)

Each agent grants one lease, keeps it alive (``LeaseKeeper``) and binds both keys to it, so a node
that dies takes its registration and, if it led, its leadership with it when the *server* expires
the lease. A background thread reads the prefix whenever an etcd watch stream reports a change under it
(and every ``resync_s``; every ``poll_s`` when not watching or while the stream is down) and diffs
it against the last successful read: a node key that appeared is ``node_joined``, one that disappeared is ``node_lost``
(only the server deletes it, after the lease really expired, or the node revoked it on a clean
stop: ``node_left``). When the leader key is absent every agent campaigns; the txn lets one win.
A read that fails (etcd stalled or down) changes nothing: no false losses, and the view stays as
it was until etcd answers again.

A leader's writes carry a ``LeaderClaim`` (leader key, node, lease) that etcd checks in the same
txn, and ``refresh_age`` tells the fence (``ClusterService``) how old the newest answered lease
refresh is, without asking etcd.

Without etcd (no endpoints) the agent is a cluster of one and its own leader.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from etcd3gw import exceptions as etcd_exc

from trainguard.agent import health
from trainguard.agent.cluster.etcd import EtcdClient, EtcdUnavailable, LeaseExpired, LeaseKeeper, PrefixWatch

log = logging.getLogger("trainguard.cluster")

# emit(kind, message, fields): the daemon adapts it to EventLog.emit.
EmitFn = Callable[[str, str, dict[str, Any]], None]
ChangeFn = Callable[["ClusterView"], None]

_ETCD_ERRORS = (EtcdUnavailable, etcd_exc.Etcd3Exception)


def _noop_emit(kind: str, message: str, fields: dict[str, Any]) -> None:
    pass


class NodeNameTaken(RuntimeError):
    """Another live agent holds this node's name (its key stayed under another lease past the TTL)."""


@dataclass(frozen=True)
class NodeInfo:
    """What an agent publishes about itself."""

    node: str
    api: str = ""  # HOST:PORT of its token-protected TCP API ("" when it has none)
    slots: int = 0  # ranks (GPUs) it can run
    started: float = 0.0

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, node: str, data: bytes) -> NodeInfo:
        try:
            doc = json.loads(data)
        except ValueError:
            return cls(node)
        if not isinstance(doc, dict):
            return cls(node)
        return cls(
            node=node,
            api=str(doc.get("api", "")),
            slots=int(doc.get("slots", 0)) if isinstance(doc.get("slots"), int) else 0,
            started=float(doc.get("started", 0.0)) if isinstance(doc.get("started"), int | float) else 0.0,
        )


@dataclass(frozen=True)
class LeaderClaim:
    """What a leader's write is conditioned on: the leader key still holds ``node`` under
    ``lease`` (``etcd.compare_held``). A deposed leader, or one whose lease expired, has its
    writes refused by etcd itself, not by its own belief."""

    key: str
    node: str
    lease: int


@dataclass(frozen=True)
class ClusterView:
    """One consistent read of the cluster: who is in, who leads."""

    members: dict[str, NodeInfo] = field(default_factory=dict)
    leader: str | None = None
    revision: int = 0


class Membership:
    def __init__(
        self,
        client: EtcdClient | None,
        cluster: str,
        me: NodeInfo,
        *,
        ttl: int = 10,
        poll_s: float = 0.5,
        emit: EmitFn = _noop_emit,
        clock: Callable[[], float] = time.monotonic,
        watch: bool = False,
        resync_s: float = 10.0,
    ) -> None:
        """``watch``: read etcd when a watch stream says something changed (and every
        ``resync_s``) instead of every ``poll_s``; ``poll_s`` still applies while the stream is down."""
        self.client = client
        self.use_watch = watch
        self.resync_s = resync_s
        self._watch: PrefixWatch | None = None
        self._cond = threading.Condition()
        self._gen = 0
        self.cluster = cluster
        self.me = me
        self.ttl = ttl
        self.poll_s = poll_s
        self.emit = emit
        self._clock = clock
        self.prefix = f"/trainguard/{cluster}/"
        self.nodes_prefix = f"{self.prefix}nodes/"
        self.leader_key = f"{self.prefix}leader"
        self.left_prefix = f"{self.prefix}left/"
        self._lock = threading.RLock()
        self._view = ClusterView()
        self._keeper: LeaseKeeper | None = None
        self._keeper_client = client.clone() if client is not None else None
        self._lease_lost = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._callbacks: list[ChangeFn] = []
        self._etcd_ok = True
        self.polls = 0
        self._old_failures = 0  # refresh failures of leases replaced since
        self._last_ok_before: float | None = None  # the last good refresh of a lease replaced since
        self.refused = ""
        """Why this agent may not join ("": it may): its node name is held by another live agent."""
        self._resign_cause = ""
        """Set by ``resign`` (a fenced leader): the leader key is to be deleted at the next poll
        that reaches etcd; meanwhile this agent does not act as leader."""
        self._resign_done = False
        self._no_campaign_until = 0.0
        self.resignations = 0
        self.waited_for_name = False
        """Registration found our name under another lease and waited it out: the leader may have
        moved this node's jobs meanwhile (its previous run's lease expired)."""

    # -- reading ---------------------------------------------------------------------------------
    @property
    def solo(self) -> bool:
        return self.client is None

    @property
    def view(self) -> ClusterView:
        with self._lock:
            return self._view

    def members(self) -> dict[str, NodeInfo]:
        return dict(self.view.members)

    @property
    def leader(self) -> str | None:
        return self.view.leader

    @property
    def is_leader(self) -> bool:
        """Leader by the last read *and* our lease refreshed within its TTL.

        A leader cut off from etcd for a whole TTL has lost the key on the server; it stops acting
        as leader at once instead of waiting to read that (a cheap fence against two leaders).
        """
        if self.solo:
            return True
        keeper = self._keeper
        return (self.view.leader == self.me.node and keeper is not None and keeper.healthy
                and not self._resign_cause)

    def resign(self, cause: str) -> bool:
        """Give leadership up (a leader whose lease went unrefreshed past the fence): stop acting
        as leader now and delete the leader key as soon as etcd answers, so that another agent is
        elected without waiting for the key's lease to expire. This agent then stays out of the
        election for one TTL. Returns whether a resignation was started (it leads by its view)."""
        if self.solo or self._resign_cause or self.view.leader != self.me.node:
            return False
        self._resign_cause = cause or "fenced"
        self.emit("leader_resigning", f"node {self.me.node} gives up leadership ({self._resign_cause}); "
                  "the leader key is deleted as soon as etcd answers", {"node": self.me.node,
                                                                         "cause_": self._resign_cause,
                                                                         "severity": "warning"})
        self._bump()
        return True

    def claim(self) -> LeaderClaim:
        """This agent's claim to lead, for guarded writes (lease 0 while it has none: refused)."""
        keeper = self._keeper
        return LeaderClaim(self.leader_key, self.me.node, keeper.lease if keeper is not None else 0)

    @property
    def watching(self) -> bool:
        return self._watch is not None and self._watch.connected

    def _bump(self) -> None:
        with self._cond:
            self._gen += 1
            self._cond.notify_all()

    def wait_change(self, seen: int, timeout: float) -> int:
        """Block until etcd reported a change under the cluster prefix since generation ``seen``
        (or a stop, or ``timeout``); returns the current generation."""
        with self._cond:
            self._cond.wait_for(lambda: self._gen != seen or self._stop.is_set(), timeout)
            return self._gen

    @property
    def etcd_reachable(self) -> bool:
        return self.solo or self._etcd_ok

    def refresh_age(self) -> float | None:
        """Seconds since the newest lease refresh etcd answered was sent (None: never registered).
        Past the TTL the lease may be gone on the server and the leader may move this node's jobs."""
        keeper = self._keeper
        last = keeper.last_ok if keeper is not None else self._last_ok_before
        return None if last is None else self._clock() - last

    @property
    def refresh_failures(self) -> int:
        keeper = self._keeper
        return self._old_failures + (keeper.failures if keeper is not None else 0)

    def on_change(self, fn: ChangeFn) -> None:
        """``fn(view)`` after every change of members or leader (on the membership thread)."""
        self._callbacks.append(fn)

    # -- life cycle ------------------------------------------------------------------------------
    def start(self) -> None:
        if self.client is None:
            self._apply(ClusterView({self.me.node: self.me}, self.me.node, 0))
            return
        try:
            self._register()
        except NodeNameTaken as exc:
            self._refuse(exc)
            return
        except (*_ETCD_ERRORS, LeaseExpired) as exc:
            # etcd down at start-up: run on, keep trying from the thread (never crash the agent).
            self.emit("etcd_unreachable", f"cannot register in etcd yet, retrying: {exc}",
                      {"severity": "warning", "error": str(exc)[:300]})
            self._etcd_ok = False
            self._lease_lost.set()
        else:
            self._poll_once()
        if self.use_watch:
            self._watch = PrefixWatch(self.client.clone(), self.prefix, self._bump, idle_s=self.resync_s).start()
        self._thread = threading.Thread(target=self._run, name="cluster-membership", daemon=True)
        self._thread.start()

    def stop(self, leave: bool = True) -> None:
        """Stop polling; ``leave``: resign leadership and remove our keys now (clean shutdown)."""
        self._stop.set()
        self._bump()
        if self._watch is not None:
            self._watch.stop()
        if self._thread is not None:
            self._thread.join(5.0)
        keeper, self._keeper = self._keeper, None
        if self.client is None or keeper is None:
            return
        if leave:
            try:
                # A marker that outlives our registration by one TTL, so that the others read the
                # disappearance as a clean leave, not a loss.
                marker = self.client.grant(self.ttl)
                self.client.put(self.left_prefix + self.me.node, b"1", marker)
                self.client.delete_if(self.leader_key, self.me.node)
            except (*_ETCD_ERRORS, LeaseExpired) as exc:
                log.info("could not resign cleanly (the lease will expire): %s", exc)
        keeper.stop(revoke=leave)

    def _register(self) -> None:
        """Grant a lease, create our node key under it (only if absent), start keeping it alive.

        A key under another lease is this agent's own previous run (crashed; its lease runs out
        within the TTL) or another agent with the same name: wait until TTL + 1 s, then
        NodeNameTaken. Two agents owning one name would both run its jobs and both lead."""
        assert self.client is not None and self._keeper_client is not None
        key = self.nodes_prefix + self.me.node
        deadline = self._clock() + self.ttl + 1.0
        told = False
        while True:
            holder = self.client.get(key)
            if holder is None:
                sent = self._clock()
                lease = self.client.grant(self.ttl)
                created, holder = self.client.create(key, self.me.to_json(), lease)
                if created:
                    break
                self.client.revoke(lease)  # another agent took the name meanwhile
            if holder is not None and self._clock() >= deadline:
                raise NodeNameTaken(f"node name {self.me.node!r} is held by another live agent (lease "
                                    f"{holder.lease:x}, api {NodeInfo.from_json(self.me.node, holder.value).api or '?'}); "
                                    "give each agent its own agent.node")
            if not told:
                told = self.waited_for_name = True
                log.warning("node key %s exists under another lease; waiting up to %.0f s for it to expire",
                            key, self.ttl + 1.0)
            if self._stop.wait(0.25):
                raise NodeNameTaken("stopped while waiting for the node name")
        self._lease_lost.clear()
        self._keeper = LeaseKeeper(self._keeper_client, lease, self.ttl, on_expired=self._on_lease_expired,
                                   on_refresh=self._on_refresh, clock=self._clock, since=sent).start()

    def _refuse(self, exc: NodeNameTaken) -> None:
        """Stay out of the cluster for this run: no membership, no leadership, no cluster jobs."""
        if self._stop.is_set():
            return  # stopped while waiting for the name: a shutdown, not a refusal
        self.refused = str(exc)
        self._stop.set()
        with self._lock:
            self._view = ClusterView()
        log.error("not joining cluster %s: %s", self.cluster, exc)
        self.emit("cluster_join_refused", f"not joining the cluster: {exc}; this agent runs on without "
                  "cluster jobs", {"severity": "critical", "node": self.me.node})

    def _on_lease_expired(self, lease: int) -> None:
        self._lease_lost.set()
        self._bump()

    def _on_refresh(self, ok: bool) -> None:
        # A failed refresh is the earliest sign of an etcd stall (reads may be rare when watching).
        if not ok and self._etcd_ok:
            self._etcd_ok = False
            self.emit("etcd_unreachable", "etcd unreachable (lease refresh failed; retrying within the TTL), "
                      "membership view frozen", {"severity": "warning"})
        elif ok and not self._etcd_ok:
            self._bump()  # read again now; the read flips the state back and says so

    def _run(self) -> None:
        seen = self._gen
        while not self._stop.is_set():
            health.beat(self, "cluster-membership")
            seen = self.wait_change(seen, self.resync_s if self.watching else self.poll_s)
            if self._stop.is_set():
                return
            try:
                if self._lease_lost.is_set():
                    self._reregister()
                self._poll_once()
            except Exception as exc:  # noqa: BLE001 - the membership thread must never die
                log.exception("membership poll failed: %s", exc)

    def _reregister(self) -> None:
        old = self._keeper
        if old is not None:
            old.stop()
            self._old_failures += old.failures
            self._last_ok_before = old.last_ok
            self._keeper = None
        try:
            self._register()
        except NodeNameTaken as exc:
            self._refuse(exc)
            return
        except (*_ETCD_ERRORS, LeaseExpired) as exc:
            log.info("re-registering failed (retrying): %s", exc)
            self._lease_lost.set()
            return
        if old is None:
            self.emit("cluster_registered", f"node {self.me.node} registered in etcd", {"node": self.me.node})
        else:
            self.emit("cluster_lease_renewed", f"node {self.me.node}: lease had expired on the etcd server; "
                      "registered again with a new lease", {"node": self.me.node, "severity": "warning"})

    def _drop_leader_key(self) -> bool:
        """The resignation's etcd half: delete the leader key while it names this node. False
        while etcd does not answer (retried at the next poll)."""
        assert self.client is not None
        if self._resign_done:
            return True  # deleted at an earlier poll whose read then failed
        try:
            deleted = self.client.delete_if(self.leader_key, self.me.node)
        except _ETCD_ERRORS as exc:
            log.info("resigning: etcd does not answer yet (%s); retrying", exc)
            return False
        self._resign_done = True
        self._no_campaign_until = self._clock() + self.ttl
        self.resignations += 1
        self.emit("leader_resigned", f"node {self.me.node} resigned as leader ({self._resign_cause}); "
                  + ("leader key deleted, the others elect a new leader now" if deleted
                     else "the leader key was already gone"),
                  {"node": self.me.node, "deleted": deleted, "cause_": self._resign_cause, "severity": "warning"})
        return True

    def _poll_once(self) -> None:
        assert self.client is not None
        resigned = bool(self._resign_cause) and self._drop_leader_key()
        try:
            kvs, revision = self.client.get_prefix(self.prefix)
        except _ETCD_ERRORS as exc:
            if self._etcd_ok:
                self._etcd_ok = False
                self.emit("etcd_unreachable", f"etcd unreachable, membership view frozen: {exc}",
                          {"severity": "warning", "error": str(exc)[:300]})
            return
        if not self._etcd_ok:
            self._etcd_ok = True
            self.emit("etcd_reachable", "etcd reachable again", {})
        self.polls += 1
        members: dict[str, NodeInfo] = {}
        leader: str | None = None
        left: set[str] = set()
        for kv in kvs:
            if kv.key.startswith(self.nodes_prefix):
                name = kv.key[len(self.nodes_prefix):]
                members[name] = NodeInfo.from_json(name, kv.value)
            elif kv.key.startswith(self.left_prefix):
                left.add(kv.key[len(self.left_prefix):])
            elif kv.key == self.leader_key:
                leader = kv.value.decode(errors="replace")
        keeper = self._keeper
        if self.me.node not in members and keeper is not None and not self._lease_lost.is_set():
            # Our key is gone although the keeper has not noticed yet: the lease expired.
            self._lease_lost.set()
        if (leader is None and keeper is not None and not self._lease_lost.is_set() and keeper.healthy
                and self._clock() >= self._no_campaign_until):
            leader = self._campaign(keeper.lease) or leader
        self._apply(ClusterView(members, leader, revision), left)
        if resigned:
            self._resign_done = False
            self._resign_cause = ""  # the view read after the delete decides from here on

    def _campaign(self, lease: int) -> str | None:
        assert self.client is not None
        try:
            created, holder = self.client.create(self.leader_key, self.me.node, lease)
        except LeaseExpired:
            self._lease_lost.set()
            return None
        except _ETCD_ERRORS:
            return None
        if created:
            return self.me.node
        return holder.value.decode(errors="replace") if holder is not None else None

    def _apply(self, new: ClusterView, left: set[str] | frozenset[str] = frozenset()) -> None:
        with self._lock:
            old, self._view = self._view, new
        changed = False
        for name, info in new.members.items():
            if name not in old.members and name != self.me.node:
                changed = True
                self.emit("node_joined", f"node {name} joined the cluster", {"node": name, "api": info.api})
        for name in old.members:
            if name not in new.members:
                changed = True
                if name in left:
                    self.emit("node_left", f"node {name} left the cluster", {"node": name})
                else:
                    self.emit("node_lost", f"node {name} lost: its etcd lease expired",
                              {"node": name, "severity": "error"})
        if new.leader != old.leader:
            changed = True
            if new.leader is not None:
                self.emit("leader_elected", f"node {new.leader} is the cluster leader",
                          {"leader": new.leader, "previous": old.leader, "is_self": new.leader == self.me.node})
        if changed or not old.members:
            for fn in list(self._callbacks):
                try:
                    fn(new)
                except Exception as exc:  # noqa: BLE001
                    log.exception("cluster change callback failed: %s", exc)
