"""The route table: which method and path call which ``ApiHandler`` method, with which role.

Kept apart from the HTTP plumbing so the table reads as the API's reference:

=======  ===============================  ======  =============================
method   path                             role    handler call
=======  ===============================  ======  =============================
GET      /v1/health                       none    health()
GET      /v1/status                       read    status()
GET      /v1/events?since&limit&kind      read    events(since, limit, kind)
GET      /v1/jobs                         read    list_jobs()
POST     /v1/jobs                         admin   submit_job(spec)
GET      /v1/jobs/<id>                    read    get_job(id)
DELETE   /v1/jobs/<id>                    admin   stop_job(id, {})
POST     /v1/jobs/<id>/stop               admin   stop_job(id, body)
GET      /v1/jobs/<id>/output?rank&offset read    job_output(id, rank, offset, limit)
GET      /v1/jobs/<id>/follow?since&offsets read  get_job, job_output of each rank, events
GET      /v1/jobs/<id>/plan               read    get_plan(id)
PUT      /v1/jobs/<id>/plan               admin   update_plan(id, body)
POST     /v1/jobs/<id>/checkpoint         admin   checkpoint_now(id, body)
POST     /v1/jobs/<id>/attempt            admin   job_attempt(id, body)  (trainguard run --nnodes)
POST     /v1/jobs/<id>/drain              admin   drain(id, body)
POST     /v1/jobs/<id>/telemetry          admin*  ingest_telemetry(id, body)  (other nodes' ranks)
GET      /v1/checkpoints?job=             read    list_checkpoints(job)
GET      /v1/config/detection             read    get_detection_config()
PUT      /v1/config/detection             admin   update_detection_config(body)
PUT      /v1/blobs/<ns>/<path...>         admin*  put_blob(ns, path, reader)
GET      /v1/blobs/<ns>/<path...>         admin   get_blob(ns, path)
DELETE   /v1/blobs/<ns>/<path...>         admin*  delete_blob(ns, path)
=======  ===============================  ======  =============================

``*``: node-scoped. Over mutual TLS the caller is the node its certificate names, and it may only
act for itself: the first path segment (a peer copy's origin node) or the body's ``node`` (the
sender of forwarded telemetry) must be that node; otherwise 403, whatever the token.

A read token never sees a job's ``env`` values: they are answered as ``"***"`` (``redact_env``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

from trainguard.agent.api.auth import Role
from trainguard.agent.api.handler import ApiError, ApiHandler, BlobReader
from trainguard.agent.api.identity import UNRESTRICTED, Caller

MAX_EVENTS_LIMIT = 10_000
DEFAULT_EVENTS_LIMIT = 100

# Job ids and blob namespaces: one path segment of safe characters.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


@dataclass(frozen=True)
class Call:
    """What a route needs at call time, besides the handler."""

    params: Mapping[str, str]  # decoded path parameters
    query: Mapping[str, str]  # last value of each query parameter
    body: dict[str, Any]  # parsed JSON body ({} when none); unused by blob routes
    reader: BlobReader | None = None  # the raw body, for blob uploads
    role: Role | None = None  # the token's role (None: a public route)
    caller: Caller = UNRESTRICTED  # the calling node, from its verified certificate


class Kind:
    JSON = "json"  # JSON (or no) body in, JSON out
    BLOB_IN = "blob_in"  # raw streamed body in, JSON out
    BLOB_OUT = "blob_out"  # no body in, streamed bytes out


@dataclass(frozen=True)
class Route:
    method: str
    pattern: re.Pattern[str]
    role: Role | None  # None: public (health only)
    kind: str
    call: Callable[[ApiHandler, Call], Any]
    node_of: Callable[[Call], str | None] | None = None
    """Node-scoped routes: the node the request acts for (it must be the caller's own)."""


def _name(value: str, what: str) -> str:
    decoded = unquote(value)
    if not _NAME.fullmatch(decoded):
        raise ApiError(400, f"bad {what} {decoded[:80]!r}: use letters, digits, '.', '_', '-'")
    return decoded


def blob_path(raw: str) -> str:
    """Decode and check a blob path: relative, no empty, '.' or '..' segments, no NUL."""
    segments = [unquote(s) for s in raw.split("/")]
    for s in segments:
        if s in ("", ".", "..") or "/" in s or "\x00" in s or len(s) > 255:
            raise ApiError(400, "bad blob path: segments must be non-empty names, not '.' or '..'")
    return "/".join(segments)


def _int(query: Mapping[str, str], key: str, default: int, lo: int, hi: int) -> int:
    raw = query.get(key)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ApiError(400, f"query parameter {key!r} must be an integer, got {raw[:40]!r}") from None
    if not lo <= value <= hi:
        raise ApiError(400, f"query parameter {key!r} must be in [{lo}, {hi}], got {value}")
    return value


def _job(c: Call) -> str:
    return _name(c.params["job"], "job id")


def _events(h: ApiHandler, c: Call) -> Any:
    since = _int(c.query, "since", 0, 0, 1 << 62)
    limit = _int(c.query, "limit", DEFAULT_EVENTS_LIMIT, 1, MAX_EVENTS_LIMIT)
    kind = c.query.get("kind") or None
    return h.events(since, limit, kind)


MAX_OUTPUT_BYTES = 1 << 20


def _output(h: ApiHandler, c: Call) -> Any:
    rank = _int(c.query, "rank", 0, 0, 1 << 20)
    offset = _int(c.query, "offset", 0, 0, 1 << 50)
    limit = _int(c.query, "limit", 64 << 10, 1, MAX_OUTPUT_BYTES)
    return h.job_output(_job(c), rank, offset, limit)


MAX_FOLLOW_EVENTS = 500


def _offsets(raw: str) -> dict[int, int]:
    """``rank:offset,...`` (the output each rank's follower has already shown)."""
    out: dict[int, int] = {}
    for item in filter(None, raw.split(",")):
        rank, sep, offset = item.partition(":")
        if not (sep and rank.isdigit() and offset.isdigit()) or len(rank) > 7 or len(offset) > 16:
            raise ApiError(400, f"query parameter 'offsets' must be rank:offset pairs, got {item[:40]!r}")
        out[int(rank)] = int(offset)
    return out


def _follow(h: ApiHandler, c: Call) -> Any:
    """One poll of ``trainguard run``: the job, each rank's output from its offset, and the events
    after ``since`` that name the job. One request (and one server thread) where a poll was one
    for the job, one or more per rank and one for the events."""
    job = _job(c)
    since = _int(c.query, "since", 0, 0, 1 << 62)
    limit = _int(c.query, "limit", 64 << 10, 1, MAX_OUTPUT_BYTES)
    offsets = _offsets(c.query.get("offsets", ""))
    info = h.get_job(job)  # before the output: a job seen finished has all its output written
    ranks = sorted({int(r["rank"]) for r in info.get("ranks", [])}) or list(range(int(info.get("nproc", 1))))
    output = [h.job_output(job, rank, offsets.get(rank, 0), limit) for rank in ranks]
    batch = h.events(since, MAX_FOLLOW_EVENTS, None)
    return {"job": info, "output": output, "events": [e for e in batch["events"] if e.get("job") == job],
            "next": batch["next"]}


def _health(h: ApiHandler, c: Call) -> Any:
    result = dict(h.health())
    result.setdefault("ok", True)
    return result


def _checkpoints(h: ApiHandler, c: Call) -> Any:
    job = c.query.get("job")
    return h.list_checkpoints(_name(job, "job id") if job else None)


def _put_blob(h: ApiHandler, c: Call) -> Any:
    assert c.reader is not None
    return h.put_blob(_name(c.params["ns"], "blob namespace"), blob_path(c.params["path"]), c.reader)


def _blob_args(c: Call) -> tuple[str, str]:
    return _name(c.params["ns"], "blob namespace"), blob_path(c.params["path"])


def _blob_owner(c: Call) -> str | None:
    """The node a blob write acts for: the first path segment (a peer copy's origin)."""
    return blob_path(c.params["path"]).split("/", 1)[0]


def _telemetry_sender(c: Call) -> str | None:
    node = c.body.get("node")
    return node if isinstance(node, str) else None


REDACTED = "***"
_REDACT_DEPTH = 8


def redact_env(result: Any, depth: int = 0) -> Any:
    """``result`` with the values of every ``env`` mapping replaced by ``"***"`` (the keys stay, so
    a reader still sees which variables a job sets): what a read-only token is shown."""
    if depth > _REDACT_DEPTH:
        return result
    if isinstance(result, dict):
        out: dict[str, Any] = {}
        for key, value in result.items():
            if key == "env" and isinstance(value, dict):
                out[key] = {str(k): REDACTED for k in value}
            else:
                out[key] = redact_env(value, depth + 1)
        return out
    if isinstance(result, list):
        return [redact_env(v, depth + 1) for v in result]
    return result


_JOB = r"/v1/jobs/(?P<job>[^/]+)"
_BLOB = r"/v1/blobs/(?P<ns>[^/]+)/(?P<path>.+)"


def _r(method: str, path: str, role: Role | None, call: Callable[[ApiHandler, Call], Any],
       kind: str = Kind.JSON, node_of: Callable[[Call], str | None] | None = None) -> Route:
    return Route(method, re.compile(path), role, kind, call, node_of)


READ, ADMIN = Role.READ, Role.ADMIN

ROUTES: tuple[Route, ...] = (
    _r("GET", r"/v1/health", None, _health),
    _r("GET", r"/v1/status", READ, lambda h, c: h.status()),
    _r("GET", r"/v1/events", READ, _events),
    _r("GET", r"/v1/jobs", READ, lambda h, c: h.list_jobs()),
    _r("POST", r"/v1/jobs", ADMIN, lambda h, c: h.submit_job(c.body)),
    _r("GET", _JOB, READ, lambda h, c: h.get_job(_job(c))),
    _r("DELETE", _JOB, ADMIN, lambda h, c: h.stop_job(_job(c), c.body)),
    _r("POST", _JOB + r"/stop", ADMIN, lambda h, c: h.stop_job(_job(c), c.body)),
    _r("GET", _JOB + r"/output", READ, _output),
    _r("GET", _JOB + r"/follow", READ, _follow),
    _r("GET", _JOB + r"/plan", READ, lambda h, c: h.get_plan(_job(c))),
    _r("PUT", _JOB + r"/plan", ADMIN, lambda h, c: h.update_plan(_job(c), c.body)),
    _r("POST", _JOB + r"/checkpoint", ADMIN, lambda h, c: h.checkpoint_now(_job(c), c.body)),
    _r("POST", _JOB + r"/signal", ADMIN, lambda h, c: h.signal_job(_job(c), c.body)),
    _r("POST", _JOB + r"/attempt", ADMIN, lambda h, c: h.job_attempt(_job(c), c.body)),
    _r("POST", _JOB + r"/drain", ADMIN, lambda h, c: h.drain(_job(c), c.body)),
    _r("POST", _JOB + r"/telemetry", ADMIN, lambda h, c: h.ingest_telemetry(_job(c), c.body),
       node_of=_telemetry_sender),
    _r("GET", r"/v1/checkpoints", READ, _checkpoints),
    _r("GET", r"/v1/config/detection", READ, lambda h, c: h.get_detection_config()),
    _r("PUT", r"/v1/config/detection", ADMIN, lambda h, c: h.update_detection_config(c.body)),
    _r("PUT", _BLOB, ADMIN, _put_blob, Kind.BLOB_IN, node_of=_blob_owner),
    _r("GET", _BLOB, ADMIN, lambda h, c: h.get_blob(*_blob_args(c)), Kind.BLOB_OUT),
    _r("DELETE", _BLOB, ADMIN, lambda h, c: h.delete_blob(*_blob_args(c)), node_of=_blob_owner),
)


def match(method: str, path: str) -> tuple[Route | None, dict[str, str], list[str]]:
    """(route, path params, allowed methods for this path). Route None + methods: 405; none: 404."""
    allowed: list[str] = []
    for route in ROUTES:
        m = route.pattern.fullmatch(path)
        if m is None:
            continue
        if route.method == method:
            return route, m.groupdict(), []
        allowed.append(route.method)
    return None, {}, allowed


def is_public(path: str) -> bool:
    """Whether ``path`` is served without a token (checked before the token, so no 401 there)."""
    return any(r.role is None and r.pattern.fullmatch(path) for r in ROUTES)
