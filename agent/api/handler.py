"""What the control API asks of the daemon.

The server (``agent.api.server``) owns HTTP, sockets, authentication, JSON framing and limits; the
daemon owns meaning. It implements ``ApiHandler``: every method gets plain Python values (path
parameters already decoded, bodies already parsed into dicts) and returns something JSON-able.
To refuse a request with a particular status, a method raises ``ApiError(status, message)``; any
other exception becomes a 500 with a short message, is logged with its traceback, and is counted.

Methods may be called from several server threads at once: the daemon guards its own state.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

# What a JSON route may return: a dict or list of JSON-able values.
Json = dict[str, Any] | list[Any]


class ApiError(Exception):
    """A request the handler refuses on purpose: ``status`` goes to the client with ``message``."""

    def __init__(self, status: int, message: str) -> None:
        if not 400 <= status <= 599:
            raise ValueError(f"ApiError status must be 4xx or 5xx, got {status}")
        super().__init__(message)
        self.status = status
        self.message = message


class BlobReader(Protocol):
    """A request body of known size, read in chunks (never all at once: blobs can be GBs)."""

    @property
    def size(self) -> int:
        """Total bytes the client announced (Content-Length)."""

    @property
    def remaining(self) -> int:
        """Bytes not read yet."""

    def read(self, n: int = -1) -> bytes:
        """Up to ``n`` bytes (all remaining when ``n < 0``); ``b""`` at the end.

        Raises ``ConnectionError`` when the client goes away before sending everything, so a
        handler never commits a truncated blob.
        """


@dataclass
class Blob:
    """A blob the handler serves: exactly ``size`` bytes produced by ``chunks``.

    ``chunks`` is iterated lazily while the response is written; if it has a ``close()`` (a
    generator, a file wrapper) the server calls it when done, also on error, so files get closed.
    """

    size: int
    chunks: Iterable[bytes]
    content_type: str = "application/octet-stream"


class ApiHandler(Protocol):
    """The daemon side of the control API. One method per route (see ``agent.api.routes``)."""

    def health(self) -> dict[str, Any]:
        """GET /v1/health (no token needed): ``{"node": ..., "version": ...}``; ``ok`` is added."""

    def status(self) -> dict[str, Any]:
        """GET /v1/status: node, collectors (name -> up, reason), jobs (state, ranks), leader."""

    def events(self, since: int, limit: int, kind: str | None) -> dict[str, Any]:
        """GET /v1/events: events with seq > ``since``, at most ``limit``: ``{"events": [...], "next": seq}``."""

    def list_jobs(self) -> Json:
        """GET /v1/jobs."""

    def submit_job(self, spec: dict[str, Any]) -> dict[str, Any]:
        """POST /v1/jobs: validate ``spec`` (raise ApiError(400, ...)), start it: ``{"job": id}``."""

    def get_job(self, job: str) -> dict[str, Any]:
        """GET /v1/jobs/<job>; unknown job -> ApiError(404, ...)."""

    def stop_job(self, job: str, options: dict[str, Any]) -> dict[str, Any]:
        """POST /v1/jobs/<job>/stop or DELETE /v1/jobs/<job>; ``options`` is the body or ``{}``."""

    def job_output(self, job: str, rank: int, offset: int, limit: int) -> dict[str, Any]:
        """GET /v1/jobs/<job>/output: what rank ``rank`` printed (stdout and stderr), from byte
        ``offset``, at most ``limit`` bytes ending on a line (once the job is over, its last line
        comes without a newline if it was written so): ``{"text", "offset", "next", "size"}``."""

    def get_plan(self, job: str) -> dict[str, Any]:
        """GET /v1/jobs/<job>/plan."""

    def update_plan(self, job: str, fields: dict[str, Any]) -> dict[str, Any]:
        """PUT /v1/jobs/<job>/plan: merge ``fields``, bump the version, return the new plan."""

    def list_checkpoints(self, job: str | None) -> Json:
        """GET /v1/checkpoints[?job=...]."""

    def checkpoint_now(self, job: str, options: dict[str, Any]) -> dict[str, Any]:
        """POST /v1/jobs/<job>/checkpoint."""

    def signal_job(self, job: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST /v1/jobs/<job>/signal with ``{"signal": "SIGUSR1" | "SIGUSR2"}``: forwarded to the
        job's running ranks (``trainguard run`` passes on what a batch system sends it)."""

    def job_attempt(self, job: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST /v1/jobs/<job>/attempt: a round of ``trainguard run --nnodes`` (``agent.lifecycle.rdzvjobs``)."""

    def drain(self, job: str, target: dict[str, Any]) -> dict[str, Any]:
        """POST /v1/jobs/<job>/drain with ``{"rank": r}`` or ``{"node": n}``."""

    def ingest_telemetry(self, job: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST /v1/jobs/<job>/telemetry: ``{"node": n, "messages": [datagram text, ...]}`` of the
        ranks another node runs for this job (a job spanning nodes: the node that holds rank 0
        judges every rank)."""

    def get_detection_config(self) -> dict[str, Any]:
        """GET /v1/config/detection."""

    def update_detection_config(self, fields: dict[str, Any]) -> dict[str, Any]:
        """PUT /v1/config/detection: apply the runtime-changeable thresholds, return the result."""

    def put_blob(self, namespace: str, path: str, body: BlobReader) -> dict[str, Any]:
        """PUT /v1/blobs/<ns>/<path...>: store ``body`` (read it in chunks), e.g. ``{"size": n}``.

        ``path`` is relative, '/'-separated, without empty, '.' or '..' segments (checked already).
        """

    def get_blob(self, namespace: str, path: str) -> Blob:
        """GET /v1/blobs/<ns>/<path...>; missing -> ApiError(404, ...)."""

    def delete_blob(self, namespace: str, path: str) -> dict[str, Any]:
        """DELETE /v1/blobs/<ns>/<path...> (peer-tier pruning)."""
