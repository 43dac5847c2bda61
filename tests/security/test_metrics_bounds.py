"""/metrics: loopback by default, a connection cap and a whole-connection deadline that slow
clients cannot outlast, and TLS with client certificates when configured."""

from __future__ import annotations

import contextlib
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import in_process_agent_config
from tests.helpers.pki import Pki
from trainguard.agent.api.tls import TlsFiles, client_context, server_context
from trainguard.agent.config import AgentConfig, ConfigError, config_from_dict
from trainguard.agent.daemon import Agent
from trainguard.agent.exporter import AgentExporter, serve_metrics, stop_metrics
from trainguard.agent.metrics_http import MetricsServerLimits


def _registry() -> Any:
    return AgentExporter(sources=[], build_info={"version": "t"}, collector_status=dict).registry


@pytest.fixture
def server() -> Iterator[Any]:
    srv, _port = serve_metrics(_registry(), "127.0.0.1", 0, limits=MetricsServerLimits(max_connections=4, timeout_s=1.0))
    try:
        yield srv
    finally:
        stop_metrics(srv)


def _get(port: int, ctx: ssl.SSLContext | None = None, timeout: float = 5.0) -> bytes:
    raw = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    with contextlib.closing(ctx.wrap_socket(raw, server_hostname="127.0.0.1") if ctx else raw) as c:
        c.sendall(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
        return b"".join(iter(lambda: c.recv(65536), b""))


def test_metrics_listen_on_loopback_unless_widened() -> None:
    assert AgentConfig().metrics.addr == "127.0.0.1:9478"
    assert config_from_dict({"metrics": {"addr": "0.0.0.0:9478"}}).metrics.addr == "0.0.0.0:9478"
    with pytest.raises(ConfigError, match=r"^metrics\.max_connections:"):
        config_from_dict({"metrics": {"max_connections": 0}})
    with pytest.raises(ConfigError, match=r"^metrics\.tls_ca:"):
        config_from_dict({"metrics": {"tls_cert": "/c", "tls_client_auth": True}})


def test_slow_clients_cannot_exhaust_threads_or_lock_out_a_scrape(server: Any) -> None:
    port = server.server_port
    threads_before = threading.active_count()
    slow: list[socket.socket] = []
    try:
        for _ in range(32):  # each sends half a request line and then nothing
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            s.sendall(b"GET /metrics HTTP/1.1\r\nX-Slow: ")
            slow.append(s)
        time.sleep(0.3)
        assert threading.active_count() <= threads_before + 4  # the cap, not one thread per client
        # A trickling client: a byte every 0.3 s beats any per-read timeout, not the deadline.
        trickle = slow[0]
        deadline = time.monotonic() + 10
        scraped = b""
        while time.monotonic() < deadline and not scraped.startswith(b"HTTP/1.0 200"):
            with contextlib.suppress(OSError):
                trickle.send(b"a")
            try:
                scraped = _get(port)
            except OSError:
                scraped = b""
            time.sleep(0.3)
        assert scraped.startswith(b"HTTP/1.0 200"), scraped[:80]
        assert b"trainguard_build_info" in scraped
        assert server.stats.rejected_busy >= 28
        assert server.stats.timed_out >= 1  # the trickler, cut at the deadline
        trickle.settimeout(5)
        with contextlib.suppress(OSError):
            assert trickle.recv(4096) == b""  # the server closed it
    finally:
        for s in slow:
            s.close()


def test_tls_with_client_certificates(tmp_path: Path) -> None:
    pki = Pki(tmp_path)
    files = pki.node("agent")
    srv, port = serve_metrics(_registry(), "127.0.0.1", 0, tls=server_context(files, prefix="metrics"),
                              limits=MetricsServerLimits(timeout_s=2.0))
    try:
        scraper = client_context(TlsFiles(cert=pki.node("prometheus").cert, key=pki.node("prometheus").key,
                                          ca=pki.ca_file))
        assert _get(port, scraper).startswith(b"HTTP/1.0 200")
        anonymous = client_context(TlsFiles(ca=pki.ca_file))
        with pytest.raises((ssl.SSLError, OSError)):
            body = _get(port, anonymous)
            if not body:  # TLS 1.3 reports the refused certificate on the first read
                raise ConnectionResetError("closed without a response")
        with pytest.raises((ssl.SSLError, OSError)):
            _get(port)  # plain HTTP to a TLS port gets nothing back
            raise ConnectionResetError("no response")
    finally:
        stop_metrics(srv)


def test_a_missing_metrics_certificate_names_its_key(tmp_path: Path) -> None:
    cfg = in_process_agent_config(tmp_path / "agent")
    cfg.metrics.tls_cert = str(tmp_path / "absent.pem")
    agent = Agent(cfg)
    try:
        with pytest.raises(ConfigError, match=r"^metrics\.tls_cert: no such file"):
            agent.start()
    finally:
        agent.shutdown()
