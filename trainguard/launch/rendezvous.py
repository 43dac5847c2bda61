"""Nodes meeting at a rendezvous endpoint through torch's c10d TCPStore, as torchrun's c10d
backend does: the node whose address is the endpoint's host serves the store, the others connect.

The protocol, under the key prefix ``trainguard/<run id>/``: ``round`` counts the rounds; a node
joins round ``r`` by taking a number from ``r<r>/count`` and writing what it brings
(``r<r>/node/<n>``). The round closes (``r<r>/closed`` = how many joined) at once when the most
nodes came, or when at least the fewest came and no one more joined for the last-call time. The
node first in order (``--node-rank``, then the order of the round before, then arrival) serves
the round's ranks their own store (``RankStore``: MASTER_ADDR:MASTER_PORT, a fresh port each
round), up before any node's ranks start, as torchrun's agent hosts it. While the round runs,
each node beats ``r<r>/beat/<group rank>``; any node ends the round by setting ``r<r>/restart``
(first writer wins; the winner counts a failure in ``failures``, writes ``r<r>/verdict`` and then
``r<r>/wake/<g>`` for every group rank ``g``), and the others see it at once: each node's watcher
thread blocks on its own wake key, on a connection of its own. Waits for a round to close poll
from a few milliseconds up to the polling interval, so that nodes rejoining together meet within
milliseconds while a long wait for a slow node costs little. A node that comes to a closed round with room left ends it too, as
torchrun's agents restart when ``num_nodes_waiting() > 0``. This module imports torch: it runs in
``trainguard run``'s own process, never in the agent.
"""

from __future__ import annotations

import datetime
import ipaddress
import itertools
import json
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from trainguard.launch.resumepoint import Agreed, Holdings

DEFAULT_PORT = 29400
"""torchrun's c10d endpoint port when HOST has none."""

FIRST_NAP_S = 0.002
"""The first pause of a wait on the store; each next one is half as long again, up to ``poll_s``."""

_FOREVER = datetime.timedelta(days=3650)
"""The watcher's wait timeout: released by its wake key, never by a timeout (a timed-out wait
leaves c10d's client with a reply it did not read)."""


class RankStore:
    """The store a round's ranks meet in (``TORCHELASTIC_USE_AGENT_STORE``), served by the first
    node's launcher from before the round's master is published: a rank that reaches it before
    it listens would wait out c10d's connect back-off (about half a second)."""

    def __init__(self, addr: str) -> None:
        self.store: Any = dist.TCPStore(addr, 0, is_master=True, wait_for_workers=False,
                                        timeout=datetime.timedelta(seconds=300))
        self.port = int(self.store.port)


class RendezvousError(RuntimeError):
    """The nodes could not meet (no store, no quorum in time): one line for the user."""


@dataclass(frozen=True)
class RdzvConfig:
    """How this node meets the others (torchrun's c10d rendezvous parameters)."""

    host: str
    """The endpoint's host: the node whose address it is serves the store."""
    port: int
    run_id: str
    """The rendezvous id (the job id), the same on every node: the store's key prefix."""
    min_nodes: int
    max_nodes: int
    nproc: int
    """Ranks this node brings to each round."""
    node_rank: int | None = None
    """Orders the nodes (group rank) where given; arrival order otherwise."""
    last_call_s: float = 30.0
    """torchrun's last_call_timeout: how long a round with enough nodes waits for more."""
    join_timeout_s: float = 600.0
    """torchrun's join_timeout: how long a round waits for its fewest nodes."""
    keepalive_s: float = 5.0
    keepalive_misses: int = 3
    """A peer whose beat does not move for ``keepalive_s * keepalive_misses`` is lost."""
    poll_s: float = 0.1
    """How often a waiting or running node looks at the store."""

    def __post_init__(self) -> None:
        if not 1 <= self.min_nodes <= self.max_nodes:
            raise ValueError(f"nodes {self.min_nodes}:{self.max_nodes}: MIN must be 1..MAX")
        for name in ("last_call_s", "join_timeout_s", "keepalive_s", "poll_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")


@dataclass(frozen=True)
class Round:
    """One closed round as this node sees it: what its ranks' torchrun environment says."""

    number: int
    nodes: int
    group_rank: int
    rank_offset: int
    world_size: int
    master_addr: str
    master_port: int
    restart_count: int
    """Failures before this round, cluster-wide (torchrun's TORCHELASTIC_RESTART_COUNT)."""
    members: list[dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True)
class Verdict:
    """Why a round ended: the cause, whether it was a failure, failures so far, the exit status."""

    cause: str
    failure: bool
    failures: int
    code: int
    streak: int = 0
    """Failures in a row without progress (the crash-loop guard's count)."""


def is_local(host: str) -> bool:
    """Whether ``host`` names this machine: an address of it can be bound here."""
    try:
        addrs = {str(info[4][0]) for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)}
    except OSError:
        return False
    for addr in addrs:
        family = socket.AF_INET6 if ipaddress.ip_address(addr).version == 6 else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as s:
            try:
                s.bind((addr, 0))
                return True
            except OSError:
                continue
    return False


def local_address(host: str, port: int) -> str:
    """The address of this node that reaches ``host``: the one the others reach it at."""
    try:
        info = socket.getaddrinfo(host, port, proto=socket.IPPROTO_UDP)[0]
        with socket.socket(info[0], socket.SOCK_DGRAM) as s:
            s.connect(info[4])  # no packet is sent: only the route is looked up
            return str(s.getsockname()[0])
    except OSError:
        return "127.0.0.1"


def open_store(cfg: RdzvConfig, timeout_s: float) -> tuple[dist.TCPStore, bool]:
    """The store at the endpoint: served here when the endpoint's host is this machine (a client
    when another process already serves the port), else reached as a client."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if is_local(cfg.host):
        try:
            return dist.TCPStore(cfg.host, cfg.port, is_master=True, wait_for_workers=False, timeout=timeout), True
        except (RuntimeError, OSError):
            pass  # the port is served already (a second node on this machine): join as a client
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return dist.TCPStore(cfg.host, cfg.port, is_master=False, timeout=datetime.timedelta(seconds=10)), False
        except (RuntimeError, OSError) as exc:
            if time.monotonic() > deadline:
                raise RendezvousError(f"rendezvous endpoint {cfg.host}:{cfg.port} unreachable: "
                                      f"{str(exc).splitlines()[0]}") from None
            time.sleep(1.0)


class Rendezvous:
    """This node's side of the rendezvous protocol (see the module doc)."""

    def __init__(self, cfg: RdzvConfig, store: Any | None = None, *, addr: str | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self.clock = clock
        self.serving = False
        if store is None:
            store, self.serving = open_store(cfg, cfg.join_timeout_s)
        self.store: Any = store
        self.addr = addr or local_address(cfg.host, cfg.port)
        self.hostname = socket.gethostname()
        self.next = -1
        self.last_group: int | None = None
        """This node's group rank in the round before (None before the first)."""
        self.token = f"{self.addr}/{os.getpid()}/{time.time_ns()}"
        self._beats: dict[int, tuple[int, float]] = {}
        self._watch_store: Any | None = None
        self.rank_store: RankStore | None = None
        """The ranks' store of this node's latest round, where this node served it."""

    def _key(self, name: str) -> str:
        return f"trainguard/{self.cfg.run_id}/{name}"

    def _has(self, name: str) -> bool:
        return bool(self.store.check([self._key(name)]))

    def _get(self, name: str) -> str:
        return bytes(self.store.get(self._key(name))).decode()

    def _counter(self, name: str) -> int:
        return int(self.store.add(self._key(name), 0))

    def _naps(self) -> Iterator[None]:
        """Sleep a little longer at each step: a short wait is seen within milliseconds, a long
        one polls every ``poll_s``."""
        for i in itertools.count():
            time.sleep(min(self.cfg.poll_s, FIRST_NAP_S * 1.5 ** i))
            yield

    # --- rounds -----------------------------------------------------------------------------------
    def join(self) -> Round:
        """Join the next open round and wait until it closes; raises ``RendezvousError`` when the
        fewest nodes do not come within the join timeout."""
        deadline = self.clock() + self.cfg.join_timeout_s
        while True:
            r = max(self.next, self._counter("round"))
            # A round someone ended but whose successor is not counted yet: wait for the count.
            naps = self._naps()
            while self._has(f"r{r}/restart") and self._counter("round") <= r:
                self._check(deadline)
                next(naps)
            if self._has(f"r{r}/restart"):
                continue
            got = self._join_round(r, deadline)
            if got is not None:
                self.next = r + 1
                return got

    def _check(self, deadline: float) -> None:
        if self.clock() > deadline:
            raise RendezvousError(f"rendezvous {self.cfg.run_id}: fewer than {self.cfg.min_nodes} node(s) came "
                                  f"within {self.cfg.join_timeout_s:.0f} s")

    def _join_round(self, r: int, deadline: float) -> Round | None:
        me = int(self.store.add(self._key(f"r{r}/count"), 1))
        self.store.set(self._key(f"r{r}/node/{me}"), json.dumps({
            "addr": self.addr, "host": self.hostname, "nproc": self.cfg.nproc, "node_rank": self.cfg.node_rank,
            "last": self.last_group}))
        seen, since = 0, self.clock()
        naps = self._naps()
        while not self._has(f"r{r}/closed"):
            if self._has(f"r{r}/restart"):
                return None  # ended before it closed (a node gave up on it): the next one
            count = self._counter(f"r{r}/count")
            if count != seen:
                seen, since = count, self.clock()
            if count >= self.cfg.max_nodes:
                self.store.compare_set(self._key(f"r{r}/closed"), "", str(self.cfg.max_nodes))
            elif count >= self.cfg.min_nodes and self.clock() - since >= self.cfg.last_call_s:
                self.store.compare_set(self._key(f"r{r}/closed"), "", str(count))
            else:
                self._check(deadline)
                next(naps)
        nodes = int(self._get(f"r{r}/closed"))
        if me > nodes:
            # Came after the round closed: a round with room left ends so that this node joins
            # the next one (torchrun's num_nodes_waiting); a full one is waited out.
            if nodes < self.cfg.max_nodes:
                self.end(r, f"node {self.hostname} ({self.addr}) joined", failure=False)
            while not self._has(f"r{r}/restart"):
                self._check(deadline)
                time.sleep(self.cfg.poll_s)
            return None
        self.store.wait([self._key(f"r{r}/node/{i}") for i in range(1, nodes + 1)])
        members = [dict(json.loads(self._get(f"r{r}/node/{i}")), arrival=i) for i in range(1, nodes + 1)]
        # --node-rank first; then the order of the round before, so that each node keeps its ranks
        # (and the snapshots of them it holds); newcomers last, by arrival.
        far = self.cfg.max_nodes + nodes
        members.sort(key=lambda m: (far if m["node_rank"] is None else m["node_rank"],
                                    far if m.get("last") is None else m["last"], m["arrival"]))
        group = next(g for g, m in enumerate(members) if m["arrival"] == me)
        offset = sum(int(m["nproc"]) for m in members[:group])
        world = sum(int(m["nproc"]) for m in members)
        self.rank_store = None  # the round before's ranks are stopped: its store goes with them
        if group == 0:
            self.rank_store = RankStore(self.addr)
            self.store.set(self._key(f"r{r}/master"), f"{self.addr}:{self.rank_store.port}")
        self.store.wait([self._key(f"r{r}/master")])
        master_addr, _, master_port = self._get(f"r{r}/master").rpartition(":")
        self._beats = {}
        self.last_group = group
        return Round(r, nodes, group, offset, world, master_addr, int(master_port), self._counter("failures"),
                     members)

    def agree(self, rnd: Round, held: Holdings) -> Agreed:
        """What every node's ranks of ``rnd`` resume from: the newest snapshot step all nodes hold
        (the world size unchanged), else the newest whole checkpoint any node holds, which the
        nodes that hold it send to the others' ranks at restore."""
        r = rnd.number
        self.store.set(self._key(f"r{r}/steps/{rnd.group_rank}"), json.dumps(
            {"snapshots": sorted(held.snapshots), "checkpoint": held.checkpoint}))
        keys = [self._key(f"r{r}/steps/{g}") for g in range(rnd.nodes)]
        self.store.wait(keys)
        offers = [Holdings.parse(bytes(self.store.get(key)).decode()) for key in keys]
        common = set(held.snapshots)
        for offer in offers:
            common &= set(offer.snapshots)
        snapshot = max(common) if common else None
        newest = max((o.checkpoint for o in offers if o.checkpoint is not None), default=None)
        if newest is None or (snapshot is not None and snapshot >= newest):
            return Agreed(snapshot, None, ())
        return Agreed(None, newest, tuple(g for g, o in enumerate(offers) if o.checkpoint == newest))

    # --- while a round runs -----------------------------------------------------------------------
    def end(self, r: int, cause: str, *, failure: bool = True, code: int = 1, progressed: bool | None = None
            ) -> Verdict:
        """End round ``r`` for every node (the first cause given wins) and return the verdict.
        ``progressed``: whether the round's ranks trained past the newest step before it (None:
        not known, so that every failure counts as one without progress)."""
        mine = json.dumps({"cause": cause, "by": self.token})
        if bytes(self.store.compare_set(self._key(f"r{r}/restart"), "", mine)).decode() == mine:
            failures = int(self.store.add(self._key("failures"), 1 if failure else 0))
            # Only the round's one winner writes the streak: a read and a write are enough.
            streak = int(self._get("streak")) if self._has("streak") else 0
            if failure:
                streak = 1 if progressed else streak + 1
                self.store.set(self._key("streak"), str(streak))
            self.store.set(self._key(f"r{r}/verdict"), json.dumps(
                {"cause": cause, "failure": failure, "failures": failures, "code": code, "streak": streak}))
            self.store.add(self._key("round"), 1)
            if self._has(f"r{r}/closed"):
                for g in range(int(self._get(f"r{r}/closed"))):
                    self.store.set(self._key(f"r{r}/wake/{g}"), "ended")
        return self.verdict(r)

    def ended(self, r: int) -> bool:
        return self._has(f"r{r}/restart")

    def watch(self, rnd: Round, on_end: Callable[[], None]) -> Callable[[], None]:
        """Call ``on_end`` (from a thread) as soon as a node ends ``rnd``; returns the function
        that lets the watcher go when this node leaves the round another way. The watcher waits
        on a connection of its own (``clone``): a blocking wait holds its connection."""
        if self._watch_store is None:
            self._watch_store = self.store.clone()
            self._watch_store.set_timeout(_FOREVER)
        store, key = self._watch_store, self._key(f"r{rnd.number}/wake/{rnd.group_rank}")

        def wait() -> None:
            try:
                store.wait([key])
            except RuntimeError:
                return  # the store went away: the round loop's own calls say so
            if bytes(store.get(key)).decode() == "ended":
                on_end()

        thread = threading.Thread(target=wait, name=f"rdzv-watch-r{rnd.number}", daemon=True)
        thread.start()

        def release() -> None:
            try:
                self.store.compare_set(key, "", "left")
            except RuntimeError:
                return  # the store went away: the watcher's wait fails too
            thread.join(timeout=5.0)

        return release

    def verdict(self, r: int) -> Verdict:
        self.store.wait([self._key(f"r{r}/verdict")])
        v = json.loads(self._get(f"r{r}/verdict"))
        return Verdict(str(v["cause"]), bool(v["failure"]), int(v["failures"]), int(v["code"]), int(v["streak"]))

    def beat(self, rnd: Round) -> list[int]:
        """Beat for this node and return the group ranks of peers whose beat stopped moving."""
        self.store.add(self._key(f"r{rnd.number}/beat/{rnd.group_rank}"), 1)
        now, lost = self.clock(), []
        for g in range(rnd.nodes):
            if g == rnd.group_rank:
                continue
            value = self._counter(f"r{rnd.number}/beat/{g}")
            last = self._beats.get(g)
            if last is None or last[0] != value:
                self._beats[g] = (value, now)
            elif now - last[1] > self.cfg.keepalive_s * self.cfg.keepalive_misses:
                lost.append(g)
        return lost

    def finish(self, rnd: Round, timeout_s: float = 30.0) -> bool:
        """This node's ranks finished: wait until every node's did (True) or the round ended
        another way (False). The node serving the store waits for the others to see it."""
        r = rnd.number
        self.store.add(self._key(f"r{r}/done"), 1)
        deadline = self.clock() + timeout_s
        while self._counter(f"r{r}/done") < rnd.nodes:
            if self.ended(r):
                return False
            if self.clock() > deadline:
                return True  # the others went away after their own ranks finished
            time.sleep(self.cfg.poll_s)
        self.store.add(self._key(f"r{r}/left"), 1)
        if self.serving:
            while self._counter(f"r{r}/left") < rnd.nodes and self.clock() < deadline:
                time.sleep(self.cfg.poll_s)
        return True
