"""TLS on the cross-node API, with real certificates made by trustme: the handshake, a client that
trusts another CA, a missing or foreign client certificate under mutual TLS, plain HTTP to a TLS
port, blob uploads over TLS; the config refusing plain TCP unless asked; two real agents whose peer
checkpoint copies travel over mutual TLS."""

from __future__ import annotations

import http.client
import os
import secrets
import ssl
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.api import ADMIN, FakeDaemon, token_file
from tests.helpers.pki import Pki
from tests.helpers.waiting import wait_for
from trainguard.agent.api.client import ApiClient, ApiClientError
from trainguard.agent.api.config import ApiConfig
from trainguard.agent.api.server import ApiServer
from trainguard.agent.api.tls import TlsConfigError, TlsFiles, client_context, server_context
from trainguard.agent.config import ConfigError, config_from_dict


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return Pki(tmp_path)


@pytest.fixture
def tls_server(tmp_path: Path, pki: Pki) -> Iterator[dict[str, Any]]:
    failures: list[tuple[str, str]] = []
    tokens = token_file(tmp_path / "tokens", f"{ADMIN}\n")
    files = pki.node("server")
    cfg = ApiConfig(unix_socket=None, tcp="127.0.0.1:0", token_file=tokens, tls=server_context(files),
                    handshake_timeout_s=2.0)
    server = ApiServer(cfg, FakeDaemon(tmp_path / "blobs"), on_auth_failure=lambda r, p: failures.append((r, p)))
    server.start()
    assert server.tcp_address is not None
    host, port = server.tcp_address
    yield {"server": server, "host": host, "port": port, "failures": failures}
    server.stop()


def _client(env: dict[str, Any], files: TlsFiles | None) -> ApiClient:
    return ApiClient.remote(env["host"], env["port"], token=ADMIN, timeout=5,
                            tls=client_context(files) if files is not None else None)


def _refused(env: dict[str, Any], before: int, timeout: float = 10.0) -> None:
    wait_for(lambda: env["server"].stats.snapshot()["tls_refused_total"] > before, timeout,
             "the server to count the refused handshake", interval=0.02)


def test_mutual_tls_handshake_and_a_blob_over_it(tls_server: dict[str, Any], pki: Pki) -> None:
    client = _client(tls_server, pki.node("peer"))
    assert client.health()["node"] == "n1"
    data = os.urandom(3 << 20)  # several TLS records, no 100-continue over TLS
    assert client.put_blob("ckpt", "peer/step_1/shard", data)["size"] == len(data)
    assert client.get_blob("ckpt", "peer/step_1/shard") == data
    assert tls_server["server"].stats.snapshot()["tls_refused_total"] == 0


def test_a_server_from_another_ca_is_not_trusted(tls_server: dict[str, Any], pki: Pki) -> None:
    files = pki.node("peer")
    distrusting = TlsFiles(files.cert, files.key, pki.other_ca_file)
    with pytest.raises(ApiClientError) as err:
        _client(tls_server, distrusting).health()
    assert err.value.status == 0 and "not trusted" in str(err.value), err.value


@pytest.mark.parametrize("who", ["no_client_cert", "stranger_cert"])
def test_mutual_tls_refuses_a_client_without_a_cluster_certificate(tls_server: dict[str, Any], pki: Pki,
                                                                   who: str) -> None:
    stranger = pki.node("intruder", pki.other_ca)
    files = TlsFiles(ca=pki.ca_file) if who == "no_client_cert" else TlsFiles(stranger.cert, stranger.key, pki.ca_file)
    before = tls_server["server"].stats.snapshot()["tls_refused_total"]
    with pytest.raises(ApiClientError) as err:
        _client(tls_server, files).health()
    assert err.value.status == 0
    _refused(tls_server, before)
    assert any("TLS handshake" in path for _, path in tls_server["failures"])


def test_plain_http_to_the_tls_port_gets_nothing(tls_server: dict[str, Any]) -> None:
    before = tls_server["server"].stats.snapshot()["tls_refused_total"]
    conn = http.client.HTTPConnection(tls_server["host"], tls_server["port"], timeout=5)
    with pytest.raises((http.client.HTTPException, OSError)):
        conn.request("GET", "/v1/health", headers={"Authorization": f"Bearer {ADMIN}"})
        conn.getresponse().read()
    conn.close()
    _refused(tls_server, before)


def test_the_config_refuses_plain_tcp_unless_asked_and_names_bad_files(tmp_path: Path, pki: Pki) -> None:
    with pytest.raises(ConfigError) as err:
        config_from_dict({"api": {"tcp": "0.0.0.0:9479", "token_file": "/t"}})
    assert err.value.key == "api.tls_cert" and "allow_plaintext" in str(err.value)
    assert config_from_dict({"api": {"tcp": "127.0.0.1:9479", "token_file": "/t", "allow_plaintext": True}})
    with pytest.raises(ConfigError) as err:
        config_from_dict({"api": {"tcp": "0.0.0.0:9479", "token_file": "/t", "tls_cert": "/c", "tls_client_auth": True}})
    assert err.value.key == "api.tls_ca"
    with pytest.raises(TlsConfigError, match="api.tls_cert: no such file"):
        server_context(TlsFiles(cert=str(tmp_path / "missing.pem")))
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate")
    with pytest.raises(TlsConfigError, match="api.tls_cert: cannot load"):
        server_context(TlsFiles(cert=str(garbage)))


@pytest.mark.slow
def test_two_agents_and_etcd_all_over_mutual_tls(tmp_path: Path, pki: Pki) -> None:
    from bench.trainjobs import tiny_config
    from trainguard.agent.cluster.demo import ClusterNode, wait_for
    from trainguard.agent.cluster.etcd import EtcdClient
    from trainguard.agent.cluster.etcdserver import LocalEtcd

    server = pki.node("etcd")
    probe = pki.node("probe")
    etcd = LocalEtcd(tmp_path / "etcd", size=1, tls=(server.cert, server.key, pki.ca_file),
                     client_tls=(probe.cert, probe.key)).start()
    token = secrets.token_hex(16)
    nodes: list[ClusterNode] = []
    try:
        # etcd refuses a client without a certificate, and plain HTTP.
        with pytest.raises(Exception):  # noqa: B017,PT011 - etcd3gw/requests raise their own kinds
            EtcdClient(etcd.endpoints, timeout_s=1.0, ca=pki.ca_file).put("/x", "1")
        with pytest.raises(Exception):  # noqa: B017,PT011
            EtcdClient(etcd.endpoints, timeout_s=1.0, plaintext=True).put("/x", "1")
        for name in ("a", "b"):
            nodes.append(ClusterNode(tmp_path / name, name, etcd.endpoints, token, cluster=f"tls{os.getpid()}",
                                     slots=2, tls=pki.node(name), etcd_tls=True))
        a, b = nodes
        wait_for(lambda: a.metric("trainguard_cluster_members") == 2, 30, "both agents registered")
        trainer = tiny_config(str(tmp_path / "corpus"), steps=400, parallel={"dp": 1}).to_dict()
        a.client.submit_job({"job": "tls", "nproc": 1, "trainer": trainer})
        # The peer copy is a blob PUT from a to b's TLS API, with a's client certificate.
        wait_for(lambda: max(b.held_steps("a", "tls") or [0]) >= 8, 120, f"a peer copy on b\n{a.log()[-3000:]}")
        assert not [e for e in a.events("checkpoint_write_failed") if e["fields"].get("tier") == "peer"]
        # Node c of the same CA, with the admin token, cannot plant or delete a's copies on b.
        host_b, port_b = b.api.rsplit(":", 1)
        intruder = ApiClient.remote(host_b, int(port_b), token=token, timeout=5, tls=client_context(pki.node("c")))
        held = max(b.held_steps("a", "tls"))
        for attempt in (lambda: intruder.put_blob("ckpt", "a/tls/step_999999/__0_0.distcp", b"poison"),
                        lambda: intruder.delete_blob("ckpt", f"a/tls/step_{held}")):
            with pytest.raises(ApiClientError) as refused:
                attempt()
            assert refused.value.status == 403
        assert 999999 not in b.held_steps("a", "tls")  # (a itself prunes its older copies meanwhile)
        assert len(wait_for(lambda: b.events("api_node_refused"), 10, "refusal events")) == 2
        # Plain HTTP to the agent's TLS port is refused; so is a client with no certificate.
        host, port = a.api.rsplit(":", 1)
        with pytest.raises(ApiClientError):
            ApiClient.remote(host, int(port), token=token, timeout=5).health()
        with pytest.raises(ApiClientError):
            ApiClient.remote(host, int(port), token=token, timeout=5,
                             tls=client_context(TlsFiles(ca=pki.ca_file))).health()
        assert a.client.health()
    finally:
        for n in nodes:
            n.stop()
        etcd.stop()


def test_ssl_minimum_version_is_tls_1_2(pki: Pki) -> None:
    files = pki.node("v")
    assert server_context(files).minimum_version == ssl.TLSVersion.TLSv1_2
    assert client_context(files).minimum_version == ssl.TLSVersion.TLSv1_2


def test_the_cli_talks_to_a_tls_agent_with_its_flags_and_refuses_without(tmp_path: Path, pki: Pki,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    from tests.conftest import start_agent
    from trainguard.cli import main

    node = pki.node("agent")
    client_cert = pki.node("operator")
    tokens = token_file(tmp_path / "tokens", f"{ADMIN}\n")
    config = (f'[api]\ntcp = "127.0.0.1:0"\ntoken_file = "{tokens}"\ntls_cert = "{node.cert}"\n'
              f'tls_key = "{node.key}"\ntls_ca = "{node.ca}"\ntls_client_auth = true\n'
              '[collectors]\nebpf = false\ngpu = false\n')
    agent = start_agent(tmp_path / "agent", config=config)
    try:
        addr = tmp_path / "agent" / "run" / "api.addr"
        deadline = time.monotonic() + 30
        while not (addr.exists() and addr.read_text().strip()) and time.monotonic() < deadline:
            time.sleep(0.1)
        target = ["--agent", addr.read_text().strip(), "--token-file", str(tokens), "--json"]
        flags = ["--tls-ca", pki.ca_file, "--tls-cert", client_cert.cert, "--tls-key", client_cert.key]
        assert main(["status", *target, *flags]) == 0
        assert '"node"' in capsys.readouterr().out
        assert main(["status", *target]) == 1  # plain HTTP to a TLS port: one line, no traceback
        assert "lost the connection" in capsys.readouterr().err
        assert main(["status", *target, "--tls-ca", str(tmp_path / "nope.pem")]) == 1
        assert "--tls-ca: no such file" in capsys.readouterr().err
    finally:
        agent.stop()
