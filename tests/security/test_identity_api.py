"""The TCP API from the outside, as another node or a stranger would use it: a node's verified
certificate is its identity (it may write only its own peer copies and send only its own
telemetry, whatever its token), slowloris clients are cut at the header deadline and cannot lock
out a peer, auth-failure reports carry a bounded path, and read tokens never see job env values."""

from __future__ import annotations

import http.client
import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trustme

from tests.helpers.api import ADMIN, READER, FakeDaemon, token_file
from trainguard.agent.api.client import ApiClient, ApiClientError
from trainguard.agent.api.config import ApiConfig
from trainguard.agent.api.server import MAX_REPORTED_PATH, ApiServer
from trainguard.agent.api.tls import TlsFiles, client_context, server_context


class IdentityDaemon(FakeDaemon):
    """FakeDaemon plus forwarded telemetry and a job whose spec carries secrets in env."""

    def ingest_telemetry(self, job: str, body: dict[str, Any]) -> dict[str, Any]:
        self.calls.append(("telemetry", (job, body.get("node"))))
        return {"accepted": len(body.get("messages", [])), "dropped": 0}

    def list_jobs(self) -> list[Any]:
        return [{"job": "j1", "state": "running", "spec": {"env": {"WANDB_API_KEY": "s3cret", "HF_TOKEN": "hf_x"}}}]

    def get_job(self, job: str) -> dict[str, Any]:
        return {"job": job, "state": "running", "env": {"PASSWORD": "hunter2"}, "nproc": 1}


class Nodes:
    """A cluster CA and one certificate per node, named by its common name (as agents' certs are)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.ca = trustme.CA(organization_name="cluster")
        self.ca_file = str(root / "ca.pem")
        Path(self.ca_file).write_bytes(self.ca.cert_pem.bytes())

    def files(self, name: str) -> TlsFiles:
        cert = self.ca.issue_cert("127.0.0.1", common_name=name)
        chain = self.root / f"{name}.pem"
        chain.write_bytes(b"".join(b.bytes() for b in cert.cert_chain_pems))
        key = self.root / f"{name}.key"
        key.write_bytes(cert.private_key_pem.bytes())
        os.chmod(key, 0o600)
        return TlsFiles(str(chain), str(key), self.ca_file, client_auth=True)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[dict[str, Any]]:
    nodes = Nodes(tmp_path)
    refused: list[tuple[str, str, str, str]] = []
    daemon = IdentityDaemon(tmp_path / "blobs")
    tokens = token_file(tmp_path / "tokens", f"{ADMIN}\n{READER} read\n")
    cfg = ApiConfig(unix_socket=None, tcp="127.0.0.1:0", token_file=tokens,
                    tls=server_context(nodes.files("holder")), handshake_timeout_s=3.0)
    server = ApiServer(cfg, daemon, on_node_refused=lambda *a: refused.append(a))
    server.start()
    assert server.tcp_address is not None
    host, port = server.tcp_address

    def client(name: str, token: str = ADMIN) -> ApiClient:
        return ApiClient.remote(host, port, token=token, timeout=5, tls=client_context(nodes.files(name)))

    yield {"server": server, "daemon": daemon, "client": client, "refused": refused, "blobs": tmp_path / "blobs"}
    server.stop()


def test_a_node_cannot_put_or_delete_another_nodes_peer_copy(cluster: dict[str, Any]) -> None:
    a, b = cluster["client"]("a"), cluster["client"]("b")
    planted = cluster["blobs"] / "ckpt" / "a" / "job" / "step_5" / "shard"
    # Node b, with the admin token and a valid cluster certificate, tries to plant a copy of a's.
    with pytest.raises(ApiClientError) as err:
        b.put_blob("ckpt", "a/job/step_5/shard", b"poisoned weights")
    assert err.value.status == 403 and "not node 'a'" in str(err.value)
    assert not planted.exists()
    # Node a's own put works; node b then cannot delete it either.
    assert a.put_blob("ckpt", "a/job/step_5/shard", b"real weights")["size"] == len(b"real weights")
    with pytest.raises(ApiClientError) as err:
        b.delete_blob("ckpt", "a/job/step_5/shard")
    assert err.value.status == 403
    assert planted.read_bytes() == b"real weights"
    # Its own copies it may write (and any node may read: restores fetch from holders).
    assert b.put_blob("ckpt", "b/job/step_5/shard", b"b's")["size"] == 3
    assert b.get_blob("ckpt", "a/job/step_5/shard") == b"real weights"
    assert cluster["server"].stats.snapshot()["node_refused_total"] == 2
    assert [(r[2], r[3]) for r in cluster["refused"]] == [("a", "/v1/blobs/ckpt/a/job/step_5/shard")] * 2
    assert all(r[1] == "b" for r in cluster["refused"])


def test_a_node_forwards_telemetry_only_as_itself(cluster: dict[str, Any]) -> None:
    b = cluster["client"]("b")
    with pytest.raises(ApiClientError) as err:
        b.forward_telemetry("j1", "a", ["{}"])
    assert err.value.status == 403
    assert ("telemetry", ("j1", "a")) not in cluster["daemon"].calls
    assert b.forward_telemetry("j1", "b", ["{}"])["accepted"] == 1
    assert ("telemetry", ("j1", "b")) in cluster["daemon"].calls
    assert cluster["server"].stats.snapshot()["node_refused_total"] == 1


def test_a_read_token_never_sees_env_values(cluster: dict[str, Any]) -> None:
    reader, admin = cluster["client"]("dashboard", READER), cluster["client"]("dashboard")
    listed = reader.jobs()
    assert listed[0]["spec"]["env"] == {"WANDB_API_KEY": "***", "HF_TOKEN": "***"}
    assert reader.job("j1")["env"] == {"PASSWORD": "***"}
    assert "s3cret" not in json.dumps(listed)
    assert admin.jobs()[0]["spec"]["env"]["WANDB_API_KEY"] == "s3cret"


def test_tcp_without_mutual_tls_needs_the_explicit_opt_in(tmp_path: Path) -> None:
    tokens = token_file(tmp_path / "tokens", f"{ADMIN}\n")
    nodes = Nodes(tmp_path)
    with pytest.raises(ValueError, match=r"^api\.tls_cert"):
        ApiConfig(unix_socket=None, tcp="127.0.0.1:0", token_file=tokens)
    one_way = TlsFiles(nodes.files("x").cert, nodes.files("x").key, nodes.ca_file, client_auth=False)
    with pytest.raises(ValueError, match=r"^api\.tls_client_auth"):
        ApiConfig(unix_socket=None, tcp="127.0.0.1:0", token_file=tokens, tls=server_context(one_way))
    from trainguard.agent.config import ConfigError, config_from_dict

    with pytest.raises(ConfigError) as cerr:
        config_from_dict({"api": {"tcp": "0.0.0.0:9479", "token_file": "/t", "tls_cert": "/c", "tls_ca": "/ca"}})
    assert cerr.value.key == "api.tls_client_auth"


# -- slow clients, bounded reports ---------------------------------------------------------------


@pytest.fixture
def plain(tmp_path: Path) -> Iterator[dict[str, Any]]:
    failures: list[tuple[str, str]] = []
    tokens = token_file(tmp_path / "tokens", f"{ADMIN}\n")
    cfg = ApiConfig(unix_socket=None, tcp="127.0.0.1:0", allow_plaintext=True, token_file=tokens,
                    header_timeout_s=1.5, max_connections_per_peer=16)
    server = ApiServer(cfg, FakeDaemon(tmp_path / "blobs"), on_auth_failure=lambda r, p: failures.append((r, p)))
    server.start()
    assert server.tcp_address is not None
    yield {"server": server, "port": server.tcp_address[1], "failures": failures}
    server.stop()


def test_a_client_trickling_its_headers_is_cut_at_the_deadline(plain: dict[str, Any]) -> None:
    sock = socket.create_connection(("127.0.0.1", plain["port"]), timeout=10)
    head = b"GET /v1/health HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-Pad-%d: y\r\n" % i for i in range(60)) + b"\r\n"
    sent, closed = 0, False
    try:
        for byte in head:  # one byte every 50 ms: every read succeeds, the head never completes in time
            sock.sendall(bytes([byte]))
            sent += 1
            time.sleep(0.05)
    except OSError:
        closed = True
    if not closed:
        sock.settimeout(5)
        try:
            closed = sock.recv(1) == b""
        except OSError:
            closed = True
    sock.close()
    assert closed and sent < len(head), f"the server read a {sent}-byte trickle of a {len(head)}-byte head"
    assert plain["server"].stats.snapshot()["header_timeouts_total"] >= 1


def test_seventy_slow_clients_do_not_lock_out_a_peer(plain: dict[str, Any]) -> None:
    port = plain["port"]
    slow: list[socket.socket] = []
    try:
        for _ in range(70):  # from 127.0.0.1: each sends half a request line and stalls
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            s.sendall(b"GET /v1/he")
            slow.append(s)
        time.sleep(0.3)
        # The peer at another address still gets through, well before the slow ones time out.
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5, source_address=("127.0.0.2", 0))
        conn.request("GET", "/v1/health")
        resp = conn.getresponse()
        assert resp.status == 200 and json.loads(resp.read())["ok"] is True
        conn.close()
        assert plain["server"].stats.snapshot()["peer_limited_total"] >= 70 - 16
    finally:
        for s in slow:
            s.close()


def test_auth_failure_reports_carry_a_truncated_path(plain: dict[str, Any]) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", plain["port"], timeout=5)
    long_path = "/v1/jobs/" + "x" * 60_000
    conn.request("GET", long_path, headers={"Authorization": "Bearer " + "z" * 40})
    status = conn.getresponse().status
    conn.close()
    assert status in (401, 414)
    if status == 401:
        assert plain["failures"] and len(plain["failures"][-1][1]) <= MAX_REPORTED_PATH
    # The report is bounded whatever path reaches the server.
    plain["server"].auth_failed("127.0.0.1:1", "/" + "y" * 10_000)
    assert len(plain["failures"][-1][1]) <= MAX_REPORTED_PATH


def test_many_concurrent_good_requests_from_one_peer_still_work(plain: dict[str, Any]) -> None:
    results: list[int] = []

    def one() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", plain["port"], timeout=10)
        conn.request("GET", "/v1/health")
        results.append(conn.getresponse().status)
        conn.close()

    threads = [threading.Thread(target=one) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(15)
    assert results == [200] * 8
