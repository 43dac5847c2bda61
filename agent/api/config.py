"""Settings of the control API server (the ``[api]`` table of the agent's config)."""

from __future__ import annotations

import re
import ssl
from dataclasses import dataclass
from pathlib import Path

MIB = 1 << 20

# Longest unix socket path the kernel accepts (sun_path is 108 bytes with the terminating NUL).
MAX_UNIX_PATH_BYTES = 107


def parse_hostport(value: str, key: str = "api.tcp") -> tuple[str, int]:
    """``"host:port"`` or ``"[v6]:port"`` -> (host, port). Port 0 picks a free port."""
    m = re.fullmatch(r"\[(?P<v6>[0-9A-Fa-f:.]+)\]:(?P<port>\d+)|(?P<host>[^:\[\]]+):(?P<port2>\d+)", value)
    if m is None:
        raise ValueError(f"{key}: expected HOST:PORT (or [IPv6]:PORT), got {value!r}")
    host = m["v6"] or m["host"]
    port = int(m["port"] or m["port2"])
    if not 0 <= port <= 65535:
        raise ValueError(f"{key}: port {port} is outside 0-65535")
    return host, port


@dataclass
class ApiConfig:
    """Where and how the control API listens."""

    unix_socket: Path | None = Path("/run/trainguard/agent.sock")
    """Unix stream socket for the local CLI/TUI; None: no unix listener."""

    tcp: str | None = None
    """``HOST:PORT`` for peer agents and remote dashboards (port 0: any free port); None: no TCP."""

    token_file: Path | None = None
    """Bearer tokens, one per line, optionally ``TOKEN read|admin``; required with ``tcp``."""

    unix_requires_token: bool = False
    """False: whoever may open the socket (root, its group) is trusted, like docker.sock."""

    unix_mode: int = 0o660
    """File mode of the unix socket: connecting needs write permission on it."""

    unix_group: str | None = None
    """Group to own the unix socket (e.g. "trainguard"), so members can use the CLI without root."""

    max_body_bytes: int = MIB
    """Largest JSON request body; larger -> 413."""

    max_blob_bytes: int = 1 << 40
    """Largest blob upload (checkpoint shards); larger -> 413."""

    request_timeout_s: float = 30.0
    """Idle limit per socket read/write, so a stalled client frees its thread."""

    max_connections: int = 64
    """Connections served at once per listener (unix, TCP); more get 503 instead of piling up threads."""

    tls: ssl.SSLContext | None = None
    """Server context for the TCP listener (``agent.api.tls.server_context``); None: plain TCP,
    which the agent's config allows only with ``api.allow_plaintext``."""

    handshake_timeout_s: float = 10.0
    """A TLS client must finish its handshake within this (in the connection's own thread)."""

    allow_plaintext: bool = False
    """Serve ``tcp`` without TLS (loopback or a closed network only): callers then carry no node
    identity, so node-scoped routes cannot tell one node from another."""

    header_timeout_s: float = 10.0
    """A request's whole head (request line and headers) must arrive within this, however slowly
    it trickles in: a slowloris client is cut at the deadline instead of holding a thread."""

    max_connections_per_peer: int = 16
    """TCP connections served at once per client address: a few slow clients of one host cannot
    take every slot of ``max_connections`` from the other nodes."""

    def __post_init__(self) -> None:
        if self.unix_socket is not None:
            self.unix_socket = Path(self.unix_socket)
            if len(bytes(self.unix_socket)) > MAX_UNIX_PATH_BYTES:
                raise ValueError(
                    f"api.unix_socket: path is longer than {MAX_UNIX_PATH_BYTES} bytes, "
                    f"which unix sockets do not allow: {self.unix_socket}"
                )
        if self.token_file is not None:
            self.token_file = Path(self.token_file)
        if self.tcp is not None:
            parse_hostport(self.tcp)
            if self.token_file is None:
                raise ValueError("api.token_file: required when api.tcp is set (TCP clients need a token)")
        if self.unix_socket is None and self.tcp is None:
            raise ValueError("api.unix_socket: set it or api.tcp; the API needs somewhere to listen")
        if self.unix_requires_token and self.token_file is None:
            raise ValueError("api.token_file: required when api.unix_requires_token is true")
        if not 0 <= self.unix_mode <= 0o777:
            raise ValueError(f"api.unix_mode: must be a permission mode like 0o660, got {self.unix_mode!r}")
        if self.unix_mode & 0o007:
            raise ValueError(
                f"api.unix_mode: {self.unix_mode:04o} lets every user on the node drive the agent; "
                "use 0o660 and api.unix_group"
            )
        if self.max_body_bytes < 1024:
            raise ValueError(f"api.max_body_bytes: must be at least 1024, got {self.max_body_bytes}")
        if self.max_blob_bytes < 1:
            raise ValueError(f"api.max_blob_bytes: must be positive, got {self.max_blob_bytes}")
        if not self.request_timeout_s > 0:
            raise ValueError(f"api.request_timeout_s: must be > 0, got {self.request_timeout_s}")
        if self.max_connections < 1:
            raise ValueError(f"api.max_connections: must be at least 1, got {self.max_connections}")
        if not self.header_timeout_s > 0:
            raise ValueError(f"api.header_timeout_s: must be > 0, got {self.header_timeout_s}")
        if self.max_connections_per_peer < 1:
            raise ValueError(f"api.max_connections_per_peer: must be at least 1, got {self.max_connections_per_peer}")
        if self.tcp is not None:
            if self.tls is None and not self.allow_plaintext:
                raise ValueError("api.tls_cert: required when api.tcp is set (mutual TLS), "
                                 "or set api.allow_plaintext = true")
            if self.tls is not None and self.tls.verify_mode != ssl.CERT_REQUIRED:
                raise ValueError("api.tls_client_auth: the TCP API requires client certificates "
                                 "(each node's certificate names it)")
