"""A small etcd v3 client for the cluster layer: leases, keys, prefixes, create-if-absent.

Transport is ``etcd3gw`` (etcd's gRPC gateway over HTTP/JSON, no grpc wheel needed). We use its
session and error mapping but build the JSON ourselves, because we need fields it does not expose
(revisions, per-key leases, a compare-and-delete).

Liveness rules, because a node must never be declared lost while it is alive:

* Every call has a short timeout and tries the next endpoint on a connection failure, so a dead
  member of a three-member cluster costs one timeout, not the lease.
* ``LeaseKeeper`` refreshes the lease every ``ttl / REFRESHES_PER_TTL`` and, when a refresh fails, retries every
  ``retry_s`` until the server answers. Only the *server* saying the lease is gone (keepalive
  TTL -1, or a put naming a missing lease) counts as expiry; "cannot reach etcd" never does.
  That is what makes a short etcd stall harmless: the lease outlives it on the server, and the
  first refresh after the stall extends it.
"""

from __future__ import annotations

import base64
import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import requests
from etcd3gw import exceptions as etcd_exc
from etcd3gw.client import Etcd3Client

log = logging.getLogger("trainguard.cluster.etcd")

DEFAULT_TIMEOUT_S = 1.0
REFRESHES_PER_TTL = 4
"""Lease refreshes per TTL: a healthy agent's newest refresh is at most TTL/4 old, which leaves the
fence (``cluster.fence_margin_s``) room for an etcd stall of about half the TTL."""


class EtcdUnavailable(ConnectionError):
    """No endpoint answered (every one refused, timed out or failed)."""


class LeaseExpired(RuntimeError):
    """The server no longer knows the lease: its keys are gone."""


def _b64(data: str | bytes) -> str:
    raw = data.encode() if isinstance(data, str) else data
    return base64.b64encode(raw).decode("ascii")


def _unb64(data: str | None) -> bytes:
    return base64.b64decode(data) if data else b""


def _text(exc: BaseException) -> str:
    """etcd3gw keeps the server's error body in ``detail_text`` and only the reason in str()."""
    detail = getattr(exc, "detail_text", None)
    return f"{exc} {detail}" if detail else str(exc)


def prefix_end(prefix: str) -> str:
    """The ``range_end`` that selects every key starting with ``prefix`` (etcd's convention)."""
    raw = bytearray(prefix.encode())
    for i in range(len(raw) - 1, -1, -1):
        if raw[i] < 0xFF:
            raw[i] += 1
            return _b64(bytes(raw[: i + 1]))
    return _b64(b"\0")


@dataclass(frozen=True)
class KeyValue:
    key: str
    value: bytes
    lease: int
    create_revision: int
    mod_revision: int


def parse_endpoint(value: str) -> tuple[str, int]:
    """``host:port`` or ``http://host:port`` -> (host, port); ValueError naming the value."""
    text = value.removeprefix("http://")
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected HOST:PORT, got {value!r}")
    return host.strip("[]"), int(port)


def _session(ca: str, cert: str, key: str) -> requests.Session | None:
    """The HTTPS session for etcd: its CA and client certificate, and no environment. requests lets
    ``REQUESTS_CA_BUNDLE`` (set on many hosts to the system bundle) override a session's own CA,
    which then fails to verify etcd's private CA."""
    if not (ca or cert):
        return None
    session = requests.Session()
    session.trust_env = False
    if ca:
        session.verify = ca
    if cert:
        session.cert = (cert, key) if key else cert
    return session


class EtcdClient:
    """Thread-safe; each call goes to the endpoint that answered last, then fails over in order."""

    def __init__(self, endpoints: Sequence[str], *, timeout_s: float = DEFAULT_TIMEOUT_S,
                 ca: str = "", cert: str = "", key: str = "", plaintext: bool = False) -> None:
        """``ca``: speak HTTPS, verifying etcd against this bundle; ``cert``/``key``: a client certificate.
        Plain HTTP (no ``ca``, no ``cert``) only with ``plaintext``: whoever reaches etcd then
        reaches every job record, so it is an explicit choice (``cluster.etcd_plaintext``)."""
        if not endpoints:
            raise ValueError("at least one etcd endpoint is needed")
        if not (ca or cert) and not plaintext:
            raise ValueError("cluster.etcd_ca: etcd is spoken to over TLS with a client certificate; "
                             "plain HTTP needs cluster.etcd_plaintext = true")
        self._tls = (ca, cert, key)
        self.plaintext = plaintext
        self._clients = [Etcd3Client(h, p, protocol="https" if ca or cert else "http", api_path="/v3/",
                                     timeout=timeout_s, session=_session(ca, cert, key))
                         for h, p in (parse_endpoint(e) for e in endpoints)]
        self.endpoints = list(endpoints)
        self.timeout_s = timeout_s
        self._current = 0
        self._lock = threading.Lock()
        # requests.Session is not safe for concurrent use: one call at a time per client.
        self._call_lock = threading.Lock()

    @property
    def scheme(self) -> str:
        return "https" if self._tls[0] or self._tls[1] else "http"

    def new_session(self) -> requests.Session:
        """A session of its own (a watch stream) with this client's TLS settings."""
        return _session(*self._tls) or requests.Session()

    def clone(self) -> EtcdClient:
        """A client with its own HTTP session: lease refreshes use one, so they never queue behind
        a slow read or write of another thread (calls on one client are serialised)."""
        ca, cert, key = self._tls
        return EtcdClient(self.endpoints, timeout_s=self.timeout_s, ca=ca, cert=cert, key=key, plaintext=self.plaintext)

    # -- transport -------------------------------------------------------------------------------
    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            start = self._current
        errors: list[str] = []
        n = len(self._clients)
        for i in range(n):
            idx = (start + i) % n
            client = self._clients[idx]
            try:
                with self._call_lock:
                    result: dict[str, Any] = client.post(client.get_url(path), json=body)
            except (etcd_exc.ConnectionFailedError, etcd_exc.ConnectionTimeoutError) as exc:
                errors.append(f"{self.endpoints[idx]}: {type(exc).__name__}")
                continue
            except etcd_exc.Etcd3Exception as exc:
                # 503 "etcdserver: no leader" and similar: another member may serve it.
                text = _text(exc)
                if "no leader" in text or "Unavailable" in text or "timed out" in text:
                    errors.append(f"{self.endpoints[idx]}: {text[:120]}")
                    continue
                raise
            with self._lock:
                self._current = idx
            return result
        raise EtcdUnavailable("etcd unreachable: " + "; ".join(errors))

    # -- leases ----------------------------------------------------------------------------------
    def grant(self, ttl: int) -> int:
        result = self._post("/lease/grant", {"TTL": int(ttl), "ID": 0})
        return int(result["ID"])

    def keepalive(self, lease: int) -> int:
        """Refresh; the remaining TTL in seconds, or -1 when the server no longer has the lease."""
        result = self._post("/lease/keepalive", {"ID": lease})
        return int(result.get("result", {}).get("TTL", -1))

    def time_to_live(self, lease: int) -> int:
        result = self._post("/kv/lease/timetolive", {"ID": lease})
        return int(result.get("TTL", -1))

    def revoke(self, lease: int) -> None:
        try:
            self._post("/kv/lease/revoke", {"ID": lease})
        except etcd_exc.Etcd3Exception as exc:
            if "not found" not in _text(exc):
                raise

    # -- keys ------------------------------------------------------------------------------------
    def put(self, key: str, value: bytes | str, lease: int = 0) -> int:
        """Returns the new revision; LeaseExpired when ``lease`` is no longer known."""
        body: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease:
            body["lease"] = lease
        try:
            result = self._post("/kv/put", body)
        except etcd_exc.Etcd3Exception as exc:
            if "lease not found" in _text(exc):
                raise LeaseExpired(_text(exc)) from None
            raise
        return int(result.get("header", {}).get("revision", 0))

    def get(self, key: str) -> KeyValue | None:
        kvs, _ = self._range({"key": _b64(key)})
        return kvs[0] if kvs else None

    def get_prefix(self, prefix: str) -> tuple[list[KeyValue], int]:
        """Every key under ``prefix`` (sorted by key) and the store revision of the read."""
        return self._range({"key": _b64(prefix), "range_end": prefix_end(prefix),
                            "sort_order": "ASCEND", "sort_target": "KEY"})

    def _range(self, body: dict[str, Any]) -> tuple[list[KeyValue], int]:
        result = self._post("/kv/range", body)
        kvs = [_kv(item) for item in result.get("kvs", [])]
        return kvs, int(result.get("header", {}).get("revision", 0))

    def delete(self, key: str) -> bool:
        result = self._post("/kv/deleterange", {"key": _b64(key)})
        return int(result.get("deleted", 0)) > 0

    def create(self, key: str, value: bytes | str, lease: int = 0) -> tuple[bool, KeyValue | None]:
        """Put ``key`` only if it does not exist (one txn). Returns (created, current holder)."""
        put: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease:
            put["lease"] = lease
        txn = {
            "compare": [{"key": _b64(key), "result": "EQUAL", "target": "CREATE", "create_revision": 0}],
            "success": [{"request_put": put}],
            "failure": [{"request_range": {"key": _b64(key)}}],
        }
        try:
            result = self._post("/kv/txn", txn)
        except etcd_exc.Etcd3Exception as exc:
            if "lease not found" in _text(exc):
                raise LeaseExpired(_text(exc)) from None
            raise
        if result.get("succeeded"):
            return True, None
        for resp in result.get("responses", []):
            kvs = resp.get("response_range", {}).get("kvs", [])
            if kvs:
                return False, _kv(kvs[0])
        return False, None

    def replace(self, key: str, value: bytes | str, mod_revision: int) -> bool:
        """Put ``key`` only if its mod revision is still ``mod_revision`` (0: only if absent)."""
        target = ({"target": "MOD", "mod_revision": mod_revision} if mod_revision
                  else {"target": "CREATE", "create_revision": 0})
        txn = {
            "compare": [{"key": _b64(key), "result": "EQUAL", **target}],
            "success": [{"request_put": {"key": _b64(key), "value": _b64(value)}}],
            "failure": [],
        }
        return bool(self._post("/kv/txn", txn).get("succeeded"))

    def delete_if(self, key: str, value: bytes | str) -> bool:
        """Delete ``key`` only while it still holds ``value`` (a leader resigning its own key)."""
        txn = {
            "compare": [{"key": _b64(key), "result": "EQUAL", "target": "VALUE", "value": _b64(value)}],
            "success": [{"request_delete_range": {"key": _b64(key)}}],
            "failure": [],
        }
        return bool(self._post("/kv/txn", txn).get("succeeded"))

    # -- guarded transactions ------------------------------------------------------------------
    def txn(self, compare: list[dict[str, Any]], success: list[dict[str, Any]],
            failure: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """One etcd transaction as built by ``compare_*``/``op_*``; the server's answer
        (``succeeded``, ``responses``). LeaseExpired when a put names a lease the server lost."""
        try:
            return self._post("/kv/txn", {"compare": compare, "success": success, "failure": failure or []})
        except etcd_exc.Etcd3Exception as exc:
            if "lease not found" in _text(exc):
                raise LeaseExpired(_text(exc)) from None
            raise

    def put_if(self, key: str, value: bytes | str, mod_revision: int, guards: Sequence[dict[str, Any]]) -> bool:
        """``replace`` that also needs every compare in ``guards`` to hold (all in one txn), e.g.
        ``compare_held`` for "the leader key is still ours"."""
        compare = [compare_revision(key, mod_revision), *guards]
        return bool(self.txn(compare, [op_put(key, value)]).get("succeeded"))


def compare_revision(key: str, mod_revision: int) -> dict[str, Any]:
    """``key`` unchanged since ``mod_revision`` (0: ``key`` absent)."""
    if mod_revision:
        return {"key": _b64(key), "result": "EQUAL", "target": "MOD", "mod_revision": mod_revision}
    return {"key": _b64(key), "result": "EQUAL", "target": "CREATE", "create_revision": 0}


def compare_held(key: str, value: bytes | str, lease: int) -> list[dict[str, Any]]:
    """``key`` holds ``value`` under ``lease`` (etcd's election recipe: a deposed holder, or one
    whose lease expired and whose name was taken again under a new lease, fails both or one)."""
    return [{"key": _b64(key), "result": "EQUAL", "target": "VALUE", "value": _b64(value)},
            {"key": _b64(key), "result": "EQUAL", "target": "LEASE", "lease": str(lease)}]


def op_put(key: str, value: bytes | str, lease: int = 0) -> dict[str, Any]:
    put: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
    if lease:
        put["lease"] = lease
    return {"request_put": put}


def op_get(key: str) -> dict[str, Any]:
    return {"request_range": {"key": _b64(key)}}


def txn_kvs(result: dict[str, Any]) -> list[KeyValue]:
    """The keys the range ops of a txn answer returned."""
    return [_kv(item) for resp in result.get("responses", [])
            for item in resp.get("response_range", {}).get("kvs", [])]


def _kv(item: dict[str, Any]) -> KeyValue:
    return KeyValue(
        key=_unb64(item.get("key")).decode(errors="replace"),
        value=_unb64(item.get("value")),
        lease=int(item.get("lease", 0)),
        create_revision=int(item.get("create_revision", 0)),
        mod_revision=int(item.get("mod_revision", 0)),
    )


class PrefixWatch:
    """Calls ``on_change()`` whenever a key under ``prefix`` changes, from an etcd watch stream.

    Only a wake-up signal: the caller re-reads what it needs (level-triggered), so a missed event
    costs latency, never correctness. ``on_change`` is also called after every (re)connect, since
    events may have been missed while disconnected. The stream is re-opened after ``idle_s``
    without data, which also bounds how long ``stop`` waits. ``connected`` says whether a stream
    is open now; callers poll on their own while it is not.
    """

    def __init__(self, client: EtcdClient, prefix: str, on_change: Callable[[], None], *,
                 idle_s: float = 5.0, retry_s: float = 0.5) -> None:
        self.client = client
        self.prefix = prefix
        self.on_change = on_change
        self.idle_s = idle_s
        self.retry_s = retry_s
        self.connected = False
        self.events = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="etcd-watch", daemon=True)

    def start(self) -> PrefixWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(0.2)  # a blocked read ends within idle_s; the thread is a daemon

    def _run(self) -> None:
        body = {"create_request": {"key": _b64(self.prefix), "range_end": prefix_end(self.prefix)}}
        n = 0
        while not self._stop.is_set():
            endpoint = self.client.endpoints[n % len(self.client.endpoints)]
            host, port = parse_endpoint(endpoint)
            url = f"{self.client.scheme}://{host}:{port}/v3/watch"
            try:
                with self.client.new_session() as session, session.post(
                        url, json=body, stream=True, timeout=(self.client.timeout_s, self.idle_s)) as resp:
                    if resp.status_code != 200:
                        raise ConnectionError(f"watch: HTTP {resp.status_code}")
                    for line in resp.iter_lines():
                        if self._stop.is_set():
                            return
                        if not line.strip():
                            continue
                        result = json.loads(line).get("result", {})
                        if result.get("created"):
                            self.connected = True
                            self.on_change()  # catch up on whatever happened while disconnected
                        elif result.get("events"):
                            self.events += len(result["events"])
                            self.on_change()
                        if result.get("canceled"):
                            break
            except (requests.exceptions.ConnectionError, requests.exceptions.Timeout,
                    requests.exceptions.ChunkedEncodingError, ConnectionError, ValueError) as exc:
                log.debug("watch on %s ended: %s", endpoint, exc)
                if self.connected is False:
                    n += 1  # try the next endpoint
            finally:
                self.connected = False
            self._stop.wait(self.retry_s)


class LeaseKeeper:
    """Holds one lease alive from a background thread.

    ``on_expired`` runs (on the keeper thread) when the server reports the lease gone; the keeper
    then stops: the owner grants a new lease and re-registers. ``healthy`` tells whether the last
    refresh reached the server recently (within the TTL): false during an etcd stall, which is a
    reason to hold back job-wide decisions, never a reason to declare anyone lost.
    """

    def __init__(self, client: EtcdClient, lease: int, ttl: int, *,
                 on_expired: Callable[[int], None] = lambda lease: None, retry_s: float = 0.2,
                 on_refresh: Callable[[bool], None] = lambda ok: None,
                 clock: Callable[[], float] = time.monotonic, since: float | None = None) -> None:
        """``on_refresh(ok)`` after every refresh attempt (False: etcd did not answer); ``since``:
        when the grant of ``lease`` was sent (``clock``'s time; default now)."""
        self.client = client
        self.on_refresh = on_refresh
        self.lease = lease
        self.ttl = ttl
        self.on_expired = on_expired
        self.retry_s = retry_s
        self._clock = clock
        self.last_ok = clock() if since is None else since
        """When the newest refresh the server answered was sent: the server's deadline for the
        lease is at least this plus the TTL, so fencing counts from here."""
        self.failures = 0  # refresh attempts that did not reach the server (for metrics/tests)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"etcd-lease-{lease:x}", daemon=True)

    def start(self) -> LeaseKeeper:
        self._thread.start()
        return self

    @property
    def healthy(self) -> bool:
        return self._clock() - self.last_ok < self.ttl

    def _run(self) -> None:
        period = max(self.ttl / REFRESHES_PER_TTL, 0.1)
        wait = period
        while not self._stop.wait(wait):
            sent = self._clock()
            try:
                left = self.client.keepalive(self.lease)
            except (EtcdUnavailable, etcd_exc.Etcd3Exception) as exc:
                self.failures += 1
                log.debug("lease %x refresh failed (will retry): %s", self.lease, exc)
                self.on_refresh(False)
                wait = self.retry_s
                continue
            if left <= 0:
                log.warning("lease %x expired on the etcd server", self.lease)
                self._stop.set()
                self.on_expired(self.lease)
                return
            self.last_ok = sent
            self.on_refresh(True)
            wait = period

    def stop(self, revoke: bool = False) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(5.0)
        if revoke:
            try:
                self.client.revoke(self.lease)
            except (EtcdUnavailable, etcd_exc.Etcd3Exception) as exc:
                log.info("could not revoke lease %x (it will expire): %s", self.lease, exc)
