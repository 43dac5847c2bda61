"""Who is calling over the TCP API: the node names in a verified client certificate.

Each node's certificate names it (its common name or a DNS subjectAltName is the node name), as
kubelet's client certificates name their node. The TLS layer has already checked the chain to the
cluster's CA when these names are read, so they are as trustworthy as the CA. Node-scoped routes
(a peer copy's origin, forwarded telemetry's sender) accept only the caller's own node.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

MAX_NAMES = 32  # a certificate naming more than this many DNS names is not a node certificate


@dataclass(frozen=True)
class Caller:
    """The identity of one request. ``names`` None: not restricted to a node (the unix socket, whose
    file mode decides who may connect, or a TCP listener running under ``api.allow_plaintext``)."""

    names: frozenset[str] | None = None

    @property
    def restricted(self) -> bool:
        return self.names is not None

    def may_act_as(self, node: str) -> bool:
        return self.names is None or node in self.names

    def describe(self) -> str:
        if self.names is None:
            return "unrestricted"
        return ",".join(sorted(self.names)[:4]) or "(a certificate without names)"


UNRESTRICTED = Caller()


def names_from_peercert(cert: Mapping[str, Any] | None) -> frozenset[str]:
    """The common names and DNS subjectAltNames of ``ssl.SSLSocket.getpeercert()`` (IP entries are
    addresses, not node names, and are left out)."""
    if not cert:
        return frozenset()
    names: set[str] = set()
    for rdn in cert.get("subject", ()):
        for attr in rdn:
            if len(attr) == 2 and attr[0] == "commonName" and isinstance(attr[1], str):
                names.add(attr[1])
    for kind, value in cert.get("subjectAltName", ()):
        if kind == "DNS" and isinstance(value, str):
            names.add(value)
    return frozenset(sorted(names)[:MAX_NAMES])
