"""The ``[cluster]`` config section: etcd endpoints, lease, peer tier, healing."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from trainguard.agent.cluster.etcd import parse_endpoint

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
    def solo(self) -> bool:
        return not self.etcd_endpoints
