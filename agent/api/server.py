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
    server.reload()           # SIGHUP: re-read the token file
    server.stop()             # stop listening, remove our socket file
"""

from __future__ import annotations

import json
import logging
import os
import socket
import socketserver
import stat
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from agent.api import routes
from agent.api.auth import Role, TokenStore, bearer_token
from agent.api.config import ApiConfig, parse_hostport
from agent.api.handler import ApiError, ApiHandler, Blob

log = logging.getLogger("trainguard.api")

AuthFailureFn = Callable[[str, str], None]  # (remote, path)

_CHUNK = 1 << 20
_MAX_REJECTING = 8  # 503 answers in flight at once


class ApiServerError(RuntimeError):
    """The server cannot start (socket in use, path not a socket, ...); the message says why."""


class _Reply(Exception):
    """Answer now with ``status`` and ``{"error": message}`` (used inside request handling)."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers or {}


class _BodyReader:
    """The request body as a ``BlobReader``: never reads past Content-Length, reads in chunks."""

    def __init__(self, rfile: Any, size: int) -> None:
        self._rfile = rfile
        self._size = size
        self._remaining = size

    @property
    def size(self) -> int:
        return self._size

    @property
    def remaining(self) -> int:
        return self._remaining

    def read(self, n: int = -1) -> bytes:
        if self._remaining <= 0:
            return b""
        want = self._remaining if n < 0 else min(n, self._remaining)
        data = self._rfile.read(want)
        if len(data) < want:
            self._remaining = 0
            raise ConnectionError(f"client sent {self._size - self._remaining + len(data)} of "
                                  f"{self._size} announced bytes")
        self._remaining -= len(data)
        return data


@dataclass(frozen=True)
class _Checked:
    """A request that passed the checks on its head (auth, route, role, size)."""

    route: routes.Route
    params: dict[str, str]
    query: dict[str, str]


def _linger_close(sock: socket.socket, max_s: float = 2.0, max_bytes: int = 64 << 20) -> None:
    """Half-close and read away what the client still sends, for a bounded time.

    Closing a TCP socket with unread input sends a reset, which can destroy the answer we just
    sent (a 413, a 401) before the client reads it.
    """
    try:
        sock.shutdown(socket.SHUT_WR)
        deadline = time.monotonic() + max_s
        total = 0
        while total < max_bytes:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            sock.settimeout(left)
            data = sock.recv(1 << 16)
            if not data:
                break
            total += len(data)
    except OSError:
        pass


class _RequestHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "trainguard-agent"
    sys_version = ""
    server: _Listener  # type: ignore[assignment]

    # -- plumbing ------------------------------------------------------------------------------

    def setup(self) -> None:
        super().setup()
        self.connection.settimeout(self.server.api.config.request_timeout_s)

    def address_string(self) -> str:
        return self.server.remote_of(self.request, self.client_address)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (BaseHTTPRequestHandler's name)
        log.debug("%s %s", self.address_string(), format % args)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        # The stdlib sends an HTML page here (bad request line, header too large, unknown method).
        self.close_connection = True
        self._send_json(code, {"error": message or self.responses.get(code, ("error",))[0]})

    def _send_json(self, status: int, obj: Any, headers: dict[str, str] | None = None) -> None:
        body = json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)
        self.server.api.stats.count_status(status)

    def do_GET(self) -> None:
        self._handle()

    do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = do_GET

    # -- one request ---------------------------------------------------------------------------

    _linger = False

    def parse_request(self) -> bool:
        # One handler object serves every request of a keep-alive connection: reset per request.
        self._checked: _Checked | None = None
        self._reader: _BodyReader | None = None
        self._body_unknown = False
        self._headers_sent = False
        self._linger = False
        return super().parse_request()

    def handle_expect_100(self) -> bool:
        # "Expect: 100-continue" (our client sends it with blobs): refuse before the client sends
        # a body of maybe gigabytes, not after.
        try:
            self._checked = self._precheck()
        except _Reply as r:
            self.close_connection = True
            self._linger = True
            self._send_json(r.status, {"error": r.message}, r.headers)
            return False
        return super().handle_expect_100()

    def finish(self) -> None:
        super().finish()
        if self._linger:
            _linger_close(self.connection)

    def _handle(self) -> None:
        api = self.server.api
        try:
            if self._checked is None:
                self._checked = self._precheck()
            self._serve(self._checked)
        except _Reply as r:
            if self._headers_sent:  # refused mid-stream: the only signal left is a cut connection
                self.close_connection = True
                return
            self._drain_or_close()
            self._send_json(r.status, {"error": r.message}, r.headers)
        except (ConnectionError, TimeoutError) as e:
            # The client went away or stalled: nobody to answer.
            log.debug("api: connection from %s dropped: %s", self.address_string(), e)
            self.close_connection = True
        except Exception:
            api.stats.incr("handler_errors_total")
            log.exception("api: %s %s failed", self.command, urlsplit(self.path).path)
            self.close_connection = True
            self._linger = self._unread() > 0
            if not self._headers_sent:
                try:
                    self._send_json(500, {"error": "internal error in the agent (see its log)"})
                except OSError:
                    pass

    def _unread(self) -> int:
        if self._body_unknown:
            return 1 << 62
        return self._reader.remaining if self._reader is not None else 0

    def _drain_or_close(self) -> None:
        """Answering with the request body unread: it would be parsed as the next request. Read a
        small one away; for a large one, close after the answer (lingering, so the client reads
        the answer instead of a connection reset)."""
        unread = self._unread()
        if unread == 0:
            return
        if unread <= self.server.api.config.max_body_bytes and self._reader is not None:
            while self._reader.read(_CHUNK):
                pass
            return
        self.close_connection = True
        self._linger = True

    def _precheck(self) -> _Checked:
        """Everything decided from the request head: auth, route, role, size. Raises _Reply."""
        api = self.server.api
        api.stats.incr("requests_total")
        split = urlsplit(self.path)
        path = split.path
        length = self._content_length()
        role = self._authenticate(path)
        route, params, allowed = routes.match(self.command, path)
        if route is None:
            if allowed:
                raise _Reply(405, f"{self.command} is not allowed on {path}",
                             {"Allow": ", ".join(sorted(set(allowed)))})
            raise _Reply(404, f"no such route: {path}")
        if route.role is not None and (role is None or role < route.role):
            raise _Reply(403, "this token is read-only; the request needs an admin token")
        if route.kind == routes.Kind.BLOB_IN:
            if length > api.config.max_blob_bytes:
                raise _Reply(413, f"blob of {length} bytes exceeds the limit of "
                                  f"{api.config.max_blob_bytes} bytes")
        elif length > api.config.max_body_bytes:
            raise _Reply(413, f"request body of {length} bytes exceeds the limit of "
                              f"{api.config.max_body_bytes} bytes")
        return _Checked(route, params, dict(parse_qsl(split.query, keep_blank_values=True)))

    def _serve(self, c: _Checked) -> None:
        api = self.server.api
        route = c.route
        try:
            if route.kind == routes.Kind.BLOB_IN:
                assert self._reader is not None
                result = route.call(api.handler, routes.Call(c.params, c.query, {}, self._reader))
                self._drain_or_close()  # the handler may stop reading early
                self._send_json(200, self._jsonable(result))
            elif route.kind == routes.Kind.BLOB_OUT:
                self._read_json_body()
                blob = route.call(api.handler, routes.Call(c.params, c.query, {}))
                self._send_blob(blob)
            else:
                body = self._read_json_body()
                result = route.call(api.handler, routes.Call(c.params, c.query, body))
                self._send_json(200, self._jsonable(result))
        except ApiError as e:
            raise _Reply(e.status, e.message) from None

    def _content_length(self) -> int:
        if self.headers.get("Transfer-Encoding"):
            self._body_unknown = True
            raise _Reply(411, "send a Content-Length; chunked request bodies are not accepted")
        raw = self.headers.get("Content-Length")
        if raw is None:
            length = 0
        else:
            try:
                length = int(raw)
            except ValueError:
                length = -1
            if length < 0:
                self._body_unknown = True
                raise _Reply(400, f"bad Content-Length {raw[:40]!r}")
        self._reader = _BodyReader(self.rfile, length)
        return length

    def _authenticate(self, path: str) -> Role | None:
        """The caller's role; raises 401. Public routes skip the check (None when no token)."""
        api = self.server.api
        if routes.is_public(path):
            return None
        token = bearer_token(self.headers.get("Authorization"))
        if token is None and self.server.is_unix and not api.config.unix_requires_token:
            return Role.ADMIN  # the socket's file mode already decided who may connect
        role = api.tokens.check(token) if token else None
        if role is None:
            api.auth_failed(self.address_string(), path)
            reason = "missing bearer token" if token is None else "invalid bearer token"
            raise _Reply(401, reason, {"WWW-Authenticate": 'Bearer realm="trainguard"'})
        return role

    def _read_json_body(self) -> dict[str, Any]:
        # The size was checked against max_body_bytes in _precheck.
        raw = self._reader.read() if self._reader is not None else b""
        if not raw:
            return {}
        try:
            body = json.loads(raw)
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            raise _Reply(400, f"request body is not valid JSON: {str(e)[:120]}") from None
        if not isinstance(body, dict):
            raise _Reply(400, "request body must be a JSON object")
        return body

    @staticmethod
    def _jsonable(result: Any) -> Any:
        if result is None:
            return {}
        if not isinstance(result, dict | list):
            raise TypeError(f"handler returned {type(result).__name__}, not a dict or list")
        return result

    def _send_blob(self, blob: Any) -> None:
        if not isinstance(blob, Blob):
            raise TypeError(f"get_blob returned {type(blob).__name__}, not a Blob")
        chunks = blob.chunks
        try:
            self.send_response(200)
            self.send_header("Content-Type", blob.content_type)
            self.send_header("Content-Length", str(blob.size))
            self.end_headers()
            self._headers_sent = True
            self.server.api.stats.count_status(200)
            sent = 0
            for chunk in chunks:
                if sent + len(chunk) > blob.size:
                    raise RuntimeError(f"blob produced more than its announced {blob.size} bytes")
                self.wfile.write(chunk)
                sent += len(chunk)
            if sent != blob.size:
                raise RuntimeError(f"blob produced {sent} of its announced {blob.size} bytes")
        finally:
            close = getattr(chunks, "close", None)
            if callable(close):
                close()


class _Listener(socketserver.ThreadingMixIn):
    """What both listeners share: thread per connection, connection cap, a back reference."""

    daemon_threads = True
    request_queue_size = 128  # listen backlog; socketserver's 5 makes bursts of CLI calls fail
    block_on_close = False  # stop() must not wait for a 10 GB transfer to finish
    api: ApiServer
    is_unix = False

    def remote_of(self, request: socket.socket, client_address: Any) -> str:
        if isinstance(client_address, tuple) and len(client_address) >= 2:
            return f"{client_address[0]}:{client_address[1]}"
        return "unix"

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.api._admit():
            self.api._reject_busy(request)
            return
        try:
            super().process_request(request, client_address)  # type: ignore[misc]
        except BaseException:
            self.api._release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.api._release()


class _TcpListener(_Listener, socketserver.TCPServer):
    allow_reuse_address = True


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
        """``{"requests_total", "auth_failures_total", "handler_errors_total", "busy_rejected_total",
        "responses_total": {status: n}}``."""
        with self._lock:
            out: dict[str, Any] = {k: self._counts.get(k, 0) for k in (
                "requests_total", "auth_failures_total", "handler_errors_total", "busy_rejected_total")}
            out["responses_total"] = dict(self._by_status)
            return out


_tmp_counter = 0
_tmp_lock = threading.Lock()


class ApiServer:
    """Both listeners of the control API around one ``ApiHandler``."""

    def __init__(self, config: ApiConfig, handler: ApiHandler, *,
                 on_auth_failure: AuthFailureFn | None = None) -> None:
        self.config = config
        self.handler = handler
        self.tokens = TokenStore(config.token_file)  # raises TokenFileError: refuse to start
        self.stats = ApiStats()
        self._on_auth_failure = on_auth_failure
        self._listeners: list[_TcpListener | _UnixListener] = []
        self._threads: list[threading.Thread] = []
        self._active = 0
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
        self.stats.incr("auth_failures_total")
        log.warning("api: unauthenticated request from %s for %s", remote, path)
        if self._on_auth_failure is not None:
            try:
                self._on_auth_failure(remote, path)
            except Exception:
                log.exception("api: on_auth_failure callback failed")

    def _admit(self) -> bool:
        with self._active_lock:
            if self._active >= self.config.max_connections:
                return False
            self._active += 1
            return True

    def _release(self) -> None:
        with self._active_lock:
            self._active -= 1

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
            request.settimeout(1.0)
            head = b""
            while b"\r\n\r\n" not in head and len(head) < 65536:
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
            lst = cls((host, port), _RequestHandler)
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
        lst = _UnixListener(str(path), _RequestHandler, bind_and_activate=False)
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
