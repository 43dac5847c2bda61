"""docs/cluster.md, the operator's recipe, documents every ``[cluster]`` key the agent accepts."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from trainguard.agent.cluster.config import ClusterConfig

DOC = Path(__file__).resolve().parents[2] / "docs" / "cluster.md"


def test_cluster_doc_names_every_cluster_key_with_its_default() -> None:
    text = DOC.read_text()
    table = text.split("### Every `[cluster]` key", 1)[1].split("\n## ", 1)[0]
    documented = {k for row in re.findall(r"^\| `([^|]+)` \|", table, re.M) for k in re.findall(r"[a-z_]+", row)}
    missing = sorted(set(ClusterConfig.__dataclass_fields__) - documented)
    assert not missing, f"docs/cluster.md lacks [cluster] keys {missing}"
    for key in ("--cert-file", "--key-file", "--trusted-ca-file", "--client-cert-auth", "subjectAltName",
                "GLOO_SOCKET_IFNAME", "127.0.1.1"):
        assert key in text, key


def test_cluster_doc_certificate_recipe_gives_certificates_mutual_tls_accepts(tmp_path: Path) -> None:
    """The openssl recipe of docs/cluster.md, run as written: node-a's certificate serves its
    advertised IP address and the operator's certificate passes the agent's client check, while a
    name or address the certificate does not hold is refused."""
    import shutil
    import socket
    import ssl
    import subprocess
    import threading

    from trainguard.agent.api.tls import TlsFiles, client_context, server_context

    assert shutil.which("openssl") and shutil.which("bash"), "the recipe needs openssl and bash"
    text = DOC.read_text()
    recipe = re.search(r"```sh\n(mkdir -p pki && cd pki\n.*?)```", text, re.S)
    assert recipe, "no certificate recipe in docs/cluster.md"
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", recipe.group(1)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    pki = tmp_path / "pki"
    server = server_context(TlsFiles(str(pki / "node-a.pem"), str(pki / "node-a.key"), str(pki / "ca.pem"), True))
    client = client_context(TlsFiles(str(pki / "operator.pem"), str(pki / "operator.key"), str(pki / "ca.pem")))

    def handshake(server_name: str) -> str:
        with socket.create_server(("127.0.0.1", 0)) as listener:
            port = listener.getsockname()[1]
            seen: list[str] = []

            def serve() -> None:
                conn, _ = listener.accept()
                try:
                    with server.wrap_socket(conn, server_side=True) as tls:
                        peer: Any = tls.getpeercert() or {}
                        seen.extend(value for rdn in peer.get("subject", ()) for key, value in rdn
                                    if key == "commonName")
                except (ssl.SSLError, OSError):
                    pass

            thread = threading.Thread(target=serve, daemon=True)
            thread.start()
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=10) as raw, \
                        client.wrap_socket(raw, server_hostname=server_name) as tls:
                    tls.sendall(b"x")
            finally:
                thread.join(10)
            return seen[0] if seen else ""

    assert handshake("10.0.0.11") == "operator"  # the advertised address, and the caller's CN
    assert handshake("node-a") == "operator"
    for wrong in ("10.0.0.12", "node-b"):
        try:
            handshake(wrong)
        except ssl.SSLCertVerificationError:
            continue
        raise AssertionError(f"node-a's certificate passed for {wrong}")
