"""The HTTP server behind ``/metrics``: bounded connections, a whole-connection deadline, optional TLS.

prometheus-client's own server starts a thread per connection with no limit and no timeout, so a
handful of clients that connect and never finish a request would hold threads forever. Here at
most ``max_connections`` connections are served at once (more are answered 503 and closed at
once), every socket has ``timeout_s`` per read and write, and the accept loop closes any
connection older than ``timeout_s`` however slowly it trickles bytes, so a scrape gets through
within that time whatever the slow clients do.
"""

from __future__ import annotations

import logging
import socket
import socketserver
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import HTTPServer
from typing import Any

from prometheus_client.exposition import MetricsHandler
from prometheus_client.registry import CollectorRegistry

from trainguard.agent import health

log = logging.getLogger(__name__)

_BUSY = b"HTTP/1.0 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


@dataclass(frozen=True)
class MetricsServerLimits:
    max_connections: int = 16
    """Connections served at once; more are answered 503 and closed."""
    timeout_s: float = 10.0
    """Per socket operation, and for the whole connection (TLS handshake, request, response)."""


@dataclass
class MetricsServerStats:
    served: int = 0
    rejected_busy: int = 0
    timed_out: int = 0
    errors: int = 0


class _Server(socketserver.ThreadingMixIn, HTTPServer):
    daemon_threads = True
    block_on_close = False
    request_queue_size = 64
    limits: MetricsServerLimits
    tls: ssl.SSLContext | None
    stats: MetricsServerStats

    def server_bind(self) -> None:
        # HTTPServer.server_bind does a reverse DNS lookup of the address (getfqdn): not wanted.
        socketserver.TCPServer.server_bind(self)
        host, port = self.server_address[:2]
        self.server_name, self.server_port = str(host), int(port)

    def setup_limits(self, limits: MetricsServerLimits, tls: ssl.SSLContext | None) -> None:
        self.limits = limits
        self.tls = tls
        self.stats = MetricsServerStats()
        self._slots = threading.BoundedSemaphore(limits.max_connections)
        self._open: dict[socket.socket, list[Any]] = {}
        """Raw socket -> [accepted at, the socket to shut down (the TLS one once wrapped)]."""
        self._open_lock = threading.Lock()

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.stats.rejected_busy += 1
            try:
                request.setblocking(False)
                request.send(_BUSY)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        request.settimeout(self.limits.timeout_s)
        with self._open_lock:
            self._open[request] = [time.monotonic(), request]
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._done(request)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            conn = request
            if self.tls is not None:
                try:
                    conn = self.tls.wrap_socket(request, server_side=True)
                except (OSError, ssl.SSLError) as exc:
                    self.stats.errors += 1
                    log.debug("metrics: TLS handshake with %s failed: %s", client_address, exc)
                    self.shutdown_request(request)
                    return
                with self._open_lock:
                    if request in self._open:
                        self._open[request][1] = conn
            super().process_request_thread(conn, client_address)
            self.stats.served += 1
        finally:
            self._done(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that vanished or timed out is not worth a traceback on stderr.
        self.stats.errors += 1
        log.debug("metrics: connection from %s failed", client_address, exc_info=True)

    def _done(self, request: Any) -> None:
        with self._open_lock:
            found = self._open.pop(request, None) is not None
        if found:
            self._slots.release()

    def service_actions(self) -> None:
        # Once per round of the accept loop: the heartbeat, and the deadline of every connection.
        health.beat(self, "metrics-http")
        deadline = time.monotonic() - self.limits.timeout_s
        with self._open_lock:
            late = [entry[1] for entry in self._open.values() if entry[0] < deadline]
        for sock in late:
            self.stats.timed_out += 1
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes the connection's thread, which then ends
            except OSError:
                pass


def serve(registry: CollectorRegistry, host: str, port: int, *, limits: MetricsServerLimits | None = None,
          tls: ssl.SSLContext | None = None, name: str = "metrics-http",
          thread_factory: Callable[..., threading.Thread] = threading.Thread) -> _Server:
    """Start serving ``registry`` on a daemon thread; ``server.server_port`` is the bound port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    server_cls = type("MetricsServer", (_Server,), {"address_family": family})
    server: _Server = server_cls((host, port), MetricsHandler.factory(registry))
    server.setup_limits(limits or MetricsServerLimits(), tls)
    thread = thread_factory(target=server.serve_forever, kwargs={"poll_interval": 0.25}, name=name, daemon=True)
    thread.start()
    return server
