"""docs/cluster.md, the operator's recipe, documents every ``[cluster]`` key the agent accepts."""

from __future__ import annotations

import re
from pathlib import Path

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
