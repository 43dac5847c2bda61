"""Client of the control API, for the CLI, the TUI and peer agents.

::

    client = ApiClient.local(Path("/run/trainguard/agent.sock"))          # local CLI/TUI
    client = ApiClient.remote("node2", 9479, token_file=Path("token"))   # peer agent, remote TUI
    client.status()["jobs"]

Every failure is an ``ApiClientError(status, message)``: ``status`` is the HTTP status, or 0 when
no answer came (no agent, refused, timed out); ``message`` is one line fit to show a user.
A new connection per call keeps the client free of stale keep-alive state; on a unix socket
that costs tens of microseconds.
"""

from __future__ import annotations

import http.client
import json
import os
import select
import socket
import ssl
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO, Protocol, overload
from urllib.parse import quote, urlencode

from trainguard.agent.api.auth import TokenFileError, read_client_token

DEFAULT_TIMEOUT_S = 10.0
_CHUNK = 1 << 20
_CONTINUE_WAIT_S = 5.0  # how long to wait for "100 Continue" before sending the body anyway (RFC 9110)



class BlobSink(Protocol):
    """Where a downloaded blob goes, chunk by chunk (a file, or a checksumming wrapper)."""

    def write(self, data: bytes, /) -> int: ...

class ApiClientError(Exception):
    """A call that failed; ``status`` 0 means the agent could not be reached or did not answer."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message

    def __str__(self) -> str:
        return self.message if self.status == 0 else f"{self.message} (HTTP {self.status})"


class UnixHTTPConnection(http.client.HTTPConnection):
    """``HTTPConnection`` over a unix stream socket (the Host header says "localhost")."""

    def __init__(self, path: str, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        super().__init__("localhost", timeout=timeout)
        self.unix_path = path

    def connect(self) -> None:
        deadline = time.monotonic() + (self.timeout if isinstance(self.timeout, int | float) else 10.0)
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self.timeout)
            try:
                sock.connect(self.unix_path)
            except BlockingIOError:
                # A full listen backlog on a unix socket fails at once (EAGAIN) instead of
                # waiting like TCP does: wait here, within the timeout.
                sock.close()
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"agent socket {self.unix_path} stayed busy") from None
                time.sleep(0.005)
                continue
            except BaseException:
                sock.close()
                raise
            self.sock = sock
            return


class ApiClient:
    """One method per route; results are the decoded JSON the agent sent."""

    def __init__(self, connect: Callable[[], http.client.HTTPConnection], where: str,
                 token: str | None, *, unix: bool) -> None:
        self._connect = connect
        self.where = where
        self._token = token
        self._unix = unix

    @classmethod
    def local(cls, socket_path: Path | str, token: str | None = None,
              timeout: float = DEFAULT_TIMEOUT_S) -> ApiClient:
        path = os.fspath(socket_path)
        return cls(lambda: UnixHTTPConnection(path, timeout=timeout), path, token, unix=True)

    @classmethod
    def remote(cls, host: str, port: int, token_file: Path | str | None = None, *,
               token: str | None = None, timeout: float = DEFAULT_TIMEOUT_S,
               tls: ssl.SSLContext | None = None) -> ApiClient:
        """A TCP client; ``tls``: talk HTTPS with this context (``agent.api.tls.client_context``)."""
        if token is None and token_file is not None:
            try:
                token = read_client_token(Path(token_file))
            except TokenFileError as e:
                raise ApiClientError(0, str(e)) from None
        if tls is not None:
            return cls(lambda: http.client.HTTPSConnection(host, port, timeout=timeout, context=tls),
                       f"https://{host}:{port}", token, unix=False)
        return cls(lambda: http.client.HTTPConnection(host, port, timeout=timeout),
                   f"{host}:{port}", token, unix=False)

    # -- routes ----------------------------------------------------------------------------------

    def health(self) -> dict[str, Any]:
        return self._json("GET", "/v1/health")

    def status(self) -> dict[str, Any]:
        return self._json("GET", "/v1/status")

    def events(self, since: int = 0, limit: int = 100, kind: str | None = None) -> dict[str, Any]:
        query: dict[str, Any] = {"since": since, "limit": limit}
        if kind:
            query["kind"] = kind
        return self._json("GET", "/v1/events?" + urlencode(query))

    def jobs(self) -> Any:
        return self._json("GET", "/v1/jobs")

    def job(self, job: str) -> dict[str, Any]:
        return self._json("GET", f"/v1/jobs/{_seg(job)}")

    def submit_job(self, spec: dict[str, Any]) -> str:
        """Start a job; returns its id."""
        return str(self._json("POST", "/v1/jobs", spec)["job"])

    def stop_job(self, job: str, **options: Any) -> dict[str, Any]:
        return self._json("POST", f"/v1/jobs/{_seg(job)}/stop", options)

    def signal_job(self, job: str, name: str, sender: str = "trainguard run") -> dict[str, Any]:
        """Forward signal ``name`` (SIGUSR1 or SIGUSR2) to the job's running ranks on this node."""
        return self._json("POST", f"/v1/jobs/{_seg(job)}/signal", {"signal": name, "sender": sender})

    def job_attempt(self, job: str, body: dict[str, Any]) -> dict[str, Any]:
        """One round of ``trainguard run --nnodes`` on this node (``agent.lifecycle.rdzvjobs``)."""
        result: dict[str, Any] = self._json("POST", f"/v1/jobs/{_seg(job)}/attempt", body)
        return result

    def job_output(self, job: str, rank: int, offset: int = 0, limit: int = 64 << 10) -> dict[str, Any]:
        result: dict[str, Any] = self._json("GET", f"/v1/jobs/{_seg(job)}/output?rank={rank}&offset={offset}&limit={limit}")
        return result

    def follow_job(self, job: str, since: int, offsets: dict[int, int], limit: int = 64 << 10) -> dict[str, Any]:
        """One poll of a job's progress: ``{"job", "output": [per rank], "events", "next"}``."""
        pairs = ",".join(f"{rank}:{offset}" for rank, offset in sorted(offsets.items()))
        result: dict[str, Any] = self._json(
            "GET", f"/v1/jobs/{_seg(job)}/follow?" + urlencode({"since": since, "offsets": pairs, "limit": limit}))
        return result

    def get_plan(self, job: str) -> dict[str, Any]:
        return self._json("GET", f"/v1/jobs/{_seg(job)}/plan")

    def put_plan(self, job: str, fields: dict[str, Any]) -> dict[str, Any]:
        return self._json("PUT", f"/v1/jobs/{_seg(job)}/plan", fields)

    def checkpoints(self, job: str | None = None) -> Any:
        return self._json("GET", "/v1/checkpoints" + (f"?{urlencode({'job': job})}" if job else ""))

    def checkpoint_now(self, job: str, **options: Any) -> dict[str, Any]:
        return self._json("POST", f"/v1/jobs/{_seg(job)}/checkpoint", options)

    def drain(self, job: str, *, rank: int | None = None, node: str | None = None) -> dict[str, Any]:
        if (rank is None) == (node is None):
            raise ValueError("drain: give exactly one of rank= or node=")
        return self._json("POST", f"/v1/jobs/{_seg(job)}/drain",
                          {"rank": rank} if rank is not None else {"node": node})

    def forward_telemetry(self, job: str, node: str, messages: list[str],
                          evidence: dict[str, Any] | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"node": node, "messages": messages}
        if evidence:
            body["evidence"] = evidence
        return self._json("POST", f"/v1/jobs/{_seg(job)}/telemetry", body)

    def detection_config(self) -> dict[str, Any]:
        return self._json("GET", "/v1/config/detection")

    def put_detection_config(self, fields: dict[str, Any]) -> dict[str, Any]:
        return self._json("PUT", "/v1/config/detection", fields)

    def put_blob(self, namespace: str, path: str, data: bytes | BinaryIO,
                 size: int | None = None) -> dict[str, Any]:
        """Upload ``data`` (bytes, or a binary file read in chunks; ``size`` defaults to what is
        left in the file)."""
        if isinstance(data, bytes | bytearray | memoryview):
            size = len(data)
        elif size is None:
            size = os.fstat(data.fileno()).st_size - data.tell()
        return self._request("PUT", _blob_url(namespace, path), raw=data, raw_size=size)

    @overload
    def get_blob(self, namespace: str, path: str) -> bytes: ...

    @overload
    def get_blob(self, namespace: str, path: str, dst: BlobSink) -> int: ...

    def get_blob(self, namespace: str, path: str, dst: BlobSink | None = None) -> bytes | int:
        """Download a blob: into ``dst`` in chunks (returns the byte count), or as bytes."""
        result: bytes | int = self._request("GET", _blob_url(namespace, path), sink=dst, want_bytes=dst is None)
        return result

    def delete_blob(self, namespace: str, path: str) -> dict[str, Any]:
        return self._json("DELETE", _blob_url(namespace, path))

    # -- transport -------------------------------------------------------------------------------

    def _json(self, method: str, url: str, body: dict[str, Any] | None = None) -> Any:
        return self._request(method, url, body=body)

    def _headers(self) -> dict[str, str]:
        headers = {"Accept": "application/json"}
        if self._token:
            headers["Authorization"] = f"Bearer {self._token}"
        return headers

    def _upload(self, conn: http.client.HTTPConnection, method: str, url: str, headers: dict[str, str],
                raw: bytes | BinaryIO, size: int) -> None:
        headers["Content-Type"] = "application/octet-stream"
        headers["Content-Length"] = str(size)
        # Ask first: a refusal (401, 403, 413) then costs one round trip, not a multi-GB send. Not
        # over TLS: the answer cannot be peeked at under the TLS layer, so the body goes at once.
        tls = isinstance(conn, http.client.HTTPSConnection)
        if not tls:
            headers["Expect"] = "100-continue"
        conn.putrequest(method, url, skip_accept_encoding=True)
        for k, v in headers.items():
            conn.putheader(k, v)
        conn.endheaders()
        if not tls and not _continue_or_final(conn, timeout=_CONTINUE_WAIT_S):
            return  # a final answer came instead of 100 Continue: getresponse() reads it
        try:
            _send_body(conn, raw, size)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the agent stopped reading; its answer (why) is usually still there to read

    def _request(self, method: str, url: str, *, body: dict[str, Any] | None = None,
                 raw: bytes | BinaryIO | None = None, raw_size: int = 0,
                 sink: BlobSink | None = None, want_bytes: bool = False) -> Any:
        headers = self._headers()
        conn = self._connect()
        try:
            try:
                if raw is not None:
                    self._upload(conn, method, url, headers, raw, raw_size)
                else:
                    payload = None if body is None else json.dumps(body).encode()
                    if payload is not None:
                        headers["Content-Type"] = "application/json"
                    conn.request(method, url, body=payload, headers=headers)
                resp = conn.getresponse()
                if resp.status != 200:
                    raise ApiClientError(resp.status, _error_message(resp, method, url))
                if sink is not None or want_bytes:
                    return _receive_blob(resp, sink)
                data = resp.read()
            except ApiClientError:
                raise
            except (FileNotFoundError, ConnectionRefusedError):
                raise ApiClientError(0, f"no agent at {self.where}: is `trainguard agent` running?") from None
            except PermissionError:
                raise ApiClientError(0, f"permission denied on {self.where}: run as root or as a member "
                                        "of the socket's group") from None
            except TimeoutError:
                raise ApiClientError(0, f"agent at {self.where} did not answer in time") from None
            except ssl.SSLCertVerificationError as e:
                raise ApiClientError(0, f"agent at {self.where} is not trusted: {e.verify_message} "
                                        "(check the CA file and the name or IP in its certificate)") from None
            except ssl.SSLError as e:
                raise ApiClientError(0, f"TLS with the agent at {self.where} failed: {e.reason or e}") from None
            except (OSError, http.client.HTTPException) as e:
                raise ApiClientError(0, f"lost the connection to the agent at {self.where}: "
                                        f"{type(e).__name__}: {e}") from None
        finally:
            conn.close()
        try:
            return json.loads(data)
        except ValueError:
            raise ApiClientError(200, f"agent at {self.where} sent a reply that is not JSON") from None


def _seg(value: str) -> str:
    return quote(value, safe="")


def _blob_url(namespace: str, path: str) -> str:
    return f"/v1/blobs/{_seg(namespace)}/" + "/".join(_seg(s) for s in path.split("/"))


def _continue_or_final(conn: http.client.HTTPConnection, timeout: float) -> bool:
    """After an ``Expect: 100-continue`` head: True when the body should be sent (a 100 came, or
    nothing within ``timeout``), False when a final response is waiting. Only peeks, so
    ``getresponse()`` later parses (and skips past) whatever came."""
    sock = conn.sock
    if sock is None:
        return True
    deadline = time.monotonic() + timeout
    head = b""
    while len(head) < 12:  # "HTTP/1.1 100"
        left = deadline - time.monotonic()
        if left <= 0:
            return True
        ready, _, _ = select.select([sock], [], [], left)
        if not ready:
            return True
        head = sock.recv(64, socket.MSG_PEEK)
        if len(head) < 12:
            if not head or b"\n" in head:
                return False  # closed, or a malformed head: let getresponse() report it
            time.sleep(0.001)
    return head[9:12] == b"100"


def _send_body(conn: http.client.HTTPConnection, raw: bytes | BinaryIO, size: int) -> None:
    if isinstance(raw, bytes | bytearray | memoryview):
        view = memoryview(raw)
        for off in range(0, len(view), _CHUNK):
            conn.send(view[off:off + _CHUNK])
        return
    left = size
    while left > 0:
        chunk = raw.read(min(_CHUNK, left))
        if not chunk:
            raise ApiClientError(0, f"blob source ended {left} bytes short of the {size} announced")
        conn.send(chunk)
        left -= len(chunk)


def _receive_blob(resp: http.client.HTTPResponse, sink: BlobSink | None) -> bytes | int:
    parts: list[bytes] = []
    total = 0
    while True:
        chunk = resp.read(_CHUNK)
        if not chunk:
            break
        total += len(chunk)
        if sink is not None:
            sink.write(chunk)
        else:
            parts.append(chunk)
    if resp.length not in (None, 0):  # http.client counts down what is left of Content-Length
        raise ApiClientError(0, "the agent closed the connection in the middle of the blob")
    return total if sink is not None else b"".join(parts)


def _error_message(resp: http.client.HTTPResponse, method: str, url: str) -> str:
    raw = resp.read(64 * 1024)
    try:
        message = json.loads(raw)["error"]
    except (ValueError, KeyError, TypeError):
        message = resp.reason or "error"
    return f"{method} {url.split('?', 1)[0]}: {message}"
