"""The control API server: HTTP/1.1 + JSON on a unix socket and, optionally, on TCP.

One thread per connection (``ThreadingMixIn``), so a slow client — a multi-GB blob transfer, a
stalled dashboard — never holds up anyone else; a connection cap answers 503 at once beyond it.
Everything a client can get wrong is answered with a JSON ``{"error": ...}`` and a status; a
handler that fails gets a 500 with a short message (the traceback goes to the agent's log only).

Usage::

    server = ApiServer(ApiConfig(unix_socket=..., tcp="0.0.0.0:9479", token_file=...),
                       handler, on_auth_failure=lambda remote, path: ...)
    server.start()            # binds both listeners; raises ApiServerError on failure
    server.tcp_address        # ("0.0.0.0", 9479): the real port when tcp asked for port 0
    server.tcp_port           # just the port
    server.reload()           # SIGHUP: re-read the token file
    server.stop()             # stop listening, remove our socket file
"""

from __future__ import annotations

import logging
import os
import socket
import socketserver
import ssl
import stat
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainguard.agent import health
from trainguard.agent.api.auth import TokenStore
from trainguard.agent.api.config import ApiConfig, parse_hostport
from trainguard.agent.api.handler import ApiHandler
from trainguard.agent.api.request import RequestHandler

log = logging.getLogger("trainguard.api")

AuthFailureFn = Callable[[str, str], None]  # (remote, path)
NodeRefusalFn = Callable[[str, str, str, str], None]  # (remote, caller names, claimed node, path)

MAX_REPORTED_PATH = 200  # characters of a client's path kept in a log line or event

_MAX_REJECTING = 8  # 503 answers in flight at once


# Auth failures reported to on_auth_failure: a burst of this many, then this many per second.
AUTH_REPORT_BURST = 20
AUTH_REPORT_PER_S = 1.0


class _Bucket:
    """Token bucket: ``take()`` is True at most ``burst`` times at once, refilled at ``rate``/s."""

    def __init__(self, burst: int, rate: float, clock: Callable[[], float]) -> None:
        self._burst = float(burst)
        self._rate = rate
        self._clock = clock
        self._level = float(burst)
        self._last = clock()
        self._lock = threading.Lock()

    def take(self) -> bool:
        with self._lock:
            now = self._clock()
            self._level = min(self._burst, self._level + (now - self._last) * self._rate)
            self._last = now
            if self._level < 1.0:
                return False
            self._level -= 1.0
            return True


class ApiServerError(RuntimeError):
    """The server cannot start (socket in use, path not a socket, ...); the message says why."""


class _Listener(socketserver.ThreadingMixIn):
    """What both listeners share: thread per connection, connection cap, a back reference."""

    daemon_threads = True
    request_queue_size = 128  # listen backlog; socketserver's 5 makes bursts of CLI calls fail
    block_on_close = False  # stop() must not wait for a 10 GB transfer to finish
    api: ApiServer
    is_unix = False

    def service_actions(self) -> None:
        # serve_forever calls this each time round its accept loop: the listener's heartbeat.
        health.beat(self, "api-unix" if self.is_unix else "api-tcp")

    def remote_of(self, request: socket.socket, client_address: Any) -> str:
        if isinstance(client_address, tuple) and len(client_address) >= 2:
            return f"{client_address[0]}:{client_address[1]}"
        return "unix"

    def peer_of(self, client_address: Any) -> str | None:
        """The key of the per-peer connection limit: the client's address (None: unix socket)."""
        if self.is_unix or not isinstance(client_address, tuple) or not client_address:
            return None
        return str(client_address[0])

    def process_request(self, request: Any, client_address: Any) -> None:
        peer = self.peer_of(client_address)
        if not self.api._admit(self, peer):
            self.api._reject_busy(request)
            return
        try:
            super().process_request(request, client_address)  # type: ignore[misc]
        except BaseException:
            self.api._release(self, peer)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            if isinstance(request, ssl.SSLSocket) and not self.api._handshake(request, self.remote_of(request, client_address)):
                return
            super().process_request_thread(request, client_address)
        finally:
            self.api._release(self, self.peer_of(client_address))


class _TcpListener(_Listener, socketserver.TCPServer):
    allow_reuse_address = True

    def get_request(self) -> tuple[Any, Any]:
        sock, addr = super().get_request()
        ctx = self.api.config.tls
        if ctx is not None:
            # The handshake runs in the connection's thread: a slow or silent client must not
            # hold up the accept loop.
            sock = ctx.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        return sock, addr


class _UnixListener(_Listener, socketserver.UnixStreamServer):
    is_unix = True

    def remote_of(self, request: socket.socket, client_address: Any) -> str:
        # Who is on the other end of a unix socket, for the event log.
        try:
            creds = request.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            pid, uid, gid = struct.unpack("3i", creds)
            return f"unix:pid={pid},uid={uid}"
        except (OSError, AttributeError):
            return "unix"


class ApiStats:
    """Counters the exporter turns into ``trainguard_api_*`` metrics; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._by_status: Counter[int] = Counter()

    def incr(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def count_status(self, status: int) -> None:
        with self._lock:
            self._by_status[status] += 1

    def snapshot(self) -> dict[str, Any]:
        """``{"requests_total", "auth_failures_total", "auth_failures_unreported_total",
        "handler_errors_total", "busy_rejected_total", "tls_refused_total", "node_refused_total",
        "peer_limited_total", "header_timeouts_total", "responses_total": {status: n}}``."""
        with self._lock:
            out: dict[str, Any] = {k: self._counts.get(k, 0) for k in (
                "requests_total", "auth_failures_total", "auth_failures_unreported_total",
                "handler_errors_total", "busy_rejected_total", "tls_refused_total", "node_refused_total",
                "peer_limited_total", "header_timeouts_total")}
            out["responses_total"] = dict(self._by_status)
            return out


_tmp_counter = 0
_tmp_lock = threading.Lock()


class ApiServer:
    """Both listeners of the control API around one ``ApiHandler``."""

    def __init__(self, config: ApiConfig, handler: ApiHandler, *,
                 on_auth_failure: AuthFailureFn | None = None,
                 on_node_refused: NodeRefusalFn | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.handler = handler
        self.tokens = TokenStore(config.token_file)  # raises TokenFileError: refuse to start
        self.stats = ApiStats()
        self._on_auth_failure = on_auth_failure
        self._on_node_refused = on_node_refused
        self._per_peer: Counter[str] = Counter()
        self._auth_reports = _Bucket(AUTH_REPORT_BURST, AUTH_REPORT_PER_S, clock)
        self._listeners: list[_TcpListener | _UnixListener] = []
        self._threads: list[threading.Thread] = []
        self._active: Counter[int] = Counter()  # per listener: a TCP flood cannot lock out local CLIs
        self._rejecting = 0
        self._active_lock = threading.Lock()
        self._unix_inode: int | None = None
        self._started = False
        if config.tcp is not None and len(self.tokens) == 0:
            log.warning("api: token file %s holds no token: every TCP request will get 401",
                        config.token_file)

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        if self._started:
            raise ApiServerError("api server already started")
        try:
            if self.config.unix_socket is not None:
                self._listeners.append(self._bind_unix(self.config.unix_socket))
            if self.config.tcp is not None:
                self._listeners.append(self._bind_tcp(self.config.tcp))
        except BaseException:
            self._close_listeners()
            raise
        self._started = True
        for lst in self._listeners:
            name = "api-unix" if lst.is_unix else "api-tcp"
            t = threading.Thread(target=lst.serve_forever, kwargs={"poll_interval": 0.1}, name=name, daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self) -> None:
        """Stop accepting; connections in flight finish on their own (daemon threads). Idempotent."""
        for lst in self._listeners:
            if self._started:
                lst.shutdown()
        for t in self._threads:
            t.join(timeout=5)
        self._close_listeners()
        self._threads.clear()
        self._started = False

    def __enter__(self) -> ApiServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def reload(self) -> int:
        """Re-read the token file (SIGHUP); returns the token count. TokenFileError keeps the old ones."""
        n = self.tokens.reload()
        log.info("api: token file reloaded, %d token(s)", n)
        return n

    @property
    def unix_path(self) -> Path | None:
        return self.config.unix_socket if any(lst.is_unix for lst in self._listeners) else None

    @property
    def tcp_address(self) -> tuple[str, int] | None:
        for lst in self._listeners:
            if not lst.is_unix:
                addr: Any = lst.server_address
                return str(addr[0]), int(addr[1])
        return None

    @property
    def tcp_port(self) -> int | None:
        """The TCP port actually bound (useful with ``tcp = "host:0"``); None without TCP."""
        addr = self.tcp_address
        return addr[1] if addr is not None else None

    # -- called by the request handler ---------------------------------------------------------

    def auth_failed(self, remote: str, path: str) -> None:
        path = truncate_path(path)
        self.stats.incr("auth_failures_total")
        # Every failure is counted; reports (a log line, the daemon's fsync'd event) are rate
        # limited, so a flood of bad requests cannot turn into a flood of disk writes.
        if not self._auth_reports.take():
            self.stats.incr("auth_failures_unreported_total")
            return
        log.warning("api: unauthenticated request from %s for %s", remote, path)
        if self._on_auth_failure is not None:
            try:
                self._on_auth_failure(remote, path)
            except Exception:
                log.exception("api: on_auth_failure callback failed")

    def _handshake(self, sock: ssl.SSLSocket, remote: str) -> bool:
        """Finish a TLS handshake; False (connection closed, counted, reported rate-limited) when
        the client spoke plain HTTP, had no certificate where one is required, or one we do not trust."""
        try:
            sock.settimeout(self.config.handshake_timeout_s)
            sock.do_handshake()
            return True
        except (ssl.SSLError, OSError) as exc:
            reason = getattr(exc, "reason", None) or type(exc).__name__
            if self._auth_reports.take():
                log.warning("api: TLS handshake with %s failed: %s", remote, reason)
                if self._on_auth_failure is not None:
                    try:
                        self._on_auth_failure(remote, f"(TLS handshake: {reason})")
                    except Exception:
                        log.exception("api: on_auth_failure callback failed")
            # Counted after the report: whoever sees the count move finds the event already there.
            self.stats.incr("tls_refused_total")
            try:
                sock.close()
            except OSError:
                pass
            return False

    def node_refused(self, remote: str, caller: str, node: str, path: str) -> None:
        """A verified node asked to act as another node: counted, reported (rate-limited)."""
        path = truncate_path(path)
        self.stats.incr("node_refused_total")
        if not self._auth_reports.take():
            return
        log.warning("api: %s (certificate names %s) may not act for node %r: %s", remote, caller, node[:80], path)
        if self._on_node_refused is not None:
            try:
                self._on_node_refused(remote, caller, node[:128], path)
            except Exception:
                log.exception("api: on_node_refused callback failed")

    def _admit(self, listener: object, peer: str | None = None) -> bool:
        with self._active_lock:
            if self._active[id(listener)] >= self.config.max_connections:
                return False
            if peer is not None and self._per_peer[peer] >= self.config.max_connections_per_peer:
                self.stats.incr("peer_limited_total")
                return False
            self._active[id(listener)] += 1
            if peer is not None:
                self._per_peer[peer] += 1
            return True

    def _release(self, listener: object, peer: str | None = None) -> None:
        with self._active_lock:
            self._active[id(listener)] -= 1
            if peer is not None:
                self._per_peer[peer] -= 1
                if self._per_peer[peer] <= 0:
                    del self._per_peer[peer]

    def _reject_busy(self, request: socket.socket) -> None:
        """Answer 503 on a short-lived thread; beyond a few of those, just hang up."""
        self.stats.incr("busy_rejected_total")
        with self._active_lock:
            if self._rejecting >= _MAX_REJECTING:
                request.close()
                return
            self._rejecting += 1
        threading.Thread(target=self._send_busy, args=(request,), name="api-busy", daemon=True).start()

    def _send_busy(self, request: socket.socket) -> None:
        body = b'{"error":"agent busy: too many connections, retry"}'
        try:
            # Read the request head first: closing on unread data resets the connection, and the
            # client would see a broken pipe instead of the 503.
            deadline = time.monotonic() + 1.0  # for the whole head: a trickling client gets no longer
            head = b""
            while b"\r\n\r\n" not in head and len(head) < 65536:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                request.settimeout(left)
                chunk = request.recv(65536)
                if not chunk:
                    break
                head += chunk
            request.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                            b"Content-Length: %d\r\nConnection: close\r\nRetry-After: 1\r\n\r\n%s"
                            % (len(body), body))
            request.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        finally:
            request.close()
            with self._active_lock:
                self._rejecting -= 1

    # -- binding -------------------------------------------------------------------------------

    def _bind_tcp(self, addr: str) -> _TcpListener:
        host, port = parse_hostport(addr)
        cls: type[_TcpListener] = _TcpListener
        if ":" in host:
            cls = type("_Tcp6Listener", (_TcpListener,), {"address_family": socket.AF_INET6})
        try:
            lst = cls((host, port), RequestHandler)
        except OSError as e:
            raise ApiServerError(f"api: cannot listen on {addr}: {e.strerror or e}") from e
        lst.api = self
        return lst

    def _bind_unix(self, path: Path) -> _UnixListener:
        global _tmp_counter
        parent = path.parent
        if not parent.exists():
            parent.mkdir(mode=0o750, parents=True, exist_ok=True)
            os.chmod(parent, 0o750)  # mkdir's mode is masked by the umask
        _clear_stale_socket(path)
        with _tmp_lock:
            _tmp_counter += 1
            tmp = parent / f".tg{os.getpid()}-{_tmp_counter}.sock"
        lst = _UnixListener(str(path), RequestHandler, bind_and_activate=False)
        lst.api = self
        try:
            # Bind aside, fix the mode, then rename into place: the socket is never reachable with
            # the umask's looser mode, and a client never sees a missing socket during a restart.
            lst.socket.bind(str(tmp))
            os.chmod(tmp, self.config.unix_mode)
            if self.config.unix_group is not None:
                import grp

                os.chown(tmp, -1, grp.getgrnam(self.config.unix_group).gr_gid)
            os.replace(tmp, path)
            self._unix_inode = os.lstat(path).st_ino
            lst.server_activate()
        except (OSError, KeyError) as e:
            lst.server_close()
            tmp.unlink(missing_ok=True)
            raise ApiServerError(f"api: cannot listen on {path}: {e}") from e
        return lst

    def _close_listeners(self) -> None:
        for lst in self._listeners:
            lst.server_close()
        self._listeners.clear()
        path = self.config.unix_socket
        if path is not None and self._unix_inode is not None:
            # Remove the socket only if it is still ours, not a newer agent's.
            try:
                if os.lstat(path).st_ino == self._unix_inode:
                    path.unlink()
            except FileNotFoundError:
                pass
            self._unix_inode = None


def truncate_path(path: str) -> str:
    """A client's request path as it goes into logs and events: at most ``MAX_REPORTED_PATH``
    characters, so a 64 KiB path cannot bloat (and rotate away) the audit trail."""
    if len(path) <= MAX_REPORTED_PATH:
        return path
    return path[: MAX_REPORTED_PATH - 3] + "..."


def _clear_stale_socket(path: Path) -> None:
    """Remove a socket file left by a dead agent; refuse when an agent still answers on it."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise ApiServerError(f"api: {path} exists and is not a socket; refusing to replace it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(str(path))
    except (ConnectionRefusedError, FileNotFoundError):
        path.unlink(missing_ok=True)
        log.info("api: replaced stale socket %s", path)
        return
    except OSError as e:
        raise ApiServerError(f"api: {path} is in use and does not answer ({e}); is another agent running?") from e
    finally:
        probe.close()
    raise ApiServerError(f"api: another agent is already serving on {path}")
