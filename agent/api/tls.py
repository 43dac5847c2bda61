"""TLS for the cross-node API: the server's context, the client's, and one-line errors.

Agents talk to each other over the TCP API (job placement, peer checkpoint copies, forwarded
telemetry) with bearer tokens and checkpoint bytes in the body: on a shared network both must be
encrypted and the peer must be who it claims. The server presents ``cert``/``key``; with
``client_auth`` it also requires a client certificate that chains to ``ca`` (mutual TLS: only
agents holding a certificate of the cluster's CA get as far as the token check). As a client an
agent verifies the server against ``ca`` (hostname or IP in the certificate's subjectAltName) and
presents its own certificate when it has one. TLS 1.2 is the floor.
"""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass


class TlsConfigError(ValueError):
    """A TLS file that is missing or unreadable; the message names the key and the file."""


@dataclass(frozen=True)
class TlsFiles:
    cert: str = ""
    """PEM certificate chain this side presents (server: required for TLS; client: for mutual TLS)."""
    key: str = ""
    """PEM private key of ``cert``."""
    ca: str = ""
    """PEM bundle the other side's certificate must chain to (empty on a client: the system's CAs)."""
    client_auth: bool = False
    """Server: refuse a client without a certificate chaining to ``ca``."""

    @property
    def enabled(self) -> bool:
        return bool(self.cert)


def _readable(key: str, path: str) -> None:
    if not os.path.isfile(path):
        raise TlsConfigError(f"{key}: no such file {path!r}")
    if not os.access(path, os.R_OK):
        raise TlsConfigError(f"{key}: {path!r} is not readable by this user")


def _load_chain(ctx: ssl.SSLContext, files: TlsFiles, prefix: str) -> None:
    _readable(f"{prefix}.tls_cert", files.cert)
    _readable(f"{prefix}.tls_key", files.key or files.cert)
    try:
        ctx.load_cert_chain(files.cert, files.key or None)
    except (ssl.SSLError, OSError) as exc:
        raise TlsConfigError(f"{prefix}.tls_cert: cannot load {files.cert!r} with key {files.key!r}: {exc}") from None


def _load_ca(ctx: ssl.SSLContext, path: str, prefix: str) -> None:
    _readable(f"{prefix}.tls_ca", path)
    try:
        ctx.load_verify_locations(cafile=path)
    except (ssl.SSLError, OSError) as exc:
        raise TlsConfigError(f"{prefix}.tls_ca: cannot load {path!r}: {exc}") from None


def server_context(files: TlsFiles, prefix: str = "api") -> ssl.SSLContext:
    """The listener's context; raises TlsConfigError naming the key of a bad file."""
    if not files.cert:
        raise TlsConfigError(f"{prefix}.tls_cert: required to serve TLS")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    _load_chain(ctx, files, prefix)
    if files.client_auth:
        if not files.ca:
            raise TlsConfigError(f"{prefix}.tls_ca: required when {prefix}.tls_client_auth is true")
        _load_ca(ctx, files.ca, prefix)
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def context_for_cli(ca: str | None, cert: str | None, key: str | None) -> ssl.SSLContext | None:
    """The CLI's and the dashboard's context from ``--tls-ca/--tls-cert/--tls-key`` (None: none
    given, plain HTTP); raises TlsConfigError naming the flag of a bad file."""
    if not (ca or cert):
        return None
    try:
        return client_context(TlsFiles(cert or "", key or "", ca or ""), prefix="--tls")
    except TlsConfigError as exc:
        raise TlsConfigError(str(exc).replace("--tls.tls_", "--tls-")) from None


def client_context(files: TlsFiles, prefix: str = "api") -> ssl.SSLContext:
    """The context an agent (or the CLI, the dashboard) connects to a TLS agent with."""
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if files.ca:
        _load_ca(ctx, files.ca, prefix)
    if files.cert:
        _load_chain(ctx, files, prefix)
    return ctx
