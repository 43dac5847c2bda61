"""The ``[cluster]`` config section: etcd endpoints, lease, peer tier, healing."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from trainguard.agent.cluster.etcd import REFRESHES_PER_TTL, parse_endpoint
from trainguard.agent.cluster.signing import load_key

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")


@dataclass
class ClusterConfig:
    name: str = "default"
    """Cluster name: agents with the same etcd and name form one cluster (etcd key prefix)."""
    etcd_endpoints: list[str] = field(default_factory=list)
    """``HOST:PORT`` of etcd members; empty: this node is a cluster of one and its own leader."""
    lease_ttl_s: int = 10
    """A node is declared lost this long after its last lease refresh reached etcd."""
    poll_s: float = 0.5
    """How often membership, leader and job keys are read from etcd while no watch stream is up
    (and how often this agent's own job states are checked for changes to publish)."""
    watch: bool = True
    """Read etcd when a watch stream reports a change (plus every ``resync_s``) instead of polling:
    etcd load stays flat as the cluster grows."""
    resync_s: float = 10.0
    """Full re-read interval while watching (a missed event costs at most this much latency)."""
    etcd_timeout_s: float = 1.0
    """Per-request timeout; a failed refresh is retried until the TTL, never counted as loss."""
    etcd_ca: str = ""
    """PEM CA bundle etcd's server certificate must chain to; set, etcd is spoken to over HTTPS."""
    etcd_cert: str = ""
    """PEM client certificate for etcd (its ``--client-cert-auth``); with ``etcd_key``."""
    etcd_key: str = ""
    """PEM private key of ``etcd_cert``."""
    etcd_plaintext: bool = False
    """Speak to etcd over plain HTTP without client certificates (loopback or a closed network only):
    whoever reaches etcd then reaches every node's job records; the agent warns at every start."""
    key_file: str = ""
    """The cluster key (0600, owned by the agent's user, >= 32 characters; the same file on every
    node): job records and peer-copy manifests are signed with it. Required with etcd_endpoints."""
    advertise: str = ""
    """``HOST:PORT`` peers use to reach this agent's TCP API; empty: the API's bound address."""
    slots: int = 0
    """Ranks (GPUs) this node can run; 0: unknown (placement then trusts the job spec)."""
    peer: str = ""
    """Node that holds this node's peer-tier copy; empty: ring placement (next node by name)."""
    peer_token_file: str = ""
    """Token presented to peer agents; empty: the first token of ``api.token_file``."""
    peer_interval: int = 100
    """Copy a memory checkpoint to the peer every this many steps (like ``checkpoint.memory_interval``)."""
    peer_keep: int = 2
    """Peer-tier checkpoints kept per job at the peer."""
    blob_root: str = ""
    """Shared-memory directory for checkpoint data other agents push here; empty:
    ``<checkpoint.memory_root>/peer-held``."""
    blob_max_bytes: int = 0
    """Bytes of other nodes' checkpoint copies this node holds at most (0: half the size of the
    blob root's filesystem, e.g. /dev/shm); an upload beyond it is refused (507) and reported."""
    blob_max_bytes_per_origin: int = 0
    """Bytes held at most for any one origin node (0: half of ``blob_max_bytes``), so one node
    cannot crowd out the others' copies."""
    blob_min_free_bytes: int = 0
    """Free space an upload must leave on the blob root's filesystem (0: 5 % of it, at most 1 GiB)."""
    peer_timeout_s: float = 30.0
    """Socket timeout for one blob transfer request."""
    held_retention_s: float = 3600.0
    """Copies held for a node that is no longer a member are dropped after this long without a new
    copy (its job has moved and checkpoints anew, or it is gone for good)."""
    fence_margin_s: float = 0.0
    """An agent whose lease refresh has not reached etcd for ``lease_ttl_s - fence_margin_s`` stops
    (SIGSTOP, then kill) the ranks of every job the leader could move elsewhere, before the lease
    can expire on the server; 0: ``max(1, lease_ttl_s / 4)``, kept above one refresh period."""
    heal: bool = True
    """Leader restarts jobs of a lost node on the remaining nodes."""
    rejoin: bool = True
    """A job spanning nodes that lost dp with a node grows back to its submitted dp at its next
    restart point once nodes have room again (false: it stays at the reduced size)."""
    decision_timeout_s: float | None = None
    """The leader's deadline for one decision's calls to members (API probes, checkpoint listings and
    manifests, all at once): a member that has not answered by then is unreachable for that decision.
    Must be below ``lease_ttl_s``; unset: 2 s, or half the TTL when that is less."""
    fence_grace_s: float = 2.0
    """After a node's key disappears the leader waits this long before placing its jobs elsewhere,
    so the cut-off node (which fences its ranks before its TTL ends) has stopped them first."""
    lineage_wait_s: float | None = None
    """How long the leader waits for an unreachable node that committed a newer step than any it
    can restore before it restarts from older state (event ``lineage_steps_given_up``); unset:
    3 x ``lease_ttl_s``."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise ValueError(f"cluster.name: use letters, digits, '_', '.', '-' (max 63), got {self.name!r}")
        for i, ep in enumerate(self.etcd_endpoints):
            try:
                parse_endpoint(ep)
            except ValueError as exc:
                raise ValueError(f"cluster.etcd_endpoints[{i}]: {exc}") from None
        if isinstance(self.lease_ttl_s, bool) or not isinstance(self.lease_ttl_s, int) or self.lease_ttl_s < 2:
            raise ValueError(f"cluster.lease_ttl_s: must be an integer >= 2 (etcd's minimum), got {self.lease_ttl_s!r}")
        for key in ("poll_s", "etcd_timeout_s", "peer_timeout_s", "held_retention_s", "resync_s"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise ValueError(f"cluster.{key}: must be > 0, got {value!r}")
        if self.poll_s >= self.lease_ttl_s:
            raise ValueError(f"cluster.poll_s: must be below lease_ttl_s ({self.lease_ttl_s}), got {self.poll_s}")
        if self.etcd_timeout_s >= self.lease_ttl_s / 3:
            raise ValueError(f"cluster.etcd_timeout_s: must be below lease_ttl_s / 3 so a refresh can be "
                             f"retried within the TTL, got {self.etcd_timeout_s}")
        if self.decision_timeout_s is not None and (
                isinstance(self.decision_timeout_s, bool) or not isinstance(self.decision_timeout_s, int | float)
                or not 0 < self.decision_timeout_s < self.lease_ttl_s):
            raise ValueError(f"cluster.decision_timeout_s: must be > 0 and below lease_ttl_s ({self.lease_ttl_s}), "
                             f"got {self.decision_timeout_s!r}")
        for key in ("fence_grace_s", "lineage_wait_s"):
            value = getattr(self, key)
            if value is None and key == "lineage_wait_s":
                continue
            if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                raise ValueError(f"cluster.{key}: must be >= 0, got {value!r}")
        margin = self.fence_margin_s
        if isinstance(margin, bool) or not isinstance(margin, int | float) or margin < 0:
            raise ValueError(f"cluster.fence_margin_s: must be >= 0 (0: automatic), got {margin!r}")
        if margin and self.lease_ttl_s - margin <= self.lease_ttl_s / REFRESHES_PER_TTL + self.etcd_timeout_s:
            raise ValueError(f"cluster.fence_margin_s: must leave more than one refresh period plus etcd_timeout_s "
                             f"({self.lease_ttl_s / REFRESHES_PER_TTL + self.etcd_timeout_s:g} s) of the "
                             f"{self.lease_ttl_s} s lease, "
                             f"so that a healthy agent never fences; got {margin!r}")
        if self.advertise:
            try:
                parse_endpoint(self.advertise)
            except ValueError as exc:
                raise ValueError(f"cluster.advertise: {exc}") from None
        for key in ("slots", "blob_max_bytes", "blob_max_bytes_per_origin", "blob_min_free_bytes"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"cluster.{key}: must be a non-negative integer, got {value!r}")
        for key in ("peer_interval", "peer_keep"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"cluster.{key}: must be a positive integer, got {value!r}")
        if self.peer and not _NAME.match(self.peer):
            raise ValueError(f"cluster.peer: not a node name: {self.peer!r}")
        if bool(self.etcd_cert) != bool(self.etcd_key):
            raise ValueError("cluster.etcd_cert: etcd_cert and etcd_key go together")
        for key in ("peer_token_file", "blob_root", "etcd_ca", "etcd_cert", "etcd_key", "key_file"):
            value = getattr(self, key)
            if value and not os.path.isabs(value):
                raise ValueError(f"cluster.{key}: must be an absolute path, got {value!r}")
        self._check_trust()

    def _check_trust(self) -> None:
        """etcd over TLS with a client certificate unless plaintext is asked for; the cluster key."""
        if self.etcd_plaintext and (self.etcd_ca or self.etcd_cert):
            raise ValueError("cluster.etcd_plaintext: true, but etcd_ca/etcd_cert are set too; drop one")
        if self.etcd_endpoints and not self.etcd_plaintext:
            if not self.etcd_ca:
                raise ValueError("cluster.etcd_ca: required with etcd_endpoints (etcd over TLS with client "
                                 "certificates), or set cluster.etcd_plaintext = true on a closed network")
            if not self.etcd_cert:
                raise ValueError("cluster.etcd_cert: required with etcd_endpoints (etcd's --client-cert-auth), "
                                 "or set cluster.etcd_plaintext = true on a closed network")
        if self.etcd_endpoints and not self.key_file:
            raise ValueError("cluster.key_file: required with etcd_endpoints (the key job records and peer "
                             "copies are signed with; the same 0600 file on every node)")
        if self.key_file:
            load_key(self.key_file)

    @property
    def decision_timeout(self) -> float:
        """``decision_timeout_s``, or min(2 s, TTL / 2) when unset."""
        if self.decision_timeout_s is not None:
            return float(self.decision_timeout_s)
        return min(2.0, self.lease_ttl_s / 2)

    @property
    def lineage_wait(self) -> float:
        """``lineage_wait_s``, or 3 x the lease TTL when unset."""
        return float(self.lineage_wait_s) if self.lineage_wait_s is not None else 3.0 * self.lease_ttl_s

    @property
    def fence_after_s(self) -> float:
        """Seconds without a successful lease refresh after which this agent fences its ranks."""
        room = self.lease_ttl_s * (1 - 1 / REFRESHES_PER_TTL) - self.etcd_timeout_s  # what a margin may take
        margin = self.fence_margin_s or min(max(1.0, self.lease_ttl_s / 4), room * 0.9)
        return self.lease_ttl_s - margin

    @property
    def solo(self) -> bool:
        return not self.etcd_endpoints

    def blob_quotas(self, root: str) -> tuple[int, int, int]:
        """(total, per origin, free space kept) in bytes for a blob store at ``root``, the zeros
        resolved against the size of the filesystem that holds it."""
        path = os.path.abspath(root)
        while not os.path.exists(path) and os.path.dirname(path) != path:
            path = os.path.dirname(path)
        try:
            st = os.statvfs(path)
            fs_size = st.f_blocks * st.f_frsize
        except OSError:
            fs_size = 0
        total = self.blob_max_bytes or fs_size // 2
        per_origin = self.blob_max_bytes_per_origin or total // 2
        min_free = self.blob_min_free_bytes or min(1 << 30, fs_size // 20)
        return total, per_origin, min_free
