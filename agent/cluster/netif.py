"""Which network interface ranks of a spanning job bind gloo and NCCL to.

gloo advertises the address its host name resolves to unless ``GLOO_SOCKET_IFNAME`` names an
interface; with Debian's default ``127.0.1.1`` entry that is loopback, which no other host can
reach, and the job crash-loops with nothing but "rank 0 died". The agent knows the address peers
reach it at (``cluster.advertise``), so it names the interface that holds that address.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import psutil

InterfaceTable = Mapping[str, Sequence[Any]]
"""``psutil.net_if_addrs()``'s shape: interface name -> addresses with ``family`` and ``address``."""


def _host_of(advertise: str) -> str:
    host = advertise.removeprefix("http://").removeprefix("https://")
    host = host.rpartition(":")[0] if ":" in host and not host.endswith("]") else host
    return host.strip("[]")


def _addresses(host: str, resolve: Callable[[str], list[str]]) -> list[str]:
    try:
        return [str(ipaddress.ip_address(host))]
    except ValueError:
        pass
    try:
        return resolve(host)
    except OSError:
        return []


def _resolve(host: str) -> list[str]:
    return sorted({str(info[4][0]) for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)})


def interface_for(advertise: str, table: InterfaceTable | None = None,
                  resolve: Callable[[str], list[str]] = _resolve) -> str:
    """The interface holding the address of ``advertise`` (``HOST:PORT`` or a host), or "" when
    none here does (or the address is loopback: gloo finds that one without help)."""
    host = _host_of(advertise)
    if not host:
        return ""
    wanted = {a for a in _addresses(host, resolve) if not ipaddress.ip_address(a).is_loopback}
    if not wanted:
        return ""
    table = psutil.net_if_addrs() if table is None else table
    for name, addrs in sorted(table.items()):
        for addr in addrs:
            if getattr(addr, "family", None) not in (socket.AF_INET, socket.AF_INET6):
                continue
            text = str(getattr(addr, "address", "")).split("%", 1)[0]
            if text in wanted:
                return name
    return ""


def loopback_hostname(hostname: str | None = None, resolve: Callable[[str], list[str]] = _resolve) -> str:
    """The loopback address this host's name resolves to ("" when it resolves elsewhere or not at
    all): gloo would advertise it to ranks on other hosts."""
    name = hostname if hostname is not None else socket.gethostname()
    for addr in _addresses(name, resolve):
        if ipaddress.ip_address(addr).is_loopback:
            return addr
    return ""


def socket_ifname(advertise: str, table: InterfaceTable | None = None, hostname: str | None = None,
                  resolve: Callable[[str], list[str]] = _resolve) -> tuple[str, str]:
    """(interface for ``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME``, a warning or ""). The warning
    comes when the advertised address is routable, no interface here holds it, and the host name
    resolves to loopback: gloo will then advertise loopback to the other hosts."""
    host = _host_of(advertise)
    if not host:
        return "", ""
    addrs = _addresses(host, resolve)
    if not addrs or all(ipaddress.ip_address(a).is_loopback for a in addrs):
        return "", ""  # a cluster on one host's loopback: gloo's own choice reaches every rank
    name = interface_for(advertise, table, resolve)
    if name:
        return name, ""
    loop = loopback_hostname(hostname, resolve)
    if not loop:
        return "", ""
    me = hostname if hostname is not None else socket.gethostname()
    return "", (f"no interface here holds the advertised address {host} and host name {me!r} resolves to "
                f"{loop}: gloo ranks of spanning jobs will advertise loopback and peers on other hosts "
                f"cannot connect; set cluster.advertise to an address of this host, map {me!r} to a "
                "routable address in /etc/hosts, or set GLOO_SOCKET_IFNAME in the job's env")
