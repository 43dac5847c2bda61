"""The ``[cluster]`` config section: etcd endpoints, lease, peer tier, healing."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from trainguard.agent.cluster.etcd import REFRESHES_PER_TTL, parse_endpoint

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
        for key in ("slots",):
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
        for key in ("peer_token_file", "blob_root", "etcd_ca", "etcd_cert", "etcd_key"):
            value = getattr(self, key)
            if value and not os.path.isabs(value):
                raise ValueError(f"cluster.{key}: must be an absolute path, got {value!r}")

    @property
    def fence_after_s(self) -> float:
        """Seconds without a successful lease refresh after which this agent fences its ranks."""
        room = self.lease_ttl_s * (1 - 1 / REFRESHES_PER_TTL) - self.etcd_timeout_s  # what a margin may take
        margin = self.fence_margin_s or min(max(1.0, self.lease_ttl_s / 4), room * 0.9)
        return self.lease_ttl_s - margin

    @property
    def solo(self) -> bool:
        return not self.etcd_endpoints
