"""Real certificates made by trustme: a cluster CA with loopback certificates, and a stranger's CA."""

from __future__ import annotations

import os
from pathlib import Path

import trustme

from trainguard.agent.api.tls import TlsFiles


class Pki:
    """A cluster CA with certificates for loopback, and a stranger's CA."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.ca = trustme.CA(organization_name="cluster")
        self.other_ca = trustme.CA(organization_name="stranger")
        self.ca_file = self._write("ca.pem", self.ca.cert_pem.bytes())
        self.other_ca_file = self._write("other-ca.pem", self.other_ca.cert_pem.bytes())

    def _write(self, name: str, data: bytes) -> str:
        path = self.root / name
        path.write_bytes(data)
        return str(path)

    def node(self, name: str, ca: trustme.CA | None = None) -> TlsFiles:
        """A certificate for 127.0.0.1 (server and client use) signed by ``ca`` (the cluster's)."""
        cert = (ca or self.ca).issue_cert("127.0.0.1", "localhost", common_name=name)
        chain = self._write(f"{name}.pem", b"".join(blob.bytes() for blob in cert.cert_chain_pems))
        key = self._write(f"{name}.key", cert.private_key_pem.bytes())
        os.chmod(key, 0o600)
        return TlsFiles(cert=chain, key=key, ca=self.ca_file, client_auth=True)
