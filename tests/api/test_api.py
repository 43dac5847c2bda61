"""Control API over real sockets: a real ApiServer on a tmp unix socket and 127.0.0.1:0, a small
in-test handler standing in for the daemon, and the real ApiClient / raw http.client."""

from __future__ import annotations

import http.client
import io
import json
import os
import socket
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.api import ADMIN, READER, FakeDaemon, token_file
from trainguard.agent.api.auth import TokenFileError
from trainguard.agent.api.client import ApiClient, ApiClientError
from trainguard.agent.api.config import ApiConfig
from trainguard.agent.api.server import AUTH_REPORT_BURST, ApiServer, ApiServerError


@pytest.fixture
def env(tmp_path: Path) -> Iterator[dict[str, Any]]:
    failures: list[tuple[str, str]] = []
    daemon = FakeDaemon(tmp_path / "blobs")
    tokens = token_file(tmp_path / "tokens", f"# test tokens\n{ADMIN}\n{READER} read\n")
    cfg = ApiConfig(unix_socket=tmp_path / "run" / "agent.sock", tcp="127.0.0.1:0", allow_plaintext=True, token_file=tokens,
                    max_body_bytes=64 * 1024)
    server = ApiServer(cfg, daemon, on_auth_failure=lambda remote, path: failures.append((remote, path)))
    server.start()
    assert server.tcp_address is not None
    host, port = server.tcp_address
    yield {"server": server, "daemon": daemon, "failures": failures, "host": host, "port": port,
           "sock": cfg.unix_socket, "tokens": tokens, "tmp": tmp_path}
    daemon.release.set()
    server.stop()


def _raw(env: dict[str, Any], method: str, path: str, body: bytes | None = None,
         token: str | None = ADMIN, headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    conn = http.client.HTTPConnection(env["host"], env["port"], timeout=5)
    h = dict(headers or {})
    if token:
        h["Authorization"] = f"Bearer {token}"
    conn.request(method, path, body=body, headers=h)
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    assert resp.getheader("Content-Type") == "application/json"
    return resp.status, json.loads(data)


def _remote(env: dict[str, Any], token: str | None) -> ApiClient:
    return ApiClient.remote(env["host"], env["port"], token=token, timeout=5)


def test_unix_socket_mode_parent_dir_and_local_trust(env: dict[str, Any]) -> None:
    sock: Path = env["sock"]
    assert stat.S_ISSOCK(os.lstat(sock).st_mode)
    assert stat.S_IMODE(os.lstat(sock).st_mode) == 0o660
    assert stat.S_IMODE(os.stat(sock.parent).st_mode) == 0o750
    local = ApiClient.local(sock)
    assert local.health() == {"node": "n1", "version": "test", "ok": True}
    # No token on the unix socket: trusted by file permissions, including admin routes.
    assert local.status()["leader"] == "n1"
    assert local.submit_job({"command": ["true"]}) == "j2"
    # A token sent on the unix socket must still be a valid one.
    with pytest.raises(ApiClientError) as e:
        ApiClient.local(sock, token="w" * 40).status()
    assert e.value.status == 401
    assert ApiClient.local(sock, token=READER).status()["node"] == "n1"
    with pytest.raises(ApiClientError) as e:
        ApiClient.local(sock, token=READER).put_plan("j1", {"lr_scale": 0.5})
    assert e.value.status == 403
    assert [p for _, p in env["failures"]] == ["/v1/status"]
    assert env["failures"][0][0].startswith(f"unix:pid={os.getpid()},")


def test_unix_requires_token_when_configured(tmp_path: Path) -> None:
    tokens = token_file(tmp_path / "tokens", ADMIN + "\n")
    cfg = ApiConfig(unix_socket=tmp_path / "a.sock", token_file=tokens, unix_requires_token=True)
    with ApiServer(cfg, FakeDaemon(tmp_path)):
        assert ApiClient.local(tmp_path / "a.sock").health()["ok"] is True
        with pytest.raises(ApiClientError) as e:
            ApiClient.local(tmp_path / "a.sock").status()
        assert e.value.status == 401
        assert ApiClient.local(tmp_path / "a.sock", token=ADMIN).status()["node"] == "n1"


def test_tcp_auth_401_403_counted_and_reported(env: dict[str, Any]) -> None:
    server: ApiServer = env["server"]
    assert _remote(env, None).health()["ok"] is True
    for token in (None, "wrong-token-of-sufficient-length", ADMIN[:-1]):
        with pytest.raises(ApiClientError) as e:
            _remote(env, token).status()
        assert e.value.status == 401
    status, body = _raw(env, "GET", "/v1/status", headers={"Authorization": f"Basic {ADMIN}"}, token=None)
    assert status == 401 and "token" in body["error"]
    # Unauthenticated callers learn nothing about routes: 401 before 404.
    assert _raw(env, "GET", "/v1/nope", token=None)[0] == 401
    assert server.stats.snapshot()["auth_failures_total"] == 5
    assert len(env["failures"]) == 5
    remote, path = env["failures"][0]
    assert remote.startswith("127.0.0.1:") and path == "/v1/status"

    reader = _remote(env, READER)
    assert reader.status()["node"] == "n1"
    assert reader.get_plan("j1")["version"] == 1
    for call in (lambda: reader.submit_job({"command": ["x"]}), lambda: reader.stop_job("j1"),
                 lambda: reader.put_plan("j1", {"lr_scale": 2}), lambda: reader.drain("j1", rank=1),
                 lambda: reader.get_blob("ckpt", "a/b")):
        with pytest.raises(ApiClientError) as e:
            call()
        assert e.value.status == 403
    assert env["daemon"].calls == []

    admin = _remote(env, ADMIN)
    # N/A values (NaN, inf) go out as null: strict JSON that any dashboard parses.
    assert admin.status()["jobs"]["j1"]["ranks"]["0"] == {"straggler_score": None, "step_s": [0.5, None]}
    assert server.stats.snapshot()["auth_failures_total"] == 5


def test_auth_failure_reports_are_rate_limited(tmp_path: Path) -> None:
    now = [1000.0]
    reported: list[str] = []
    tokens = token_file(tmp_path / "tokens", ADMIN + "\n")
    cfg = ApiConfig(unix_socket=None, tcp="127.0.0.1:0", allow_plaintext=True, token_file=tokens)
    with ApiServer(cfg, FakeDaemon(tmp_path), on_auth_failure=lambda r, p: reported.append(p),
                   clock=lambda: now[0]) as server:
        port = server.tcp_port
        assert port is not None
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        for _ in range(AUTH_REPORT_BURST + 10):  # one keep-alive connection: 401s keep it open
            conn.request("GET", "/v1/status")
            resp = conn.getresponse()
            assert resp.status == 401
            resp.read()
        now[0] += 5.0
        for _ in range(10):
            conn.request("GET", "/v1/jobs")
            resp = conn.getresponse()
            assert resp.status == 401
            resp.read()
        conn.close()
        stats = server.stats.snapshot()
    assert stats["auth_failures_total"] == AUTH_REPORT_BURST + 20
    assert len(reported) == AUTH_REPORT_BURST + 5
    assert reported.count("/v1/jobs") == 5
    assert stats["auth_failures_unreported_total"] == 15


def test_routes_reach_the_handler(env: dict[str, Any]) -> None:
    admin, daemon = _remote(env, ADMIN), env["daemon"]
    assert admin.events(since=7, limit=3, kind="straggler") == {
        "events": [{"seq": 8, "kind": "straggler"}], "next": 8}
    assert admin.jobs() == [{"job": "j1", "state": "running"}]
    assert admin.job("j1")["state"] == "running"
    assert admin.put_plan("j1", {"lr_scale": 0.5}) == {"version": 2, "lr_scale": 0.5}
    assert admin.get_plan("j1")["version"] == 2
    assert admin.checkpoints(job="j1") == [{"job": "j1", "step": 100, "tier": "memory"}]
    assert admin.checkpoint_now("j1")["requested"] is True
    assert admin.drain("j1", node="n2") == {"job": "j1", "node": "n2"}
    assert admin.stop_job("j1", grace_s=5)["state"] == "stopping"
    assert _raw(env, "DELETE", "/v1/jobs/j1")[0] == 200
    assert admin.put_detection_config({"straggler_threshold": 0.7})["straggler_threshold"] == 0.7
    assert admin.detection_config()["straggler_threshold"] == 0.7
    assert daemon.calls == [("events", (7, 3, "straggler")), ("drain", ("j1", {"node": "n2"})),
                            ("stop", ("j1", {"grace_s": 5})), ("stop", ("j1", {}))]
    daemon.calls.clear()
    # One poll of `trainguard run`: the job, each of its ranks' output from its own offset, and
    # the events that name the job (the fake's event names none).
    got = admin.follow_job("j1", 9, {1: 30, 0: 12})
    assert got["job"]["state"] == "running" and got["events"] == [] and got["next"] == 10
    assert [(o["rank"], o["offset"], o["text"]) for o in got["output"]] == [(0, 12, "r0\n\n"), (1, 30, "r1\n\n")]
    assert daemon.calls == [("output", ("j1", 0, 12, 64 << 10)), ("output", ("j1", 1, 30, 64 << 10)),
                            ("events", (9, 500, None))]
    daemon.calls.clear()
    with pytest.raises(ApiClientError) as e:
        admin.job("nope")
    assert e.value.status == 404 and "no job nope" in str(e.value)
    with pytest.raises(ApiClientError) as e:
        admin.submit_job({"no": "command"})
    assert e.value.status == 400 and "command" in e.value.message


def test_bad_requests_get_json_errors(env: dict[str, Any]) -> None:
    assert _raw(env, "POST", "/v1/jobs", b"{not json")[0] == 400
    status, body = _raw(env, "POST", "/v1/jobs", b"[1, 2]")
    assert status == 400 and "JSON object" in body["error"]
    assert _raw(env, "POST", "/v1/jobs", b"\xff\xfe")[0] == 400
    assert _raw(env, "POST", "/v1/jobs", b"[" * 60_000)[0] == 400  # nesting too deep for json
    status, body = _raw(env, "POST", "/v1/jobs", b"{}", headers={"Transfer-Encoding": "chunked"})
    assert status == 411
    status, body = _raw(env, "POST", "/v1/jobs", b'{"command": "' + b"x" * 70_000 + b'"}')
    assert status == 413 and "limit" in body["error"]
    status, body = _raw(env, "GET", "/v1/nothing-here")
    assert status == 404 and "no such route" in body["error"]
    conn = http.client.HTTPConnection(env["host"], env["port"], timeout=5)
    conn.request("PATCH", "/v1/status", headers={"Authorization": f"Bearer {ADMIN}"})
    resp = conn.getresponse()
    assert resp.status == 405 and resp.getheader("Allow") == "GET"
    resp.read()
    conn.close()
    assert _raw(env, "GET", "/v1/events?since=abc")[0] == 400
    assert _raw(env, "GET", "/v1/events?limit=0")[0] == 400
    assert _raw(env, "GET", "/v1/jobs/bad%2Fid")[0] == 400
    for offsets in ("0:x", "0", "-1:5", "0:1:2"):
        status, body = _raw(env, "GET", f"/v1/jobs/j1/follow?offsets={offsets}")
        assert status == 400 and "offsets" in body["error"], offsets
    assert _raw(env, "GET", "/v1/blobs/ns/a/../../etc/passwd")[0] == 400
    assert env["daemon"].calls == []


def test_oversize_body_closes_connection_and_keepalive_works(env: dict[str, Any]) -> None:
    conn = http.client.HTTPConnection(env["host"], env["port"], timeout=5)
    auth = {"Authorization": f"Bearer {ADMIN}"}
    for _ in range(3):  # several requests on one keep-alive connection
        conn.request("GET", "/v1/status", headers=auth)
        resp = conn.getresponse()
        assert resp.status == 200 and json.loads(resp.read())["node"] == "n1"
        # A refused request with a small body: the body is read away, the connection stays usable.
        conn.request("POST", "/v1/jobs", body=b'{"command": ["x"]}', headers={"Authorization": "Bearer bad"})
        resp = conn.getresponse()
        assert resp.status == 401 and resp.getheader("Connection") is None
        resp.read()
    # Announce a body over the limit but send only its start: 413 at once, connection closed
    # (the unread body must not be parsed as a next request).
    conn.putrequest("POST", "/v1/jobs")
    conn.putheader("Authorization", f"Bearer {ADMIN}")
    conn.putheader("Content-Length", str(10 << 20))
    conn.endheaders()
    conn.send(b"{" + b" " * 1000)
    resp = conn.getresponse()
    assert resp.status == 413 and resp.getheader("Connection") == "close"
    resp.read()
    conn.close()


def test_handler_exception_is_500_counted_and_server_survives(env: dict[str, Any], caplog) -> None:
    status, body = _raw(env, "GET", "/v1/jobs/boom")
    assert status == 500
    assert "secret internal detail" not in body["error"] and "Traceback" not in body["error"]
    assert "secret internal detail" in caplog.text  # the traceback goes to the agent's log
    assert env["server"].stats.snapshot()["handler_errors_total"] == 1
    assert _remote(env, ADMIN).status()["node"] == "n1"


def test_slow_request_does_not_block_others(env: dict[str, Any]) -> None:
    daemon: FakeDaemon = env["daemon"]
    result: dict[str, Any] = {}
    slow = threading.Thread(target=lambda: result.update(_remote(env, ADMIN).job("slow")))
    slow.start()
    assert daemon.entered_slow.wait(5)
    assert ApiClient.local(env["sock"]).health()["ok"] is True
    assert _remote(env, READER).status()["node"] == "n1"
    # answered while the slow call still holds its thread (released below, or after 10 s)
    assert not daemon.left_slow.is_set() and slow.is_alive()
    daemon.release.set()
    slow.join(5)
    assert result == {"job": "slow"}


def test_burst_of_local_clients_all_served(env: dict[str, Any]) -> None:
    # More simultaneous connects than socketserver's default backlog of 5.
    errors: list[str] = []
    done: list[int] = []

    def worker() -> None:
        try:
            for _ in range(5):
                ApiClient.local(env["sock"]).status()
            done.append(1)
        except ApiClientError as e:
            errors.append(str(e))

    threads = [threading.Thread(target=worker) for _ in range(24)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert errors == [] and len(done) == 24


def test_connection_cap_answers_503(tmp_path: Path) -> None:
    daemon = FakeDaemon(tmp_path)
    cfg = ApiConfig(unix_socket=tmp_path / "a.sock", max_connections=1)
    with ApiServer(cfg, daemon) as server:
        holder = threading.Thread(target=lambda: ApiClient.local(tmp_path / "a.sock").job("slow"))
        holder.start()
        assert daemon.entered_slow.wait(5)
        with pytest.raises(ApiClientError) as e:
            ApiClient.local(tmp_path / "a.sock").health()
        assert e.value.status == 503
        daemon.release.set()
        holder.join(5)
        # The slot frees once the server sees the holder's connection close: soon, not at once.
        deadline = time.monotonic() + 5
        while True:
            try:
                assert ApiClient.local(tmp_path / "a.sock").health()["ok"] is True
                break
            except ApiClientError as e:
                assert e.status == 503 and time.monotonic() < deadline
                time.sleep(0.02)
        assert server.stats.snapshot()["busy_rejected_total"] >= 1


def test_tcp_flood_does_not_lock_out_the_local_socket(tmp_path: Path) -> None:
    tokens = token_file(tmp_path / "tokens", ADMIN + "\n")
    cfg = ApiConfig(unix_socket=tmp_path / "a.sock", tcp="127.0.0.1:0", allow_plaintext=True, token_file=tokens, max_connections=2)
    with ApiServer(cfg, FakeDaemon(tmp_path)) as server:
        port = server.tcp_port
        assert port is not None
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(2)]  # hold the TCP slots
        try:
            time.sleep(0.1)
            with pytest.raises(ApiClientError) as e:
                ApiClient.remote("127.0.0.1", port, token=ADMIN, timeout=5).health()
            assert e.value.status == 503
            assert ApiClient.local(tmp_path / "a.sock").status()["node"] == "n1"
        finally:
            for s in idle:
                s.close()


def test_blob_round_trip_byte_exact(env: dict[str, Any], tmp_path: Path) -> None:
    admin = _remote(env, ADMIN)
    data = os.urandom(5 * (1 << 20) + 12345)
    src = tmp_path / "shard.bin"
    src.write_bytes(data)
    with open(src, "rb") as f:
        assert admin.put_blob("ckpt", "job1/step100/shard-0.distcp", f) == {"size": len(data)}
    out = io.BytesIO()
    assert admin.get_blob("ckpt", "job1/step100/shard-0.distcp", out) == len(data)
    assert out.getvalue() == data
    # Bytes in, bytes out, over the unix socket too.
    local = ApiClient.local(env["sock"])
    local.put_blob("ckpt", "small", b"\x00\x01tiny")
    assert local.get_blob("ckpt", "small") == b"\x00\x01tiny"
    with pytest.raises(ApiClientError) as e:
        admin.get_blob("ckpt", "missing")
    assert e.value.status == 404
    assert admin.delete_blob("ckpt", "small") == {"deleted": "small"}


def test_blob_upload_refused_before_the_body_is_sent(tmp_path: Path) -> None:
    tokens = token_file(tmp_path / "tokens", f"{ADMIN}\n{READER} read\n")
    daemon = FakeDaemon(tmp_path / "blobs")
    cfg = ApiConfig(unix_socket=None, tcp="127.0.0.1:0", allow_plaintext=True, token_file=tokens, max_blob_bytes=1 << 20)
    with ApiServer(cfg, daemon) as server:
        port = server.tcp_port
        assert port is not None
        big = os.urandom(3 << 20)
        for token, status in ((None, 401), (READER, 403), (ADMIN, 413)):
            # Answered from the head (100-continue): a server that lingered for the body would
            # reach the client's timeout, an error without this status.
            with pytest.raises(ApiClientError) as e:
                ApiClient.remote("127.0.0.1", port, token=token, timeout=5).put_blob("ckpt", "big", big)
            assert e.value.status == status, e.value
        assert not daemon.blob_dir.exists()
        assert ApiClient.remote("127.0.0.1", port, token=ADMIN).put_blob("ckpt", "ok", big[:1000]) == {
            "size": 1000}


def test_truncated_blob_upload_is_not_committed(env: dict[str, Any]) -> None:
    daemon: FakeDaemon = env["daemon"]
    s = socket.create_connection((env["host"], env["port"]), timeout=5)
    s.sendall(f"PUT /v1/blobs/ckpt/cut HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {ADMIN}\r\n"
              f"Content-Length: 100000\r\n\r\n".encode() + b"z" * 1000)
    s.shutdown(socket.SHUT_WR)
    s.recv(1024)  # the server closes without an answer (or with one); either way, no commit
    s.close()
    deadline = time.monotonic() + 5
    while daemon.aborted_uploads == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert daemon.aborted_uploads == 1
    assert not (daemon.blob_dir / "ckpt" / "cut").exists()
    assert _remote(env, ADMIN).status()["node"] == "n1"


def test_client_reports_unreachable_agent(tmp_path: Path) -> None:
    missing = tmp_path / "agent.sock"
    with pytest.raises(ApiClientError) as e:
        ApiClient.local(missing).status()
    assert e.value.status == 0
    assert str(e.value) == f"no agent at {missing}: is `trainguard agent` running?"
    with socket.socket() as s:  # a port that was free a moment ago: nobody listens
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ApiClientError) as e:
        ApiClient.remote("127.0.0.1", port, token=ADMIN, timeout=2).health()
    assert e.value.status == 0 and f"127.0.0.1:{port}" in e.value.message


def test_token_file_reload(env: dict[str, Any]) -> None:
    server: ApiServer = env["server"]
    new = "n" * 40
    assert _remote(env, ADMIN).status()
    token_file(env["tokens"], f"{new} admin\n")
    assert _remote(env, ADMIN).status()  # not re-read until reload()
    assert server.reload() == 1
    with pytest.raises(ApiClientError) as e:
        _remote(env, ADMIN).status()
    assert e.value.status == 401
    assert _remote(env, new).status()["node"] == "n1"
    # A broken file on reload keeps the tokens in force rather than locking everyone out.
    token_file(env["tokens"], f"{new} superuser\n")
    with pytest.raises(TokenFileError, match="unknown role"):
        server.reload()
    assert _remote(env, new).status()["node"] == "n1"
    # Client side: the first token of a file.
    assert ApiClient.remote(env["host"], env["port"], token_file=token_file(
        env["tmp"] / "client-token", f"{new}\n")).status()["node"] == "n1"


def test_world_readable_token_file_is_refused(tmp_path: Path) -> None:
    tokens = token_file(tmp_path / "tokens", ADMIN + "\n", mode=0o644)
    cfg = ApiConfig(unix_socket=tmp_path / "a.sock", tcp="127.0.0.1:0", allow_plaintext=True, token_file=tokens)
    with pytest.raises(TokenFileError, match=r"mode 0644 .*chmod 600"):
        ApiServer(cfg, FakeDaemon(tmp_path))
    assert not (tmp_path / "a.sock").exists()
    token_file(tokens, "short\n")
    with pytest.raises(TokenFileError, match="line 1: token shorter"):
        ApiServer(cfg, FakeDaemon(tmp_path))


def test_stale_socket_replaced_live_one_refused(tmp_path: Path) -> None:
    path = tmp_path / "agent.sock"
    dead = socket.socket(socket.AF_UNIX)
    dead.bind(str(path))
    dead.close()  # leaves the file behind, like a killed agent
    cfg = ApiConfig(unix_socket=path)
    with ApiServer(cfg, FakeDaemon(tmp_path)):
        assert ApiClient.local(path).health()["ok"] is True
        with pytest.raises(ApiServerError, match="already serving"):
            ApiServer(cfg, FakeDaemon(tmp_path)).start()
        assert ApiClient.local(path).health()["ok"] is True
    assert not path.exists()  # stop() removes its own socket
    path.write_text("not a socket")
    with pytest.raises(ApiServerError, match="not a socket"):
        ApiServer(cfg, FakeDaemon(tmp_path)).start()


@pytest.mark.parametrize(("kwargs", "key"), [
    ({"tcp": "127.0.0.1:0"}, "api.token_file"),
    ({"tcp": "nohostport"}, "api.tcp"),
    ({"tcp": "127.0.0.1:70000", "token_file": "t"}, "api.tcp"),
    ({"unix_socket": None}, "api.unix_socket"),
    ({"unix_mode": 0o666}, "api.unix_mode"),
    ({"unix_requires_token": True}, "api.token_file"),
    ({"max_body_bytes": 10}, "api.max_body_bytes"),
    ({"tcp": "127.0.0.1:0", "token_file": "t"}, "api.tls_cert"),
    ({"header_timeout_s": 0}, "api.header_timeout_s"),
    ({"max_connections_per_peer": 0}, "api.max_connections_per_peer"),
    ({"unix_socket": "/tmp/" + "x" * 120}, "api.unix_socket"),
])
def test_config_errors_name_the_key(kwargs: dict[str, Any], key: str) -> None:
    with pytest.raises(ValueError, match=key):
        ApiConfig(**kwargs)
