"""One HTTP request of the control API: parse, check, dispatch to the handler, answer.

Everything is decided from the request head first (token, route, role, size), so a refusal costs
the client one round trip (with ``Expect: 100-continue``, before it sends a multi-GB blob). A body
left unread is read away when small, or the connection is closed after the answer, lingering so
that the client reads the answer rather than a reset.
"""

from __future__ import annotations

import io
import json
import logging
import math
import socket
import ssl
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl, urlsplit

from trainguard.agent.api import routes
from trainguard.agent.api.auth import Role, bearer_token
from trainguard.agent.api.handler import ApiError, Blob
from trainguard.agent.api.identity import UNRESTRICTED, Caller, names_from_peercert

if TYPE_CHECKING:
    from trainguard.agent.api.server import _Listener

log = logging.getLogger("trainguard.api")

_CHUNK = 1 << 20


class _Reply(Exception):
    """Answer now with ``status`` and ``{"error": message}`` (used inside request handling)."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers or {}


class _DeadlineIO(io.RawIOBase):
    """The connection's reads with a whole-head deadline on top of the idle timeout: while a
    request head is being read, no read waits past ``deadline`` however the bytes trickle in."""

    def __init__(self, sock: socket.socket, idle_s: float, on_timeout: Any) -> None:
        self._sock = sock
        self._idle_s = idle_s
        self._on_timeout = on_timeout
        self.deadline: float | None = None

    def readable(self) -> bool:
        return True

    def readinto(self, buf: Any) -> int:
        deadline = self.deadline
        if deadline is None:
            self._sock.settimeout(self._idle_s)
            return self._sock.recv_into(buf)
        left = deadline - time.monotonic()
        if left <= 0:
            self._on_timeout()
            raise TimeoutError("request head not complete before the deadline")
        self._sock.settimeout(min(self._idle_s, left))
        try:
            return self._sock.recv_into(buf)
        except TimeoutError:
            if time.monotonic() >= deadline:
                self._on_timeout()
            raise


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
            got = self._size - self._remaining + len(data)
            self._remaining = 0
            raise ConnectionError(f"client sent {got} of {self._size} announced bytes")
        self._remaining -= len(data)
        return data


def _dumps(obj: Any) -> bytes:
    """Strict JSON; NaN and infinities (N/A metrics) become null, which every client can parse."""
    try:
        return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()
    except ValueError:
        return json.dumps(_finite(obj), separators=(",", ":"), allow_nan=False).encode()


def _finite(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    return obj


@dataclass(frozen=True)
class _Checked:
    """A request that passed the checks on its head (auth, route, role, size)."""

    route: routes.Route
    params: dict[str, str]
    query: dict[str, str]
    role: Role | None


def _linger_close(sock: socket.socket, max_s: float = 2.0, max_bytes: int = 64 << 20) -> None:
    """Half-close and read away what the client still sends, for a bounded time.

    Closing a TCP socket with unread input sends a reset, which can destroy the answer we just
    sent (a 413, a 401) before the client reads it.
    """
    try:
        if not isinstance(sock, ssl.SSLSocket):  # a TLS half-close would drop the TLS layer first
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


class RequestHandler(BaseHTTPRequestHandler):
    """Serves the requests of one connection (keep-alive: several, one after the other)."""

    protocol_version = "HTTP/1.1"
    server_version = "trainguard-agent"
    sys_version = ""
    server: _Listener  # type: ignore[assignment]

    # -- plumbing ------------------------------------------------------------------------------

    def setup(self) -> None:
        super().setup()
        config = self.server.api.config
        self.connection.settimeout(config.request_timeout_s)
        self._deadline_io = _DeadlineIO(self.connection, config.request_timeout_s,
                                        lambda: self.server.api.stats.incr("header_timeouts_total"))
        self.rfile = io.BufferedReader(self._deadline_io)
        # Mutual TLS is required on TCP (plain TCP only by explicit opt-in): a TLS peer is the nodes
        # its verified certificate names; the unix socket and plain TCP carry no node identity.
        self.caller: Caller = UNRESTRICTED
        if isinstance(self.connection, ssl.SSLSocket):
            self.caller = Caller(names_from_peercert(self.connection.getpeercert()))
        if not self.server.is_unix:
            # Head and body go out in two writes; with Nagle and delayed ACKs every keep-alive
            # answer would wait ~40 ms for the second one.
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def address_string(self) -> str:
        return self.server.remote_of(self.request, self.client_address)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (BaseHTTPRequestHandler's name)
        log.debug("%s %s", self.address_string(), format % args)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        # The stdlib sends an HTML page here (bad request line, header too large, unknown method).
        self.close_connection = True
        self._send_json(code, {"error": message or self.responses.get(code, ("error",))[0]})

    def _send_json(self, status: int, obj: Any, headers: dict[str, str] | None = None) -> None:
        body = _dumps(obj)
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

    def handle_one_request(self) -> None:
        # The head of each request (also the next one on a keep-alive connection) must arrive
        # within header_timeout_s; parse_request lifts the deadline once the head is in.
        self._deadline_io.deadline = time.monotonic() + self.server.api.config.header_timeout_s
        try:
            super().handle_one_request()
        finally:
            self._deadline_io.deadline = None

    def parse_request(self) -> bool:
        # One handler object serves every request of a keep-alive connection: reset per request.
        self._checked: _Checked | None = None
        self._reader: _BodyReader | None = None
        self._body_unknown = False
        self._headers_sent = False
        self._linger = False
        ok = super().parse_request()
        self._deadline_io.deadline = None
        return ok

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
            log.exception("api: %s %s failed", self.command, urlsplit(self.path).path[:200])
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
        checked = _Checked(route, params, dict(parse_qsl(split.query, keep_blank_values=True)), role)
        if route.kind != routes.Kind.JSON:
            # Blob routes name their node in the path: refused before a multi-GB body is sent.
            self._check_node(checked, {})
        return checked

    def _call(self, c: _Checked, body: dict[str, Any], reader: _BodyReader | None = None) -> routes.Call:
        return routes.Call(c.params, c.query, body, reader, role=c.role, caller=self.caller)

    def _check_node(self, c: _Checked, body: dict[str, Any]) -> None:
        """A node-scoped request from a verified node must name that node (403 otherwise, counted)."""
        if c.route.node_of is None or not self.caller.restricted:
            return
        try:
            node = c.route.node_of(self._call(c, body))
        except ApiError as e:
            raise _Reply(e.status, e.message) from None
        if node is None or self.caller.may_act_as(node):
            return
        self.server.api.node_refused(self.address_string(), self.caller.describe(), node, urlsplit(self.path).path)
        raise _Reply(403, f"this client's certificate names {self.caller.describe()}, not node {node[:80]!r}: "
                          "a node may write only its own copies and telemetry")

    def _serve(self, c: _Checked) -> None:
        api = self.server.api
        route = c.route
        try:
            if route.kind == routes.Kind.BLOB_IN:
                assert self._reader is not None
                result = route.call(api.handler, self._call(c, {}, self._reader))
                self._drain_or_close()  # the handler may stop reading early
                self._send_json(200, self._jsonable(result))
            elif route.kind == routes.Kind.BLOB_OUT:
                self._read_json_body()
                blob = route.call(api.handler, self._call(c, {}))
                self._send_blob(blob)
            else:
                body = self._read_json_body()
                self._check_node(c, body)
                result = route.call(api.handler, self._call(c, body))
                if c.role is not None and c.role < Role.ADMIN:
                    result = routes.redact_env(result)
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
