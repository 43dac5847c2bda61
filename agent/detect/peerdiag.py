"""Why a rank could not reach its peers: read from the last lines of its log.

A rank of a job spanning nodes that fails while its process group is set up (gloo's full mesh,
NCCL's bootstrap, the c10d store) leaves a line naming the address it could not reach. The agent
turns that line into an event that names the node behind the address and the likely fix, so an
operator does not have to read every rank's log on every host to find a wrong interface or an
``/etc/hosts`` entry that resolves the host name to loopback.

The log is the rank's (a rank may write anything there): it is opened without following links,
only a regular file, only its last ``TAIL_BYTES`` are read, and every value taken from it is
matched by a strict pattern and bounded before it goes into an event.
"""

from __future__ import annotations

import ipaddress
import os
import re
import stat
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

TAIL_BYTES = 64 << 10
TAIL_LINES = 80
MAX_LINE = 2000

_HOST = r"[A-Za-z0-9][A-Za-z0-9.\-:]{0,252}"
# Each pattern names the address (host or IP) and, where the line has one, the port.
_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = (
    # gloo: "Gloo connectFullMesh failed with ... Connection refused, remote=[10.0.0.12]:4567"
    ("gloo", re.compile(r"remote=\[(?P<addr>" + _HOST + r")\](?::(?P<port>\d{1,5}))?")),
    # gloo pair.cc: "connect [10.0.0.12]:45678: Connection refused"
    ("gloo", re.compile(r"[Cc]onnect(?:ing)? (?:to )?\[(?P<addr>" + _HOST + r")\]:(?P<port>\d{1,5})")),
    # NCCL: "NET/Socket : Connect to 10.0.0.12<43211> failed : Connection refused"
    ("nccl", re.compile(r"Connect to (?P<addr>" + _HOST + r")<(?P<port>\d{1,5})> failed")),
    # c10d TCPStore: "... while trying to connect to (10.0.0.11, 29500)."
    ("c10d store", re.compile(r"trying to connect to \((?P<addr>" + _HOST + r"), (?P<port>\d{1,5})\)")),
    # c10d: "Connection to 10.0.0.11:29500 refused" / "failed to connect to 10.0.0.11:29500"
    ("c10d store", re.compile(r"(?:[Cc]onnection to|connect to) (?P<addr>[A-Za-z0-9][A-Za-z0-9.\-]{0,252})"
                              r":(?P<port>\d{1,5})")),
)
_REASONS = (
    ("refused", re.compile(r"[Cc]onnection refused|ECONNREFUSED")),
    ("timed out", re.compile(r"[Tt]imed? ?out|ETIMEDOUT")),
    ("no route", re.compile(r"[Nn]o route to host|[Nn]etwork is unreachable|EHOSTUNREACH|ENETUNREACH")),
    ("reset", re.compile(r"[Cc]onnection reset|ECONNRESET")),
)


@dataclass(frozen=True)
class Unreachable:
    """A peer address a rank could not reach, and what to do about it."""

    transport: str
    address: str
    port: int | None
    reason: str
    node: str | None
    """The cluster node behind ``address`` (None: not a known node's address)."""
    line: str
    fix: str

    def message(self, job: str, rank: int) -> str:
        where = f"{self.address}:{self.port}" if self.port is not None else self.address
        who = f"node {self.node} ({where})" if self.node else where
        return (f"job {job} rank {rank} could not reach {who} ({self.transport}: {self.reason}); "
                f"likely fix: {self.fix}")

    def fields(self) -> dict[str, Any]:
        return {"transport": self.transport, "address": self.address, "port": self.port, "reason": self.reason,
                "peer_node": self.node or "", "fix": self.fix, "log_line": self.line}


def read_tail(path: str, max_bytes: int = TAIL_BYTES, max_lines: int = TAIL_LINES) -> list[str]:
    """The last lines of a rank's log; [] when it is missing, not a regular file, or a link."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return []
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return []
        start = max(0, st.st_size - max_bytes)
        data = os.pread(fd, max_bytes, start)
    except OSError:
        return []
    finally:
        os.close(fd)
    lines = data.decode("utf-8", errors="replace").splitlines()
    if start > 0 and lines:
        lines = lines[1:]  # the first line is cut
    return [line[:MAX_LINE] for line in lines[-max_lines:]]


def _is_loopback(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return addr == "localhost"


def _fix(addr: str, node: str | None, reason: str) -> str:
    if _is_loopback(addr):
        return ("the peer's host name resolves to a loopback address: set cluster.advertise to the node's "
                "routable IP, fix /etc/hosts on that node, or set GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME to the "
                "interface that holds it")
    who = f"node {node}" if node else f"the host at {addr}"
    if reason == "refused":
        return (f"nothing listens there: {who} bound its ranks to another interface (set GLOO_SOCKET_IFNAME/"
                f"NCCL_SOCKET_IFNAME, or cluster.advertise on {who}) or its ranks had already exited")
    return (f"{who} is not reachable from here ({reason}): check the route and firewall between the nodes "
            f"for the rank ports, and that cluster.advertise on {who} is an address this node can reach")


def diagnose(lines: Iterable[str], node_of: Callable[[str], str | None] | None = None) -> Unreachable | None:
    """The last connection failure to a peer address in ``lines``, or None when there is none.

    ``node_of(address)``: the cluster node an address (or host name) belongs to, if any."""
    found: Unreachable | None = None
    for raw in lines:
        line = raw[:MAX_LINE]
        reason = next((name for name, pat in _REASONS if pat.search(line)), None)
        if reason is None:
            continue
        for transport, pat in _PATTERNS:
            m = pat.search(line)
            if m is None:
                continue
            addr = m.group("addr").rstrip(".:")
            port_text = m.groupdict().get("port")
            port = int(port_text) if port_text and 0 < int(port_text) < 65536 else None
            node = None
            if node_of is not None:
                try:
                    node = node_of(addr)
                except Exception:  # noqa: BLE001 - a lookup in live cluster state must not hide the diagnosis
                    node = None
            found = Unreachable(transport, addr, port, reason, node, line.strip()[:500], _fix(addr, node, reason))
            break
    return found
