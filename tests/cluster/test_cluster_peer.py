"""Peer tier over the real blob API (TCP, bearer tokens): round trip, receiver-side checksum
verification, corrupt peer copy -> the next tier, held copies after a node loss, wrong token."""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from trainguard.agent.api.client import ApiClient, ApiClientError
from trainguard.agent.api.config import ApiConfig
from trainguard.agent.api.server import ApiServer
from trainguard.agent.checkpoint import CheckpointManager, CheckpointSettings
from trainguard.agent.checkpoint.errors import CheckpointCorrupt, CheckpointWriteError
from trainguard.agent.checkpoint.manifest import MANIFEST_NAME, Manifest
from trainguard.agent.cluster.blobstore import CKPT_NS, BlobStore
from trainguard.agent.cluster.peertier import PeerRef, PeerTier, ring_peer, token_client_factory
from trainguard.agent.cluster.signing import sign_manifest
from trainguard.agent.control import AgentControl

KEY = secrets.token_hex(32).encode()  # the cluster key every simulated node holds


class Node:
    """One simulated node: a blob store behind a real TCP API server with a token file."""

    def __init__(self, root: Path, name: str, token: str) -> None:
        self.name = name
        self.root = root
        root.mkdir(parents=True)
        token_file = root / "tokens"
        token_file.write_text(token + "\n")
        os.chmod(token_file, 0o600)
        self.store = BlobStore(root / "shm" / ".peer-held", key=KEY)
        self.server = ApiServer(ApiConfig(unix_socket=None, tcp="127.0.0.1:0", allow_plaintext=True, token_file=token_file),
                                AgentControl(SimpleNamespace(cluster=SimpleNamespace(store=self.store))))  # type: ignore[arg-type]
        self.server.start()
        port = self.server.tcp_port
        assert port is not None
        self.api = f"127.0.0.1:{port}"

    def manager(self, peer: Node | None, token: str, disk: bool = True) -> CheckpointManager:
        ref = PeerRef(peer.name, peer.api) if peer else None
        self.peer_tier = PeerTier(self.name, self.store, lambda: ref, token_client_factory(token, 10.0), key=KEY)
        settings = CheckpointSettings(memory_root=str(self.root / "shm"), memory_keep=2,
                                      disk_dir=str(self.root / "disk") if disk else "", disk_interval=1)
        return CheckpointManager(settings, extra_tiers=[self.peer_tier], extra_intervals={"peer": 1},
                                 extra_keep={"peer": 2})


@pytest.fixture
def token() -> str:
    return secrets.token_hex(16)


@pytest.fixture
def nodes(tmp_path: Path, token: str) -> Iterator[dict[str, Node]]:
    made = {n: Node(tmp_path / n, n, token) for n in ("a", "b")}
    yield made
    for n in made.values():
        n.server.stop()


def save(mgr: CheckpointManager, job: str, step: int, payload: bytes) -> None:
    stage = mgr.stage(job, step)
    (stage / "__0_0.distcp").write_bytes(payload)
    (stage / "sub").mkdir()
    (stage / "sub" / ".metadata").write_bytes(b"meta-" + str(step).encode())
    mgr.commit(job, step)


def test_round_trip_and_fetch_back_after_memory_loss(nodes: dict[str, Node], token: str, tmp_path: Path) -> None:
    a, b = nodes["a"], nodes["b"]
    mgr = a.manager(b, token, disk=False)
    mgr.start()
    try:
        payload = os.urandom(3 << 20)
        save(mgr, "job1", 10, payload)
        assert mgr.replicator.wait_idle(20)
        held = b.store.held("a")
        assert [i.step for i in held.list("job1")] == [10]
        assert held.verify("job1", 10).ok
        assert (held.step_path("job1", 10) / "__0_0.distcp").read_bytes() == payload
        assert [i.step for i in a.peer_tier.list("job1")] == [10]
        assert a.peer_tier.verify("job1", 10).ok  # verified on b's side
        # retention at the peer: keep 2
        for step in (20, 30):  # one at a time: the replicator coalesces queued steps
            save(mgr, "job1", step, os.urandom(1000))
            assert mgr.replicator.wait_idle(20)
        assert [i.step for i in held.list("job1")] == [20, 30]

        # a's RAM is gone (reboot): restore fetches its own copy back from b, checksummed
        for info in mgr.memory.list("job1"):
            mgr.memory.delete("job1", info.step)
        restored = mgr.restore("job1")
        assert restored is not None and restored.tier == "peer" and restored.info.step == 30 and restored.fetched
        assert (restored.path / "sub" / ".metadata").read_bytes() == b"meta-30"
        assert Manifest.from_json((restored.path / MANIFEST_NAME).read_bytes()).step == 30
        restored.release()
    finally:
        mgr.stop(5)


def test_corrupt_peer_copy_falls_back_to_disk(nodes: dict[str, Node], token: str) -> None:
    a, b = nodes["a"], nodes["b"]
    events: list[tuple[str, dict[str, object]]] = []
    mgr = a.manager(b, token, disk=True)
    mgr.emit = lambda kind, fields: events.append((kind, fields))
    mgr.replicator.emit = mgr.emit
    mgr.start()
    try:
        save(mgr, "job2", 5, os.urandom(1 << 20))
        assert mgr.replicator.wait_idle(20)
        # flip one byte of b's copy; a's memory copy is lost
        victim = b.store.held("a").step_path("job2", 5) / "__0_0.distcp"
        data = bytearray(victim.read_bytes())
        data[1234] ^= 0xFF
        victim.write_bytes(bytes(data))
        mgr.memory.delete("job2", 5)
        restored = mgr.restore("job2")
        assert restored is not None and restored.tier == "disk" and restored.info.step == 5
        corrupt = [f for k, f in events if k == "checkpoint_corrupt"]
        assert corrupt and corrupt[0]["tier"] == "peer"
        assert any("__0_0.distcp" in p for p in corrupt[0]["problems"])  # type: ignore[union-attr]
        restored.release()
    finally:
        mgr.stop(5)


def test_held_copy_restores_in_place_on_the_survivor(nodes: dict[str, Node], token: str) -> None:
    """a pushes to b, a dies: b restores a's job from the copy in its own RAM (no transfer)."""
    a, b = nodes["a"], nodes["b"]
    mgr_a = a.manager(b, token, disk=False)
    mgr_a.start()
    payload = os.urandom(1 << 20)
    try:
        save(mgr_a, "job3", 40, payload)
        assert mgr_a.replicator.wait_idle(20)
    finally:
        mgr_a.stop(5)
    a.server.stop()  # node a is gone
    mgr_b = b.manager(None, token, disk=False)  # b has no peer left
    restored = mgr_b.restore("job3")
    assert restored is not None and restored.tier == "peer" and not restored.fetched
    assert (restored.path / "__0_0.distcp").read_bytes() == payload
    restored.release()


def test_receiver_rejects_upload_that_does_not_match_manifest(nodes: dict[str, Node], token: str) -> None:
    b = nodes["b"]
    client = ApiClient.remote("127.0.0.1", int(b.api.rsplit(":", 1)[1]), token=token)
    client.put_blob(CKPT_NS, "x/j/step_1/f.bin", b"hello world")
    good = Manifest("j", 1, 1.0, "crc32", (), {})
    from trainguard.agent.checkpoint.manifest import FileEntry, file_checksum

    tmp = b.root / "f.bin"
    tmp.write_bytes(b"hello WORLD")  # what the sender thinks it sent
    size, digest = file_checksum(tmp)
    bad = sign_manifest(KEY, "x", Manifest("j", 1, 1.0, "crc32", (FileEntry("f.bin", size, digest),), {}))
    with pytest.raises(ApiClientError) as err:
        client.put_blob(CKPT_NS, f"x/j/step_1/{MANIFEST_NAME}", bad.to_json())
    assert err.value.status == 422 and "checksum" in str(err.value)
    assert b.store.held("x").list("j") == []  # nothing committed, staging removed
    assert good.files == ()
    # path tricks are refused before touching the disk
    for path in ("x/j/step_1/a/../../../f", "x/../j/step_1/f", "x/j/notastep/f", "../x/j/step_1/f"):
        with pytest.raises(ApiClientError) as err2:
            client.put_blob(CKPT_NS, path, b"x")
        assert err2.value.status == 400


def test_source_corruption_is_not_copied_on(nodes: dict[str, Node], token: str) -> None:
    a, b = nodes["a"], nodes["b"]
    mgr = a.manager(b, token, disk=False)
    save(mgr, "job4", 7, os.urandom(1 << 16))
    path = mgr.memory.step_path("job4", 7) / "__0_0.distcp"
    data = bytearray(path.read_bytes())
    data[0] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorrupt):
        a.peer_tier.write_from(mgr.memory.step_path("job4", 7), "job4", 7)
    assert b.store.held("a").list("job4") == []


def test_wrong_token_is_refused(nodes: dict[str, Node], token: str) -> None:
    a, b = nodes["a"], nodes["b"]
    wrong = PeerTier("a", a.store, lambda: PeerRef("b", b.api), token_client_factory("f" * 32, 5.0))
    src = a.root / "src"
    src.mkdir()
    (src / "f").write_bytes(b"data")
    from trainguard.agent.checkpoint.manifest import build_manifest, write_manifest

    write_manifest(src, build_manifest(src, "job5", 1), durable=False)
    with pytest.raises(CheckpointWriteError, match="401|403|token"):
        wrong.write_from(src, "job5", 1)
    assert not (b.store.ckpt_root() / "a").exists()
    client = ApiClient.remote("127.0.0.1", int(b.api.rsplit(":", 1)[1]), token=None)
    with pytest.raises(ApiClientError) as err:
        client.get_blob(CKPT_NS, "_origins")
    assert err.value.status == 401


def test_ring_placement() -> None:
    members = {"n1": "h:1", "n2": "h:2", "n3": "h:3"}
    assert ring_peer("n1", members) == PeerRef("n2", "h:2")
    assert ring_peer("n3", members) == PeerRef("n1", "h:1")
    assert ring_peer("n2", members, configured="n1") == PeerRef("n1", "h:1")
    assert ring_peer("n2", members, configured="gone") is None
    assert ring_peer("n1", {"n1": "h:1"}) is None


def test_copies_of_departed_nodes_are_dropped_after_retention(nodes: dict[str, Node], token: str) -> None:
    a, b = nodes["a"], nodes["b"]
    mgr = a.manager(b, token, disk=False)
    save(mgr, "job6", 3, b"x" * 100)
    a.peer_tier.write_from(mgr.memory.step_path("job6", 3), "job6", 3)
    import time

    now = time.time()
    assert b.store.drop_stale({"a"}, 0.0, now + 10) == []  # a is still a member: kept
    assert b.store.drop_stale(set(), 3600.0, now) == []  # departed, but copied just now: kept
    assert b.store.held_bytes() > 0
    assert b.store.drop_stale(set(), 3600.0, now + 3601) == ["a"]
    assert b.store.origins() == [] and b.store.held_bytes() == 0
