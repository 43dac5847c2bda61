"""Least privilege across nodes, done from outside as an attacker would: a holder that alters a
peer copy (and recomputes its checksums) or plants one, an etcd writer without the cluster key, a
job record naming "../../..", an upload that would fill the node's RAM, a cluster key file others
can read. Each time the harm must not happen and a counter or event must say what was refused."""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from trainguard.agent.api.client import ApiClient, ApiClientError
from trainguard.agent.api.config import ApiConfig
from trainguard.agent.api.server import ApiServer
from trainguard.agent.checkpoint.errors import CheckpointCorrupt, CheckpointError
from trainguard.agent.checkpoint.manifest import (
    MANIFEST_NAME,
    FileEntry,
    Manifest,
    read_manifest,
    write_manifest,
)
from trainguard.agent.checkpoint.memory import MemoryTier
from trainguard.agent.cluster.blobstore import CKPT_NS, BlobStore
from trainguard.agent.cluster.config import ClusterConfig
from trainguard.agent.cluster.etcd import EtcdClient, KeyValue
from trainguard.agent.cluster.gang import GangCoordinator
from trainguard.agent.cluster.jobs import JobRecordDoc, JobTable
from trainguard.agent.cluster.membership import NodeInfo
from trainguard.agent.cluster.peertier import PeerRef, PeerTier, fetch_remote_copy, token_client_factory
from trainguard.agent.cluster.signing import KeyFileError, load_key, sign_manifest, write_key
from trainguard.agent.control import AgentControl
from trainguard.agent.wire import part_key

KEY = secrets.token_hex(32).encode()
TOKEN = secrets.token_hex(16)


class Holder:
    """A node that holds copies: a real blob store behind a real TCP API."""

    def __init__(self, root: Path, name: str, **store: Any) -> None:
        self.name = name
        root.mkdir(parents=True)
        tokens = root / "tokens"
        tokens.write_text(TOKEN + "\n")
        os.chmod(tokens, 0o600)
        self.refused: list[tuple[str, str, int]] = []
        self.store = BlobStore(root / "held", key=KEY, on_refuse=lambda *a: self.refused.append(a), **store)
        self.server = ApiServer(ApiConfig(unix_socket=None, tcp="127.0.0.1:0", allow_plaintext=True, token_file=tokens),
                                AgentControl(SimpleNamespace(cluster=SimpleNamespace(store=self.store))))  # type: ignore[arg-type]
        self.server.start()
        self.api = f"127.0.0.1:{self.server.tcp_port}"

    def client(self) -> ApiClient:
        host, port = self.api.rsplit(":", 1)
        return ApiClient.remote(host, int(port), token=TOKEN, timeout=10)


@pytest.fixture
def holders(tmp_path: Path) -> Iterator[dict[str, Holder]]:
    made = {n: Holder(tmp_path / n, n) for n in ("h1", "h2")}
    yield made
    for h in made.values():
        h.server.stop()


def _origin_copy(tmp_path: Path, holders: dict[str, Holder], step: int = 7) -> Path:
    """Node a's memory checkpoint part, pushed by a's peer tier to both holders (signed by a)."""
    mem = MemoryTier(tmp_path / "a-shm")
    key = part_key("job", "a")
    staged = mem.stage(key, step)
    (staged / "__0_0.distcp").write_bytes(b"good weights " * 1000)
    (staged / ".metadata").write_bytes(b"meta")
    mem.commit(key, step, {"job": "job", "part": "a", "parts": ["a"]}, staged=staged)
    for h in holders.values():
        tier = PeerTier("a", BlobStore(tmp_path / "a-held"), lambda h=h: PeerRef(h.name, h.api),
                        token_client_factory(TOKEN, 10.0), key=KEY)
        tier.write_from(mem.step_path(key, step), key, step)
    return mem.step_path(key, step)


def _tamper(holder: Holder, step: int = 7, *, resign_with: bytes | None = None) -> None:
    """What a holder without the key can do: alter a file and recompute the manifest's sums."""
    path = holder.store.held("a").step_path(part_key("job", "a"), step)
    victim = path / "__0_0.distcp"
    victim.write_bytes(b"evil weights " * 1000)
    old = read_manifest(path)
    files = tuple(FileEntry(f.path, (path / f.path).stat().st_size,
                            hashlib.sha256((path / f.path).read_bytes()).hexdigest()) for f in old.files)
    forged = Manifest(old.job, old.step, old.created, "sha256", files, old.extra, old.signature)
    if resign_with is not None:
        forged = sign_manifest(resign_with, "a", forged)
    write_manifest(path, forged, durable=False)


def test_a_copy_altered_by_its_holder_is_refused_and_restore_uses_the_next_holder(
        tmp_path: Path, holders: dict[str, Holder]) -> None:
    _origin_copy(tmp_path, holders)
    _tamper(holders["h1"])
    # The holder's own verification is fooled (its checksums match); the restoring node is not.
    assert holders["h1"].store.held("a").verify(part_key("job", "a"), 7).ok is False  # signature, held side
    with pytest.raises(CheckpointCorrupt, match="bad signature"):
        fetch_remote_copy(holders["h1"].client(), "h1", "a", part_key("job", "a"), 7, tmp_path / "got", key=KEY)
    assert not (tmp_path / "got").exists()
    events: list[tuple[str, str, dict[str, Any]]] = []
    members = {n: NodeInfo(n, h.api, 1, 0.0) for n, h in holders.items()}
    gang = GangCoordinator("r", None, BlobStore(tmp_path / "r-held", own_node="r", key=KEY),  # type: ignore[arg-type]
                           token_client_factory(TOKEN, 10.0), scratch=str(tmp_path / "assembled"),
                           emit=lambda k, m, f: events.append((k, m, f)), is_leader=lambda: False,
                           members=lambda: members, wake=lambda: None)
    gang.cluster_key = KEY
    path, used = gang.assemble("job", 7, {"a": ["h1", "h2"]})
    assert used == {"a": "h2"}
    assert (path / "__0_0.distcp").read_bytes() == b"good weights " * 1000
    unusable = [f for k, _, f in events if k == "checkpoint_part_unusable"]
    assert [f["holder"] for f in unusable] == ["h1"]


def test_a_copy_signed_with_another_key_or_as_another_origin_is_refused(tmp_path: Path,
                                                                      holders: dict[str, Holder]) -> None:
    _origin_copy(tmp_path, holders)
    _tamper(holders["h1"], resign_with=secrets.token_hex(32).encode())
    with pytest.raises(CheckpointError):
        fetch_remote_copy(holders["h1"].client(), "h1", "a", part_key("job", "a"), 7, tmp_path / "x", key=KEY)
    # h2's good copy of a's checkpoint, presented as node c's (origin not bound), is refused too.
    src = holders["h2"].store.held("a").step_path(part_key("job", "a"), 7)
    dst = holders["h2"].store.held("c").step_path(part_key("job", "c"), 7)
    dst.parent.mkdir(parents=True)
    os.system(f"cp -r {src} {dst}")  # noqa: S605 - a local copy inside the test's own tree
    manifest = read_manifest(dst)
    write_manifest(dst, Manifest(part_key("job", "c"), 7, manifest.created, manifest.algorithm, manifest.files,
                                 manifest.extra, manifest.signature), durable=False)
    with pytest.raises(CheckpointCorrupt):
        fetch_remote_copy(holders["h2"].client(), "h2", "c", part_key("job", "c"), 7, tmp_path / "y", key=KEY)
    # Without a key nothing is restored at all.
    with pytest.raises(CheckpointError, match="no cluster key"):
        fetch_remote_copy(holders["h2"].client(), "h2", "a", part_key("job", "a"), 7, tmp_path / "z", key=b"")


def test_a_holder_refuses_to_commit_a_copy_without_its_origins_signature(holders: dict[str, Holder]) -> None:
    h = holders["h1"]
    client = h.client()
    client.put_blob(CKPT_NS, "a/job/step_3/f.bin", b"planted")
    unsigned = Manifest("job", 3, 1.0, "sha256", (FileEntry("f.bin", 7, hashlib.sha256(b"planted").hexdigest()),))
    with pytest.raises(ApiClientError) as err:
        client.put_blob(CKPT_NS, f"a/job/step_3/{MANIFEST_NAME}", unsigned.to_json())
    assert err.value.status == 422 and "not signed" in str(err.value)
    assert h.store.held("a").list("job") == []
    assert h.store.refused == 1 and h.refused[0][0] == "a"


# -- byte quotas ------------------------------------------------------------------------------------


def test_uploads_beyond_the_quotas_are_refused_before_they_fill_ram(tmp_path: Path) -> None:
    h = Holder(tmp_path / "q", "q", max_bytes=3000, max_origin_bytes=2000)
    try:
        client = h.client()
        with pytest.raises(ApiClientError) as err:  # larger than any quota can hold
            client.put_blob(CKPT_NS, "a/job/step_1/big", b"x" * 2500)
        assert err.value.status == 413
        client.put_blob(CKPT_NS, "a/job/step_1/one", b"x" * 1500)
        with pytest.raises(ApiClientError) as err:  # a's quota is full
            client.put_blob(CKPT_NS, "a/job/step_1/two", b"x" * 1000)
        assert err.value.status == 507 and "quota 2000" in str(err.value)
        client.put_blob(CKPT_NS, "b/job/step_1/one", b"x" * 1000)  # another origin still fits
        with pytest.raises(ApiClientError) as err:  # ... until the total is reached
            client.put_blob(CKPT_NS, "c/job/step_1/one", b"x" * 1000)
        assert err.value.status == 507
        assert h.store.held_bytes() <= 3000
        assert [r[0] for r in h.refused] == ["a", "a", "c"] and h.store.refused == 3
    finally:
        h.server.stop()


def test_an_upload_that_would_leave_too_little_free_space_is_refused(tmp_path: Path) -> None:
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    h = Holder(tmp_path / "f", "f", min_free_bytes=free + (1 << 30))
    try:
        with pytest.raises(ApiClientError) as err:
            h.client().put_blob(CKPT_NS, "a/job/step_1/f", b"x" * 10)
        assert err.value.status == 507 and "free" in str(err.value)
        assert not list((tmp_path / "f" / "held").rglob("f"))
    finally:
        h.server.stop()


def test_blob_quota_defaults_follow_the_filesystem(tmp_path: Path) -> None:
    total, per_origin, min_free = ClusterConfig().blob_quotas(str(tmp_path / "not" / "yet"))
    st = os.statvfs(tmp_path)
    assert total == st.f_blocks * st.f_frsize // 2 and per_origin == total // 2 and 0 < min_free <= 1 << 30
    assert ClusterConfig(blob_max_bytes=10, blob_max_bytes_per_origin=4, blob_min_free_bytes=1).blob_quotas("/") == (10, 4, 1)
    with pytest.raises(ValueError, match=r"^cluster\.blob_max_bytes"):
        ClusterConfig(blob_max_bytes=-1)


# -- job records ------------------------------------------------------------------------------------


class FakeEtcd:
    """The records an etcd writer put under the jobs prefix (as get_prefix returns them)."""

    def __init__(self) -> None:
        self.kvs: dict[str, tuple[bytes, int]] = {}
        self.rev = 0

    def put(self, key: str, value: bytes, lease: int = 0) -> int:
        self.rev += 1
        self.kvs[key] = (value, self.rev)
        return self.rev

    def replace(self, key: str, value: bytes, mod_revision: int) -> bool:
        current = self.kvs.get(key)
        if (current[1] if current else 0) != mod_revision:
            return False
        self.put(key, value)
        return True

    def get_prefix(self, prefix: str) -> tuple[list[KeyValue], int]:
        return [KeyValue(k, v, 0, r, r) for k, (v, r) in self.kvs.items() if k.startswith(prefix)], self.rev


def _spec(job: str) -> dict[str, Any]:
    return {"job": job, "nproc": 1, "command": ["/bin/sh", "-c", "id > /tmp/pwned"]}


def test_only_signed_valid_job_records_are_used(tmp_path: Path) -> None:
    etcd = FakeEtcd()
    drops: list[tuple[str, int, str]] = []
    table = JobTable(etcd, "/trainguard/c/", key=KEY, on_drop=lambda *a: drops.append(a))  # type: ignore[arg-type]
    assert table.write(JobRecordDoc("good", _spec("good"), "n1"), None)
    prefix = "/trainguard/c/jobs/"
    # An etcd writer without the key: an unsigned record, one signed with a guessed key, one altered.
    etcd.put(prefix + "evil", JobRecordDoc("evil", _spec("evil"), "n1").to_json())
    etcd.put(prefix + "guess", JobRecordDoc("guess", _spec("guess"), "n1").to_json(b"x" * 64))
    altered = json.loads(etcd.kvs[prefix + "good"][0])
    altered["spec"]["command"] = ["/bin/sh", "-c", "id > /tmp/pwned"]
    etcd.put(prefix + "good2", json.dumps({**altered, "job": "good2"}).encode())
    # Signed by an agent's key but naming a path: validated before any path is built.
    etcd.put(prefix + "../../..", JobRecordDoc("../../..", _spec("../../.."), "n1").to_json(KEY))
    etcd.put(prefix + "mismatch", JobRecordDoc("mismatch", _spec("other"), "n1").to_json(KEY))
    etcd.put(prefix + "huge", b"{" + b" " * (2 << 20) + b"}")
    etcd.put(prefix + "garbage", b"\xff\xfe not json")
    records = table.read()
    assert set(records) == {"good"}
    reasons = {key.rsplit("/", 1)[-1]: why for key, _, why in drops}
    assert set(reasons) == {"evil", "guess", "good2", "..", "mismatch", "huge", "garbage"}
    assert "not signed" in reasons["evil"] and "bad signature" in reasons["guess"]
    assert "bad signature" in reasons["good2"] and "bad job id" in reasons[".."]
    # Once per revision: reading again reports nothing new; a new revision is reported again.
    table.read()
    assert table.drops.dropped == len(drops) == 7
    etcd.put(prefix + "evil", JobRecordDoc("evil", _spec("evil"), "n2").to_json())
    table.read()
    assert table.drops.dropped == 8


def test_a_forged_record_does_not_block_the_real_owner_from_writing(tmp_path: Path) -> None:
    etcd = FakeEtcd()
    table = JobTable(etcd, "/trainguard/c/", key=KEY)  # type: ignore[arg-type]
    etcd.put("/trainguard/c/jobs/real", JobRecordDoc("real", _spec("real"), "evil-node").to_json())
    assert table.read() == {} and table.drops.dropped == 1
    assert table.write(JobRecordDoc("real", {"job": "real", "nproc": 1}, "n1"), 0)  # "absent" as far as it knows
    assert table.read()["real"][0].node == "n1"
    assert not table.write(JobRecordDoc("real", {"job": "real", "nproc": 1}, "n2"), 0)  # a real record: CAS holds


def test_a_path_job_id_never_reaches_the_filesystem_through_a_gang(tmp_path: Path) -> None:
    """The assembled-checkpoint scratch dir is built from record ids: a record naming "../../.." is
    dropped before the gang code sees it, so nothing outside scratch is touched."""
    etcd = FakeEtcd()
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep").write_text("data")
    table = JobTable(etcd, "/trainguard/c/", key=KEY)  # type: ignore[arg-type]
    rec = JobRecordDoc("../../victim", _spec("../../victim"), "n1", gang={"attempt": 1})
    etcd.put("/trainguard/c/jobs/../../victim", rec.to_json(KEY))
    gang = GangCoordinator("n1", table, BlobStore(tmp_path / "held", key=KEY), token_client_factory(TOKEN, 1.0),
                           scratch=str(tmp_path / "scratch" / "x"), emit=lambda *a: None, is_leader=lambda: True,
                           members=lambda: {}, wake=lambda: None)
    gang.sync(table.read())
    assert (victim / "keep").read_text() == "data" and table.drops.dropped == 1


# -- configuration --------------------------------------------------------------------------------


def test_etcd_in_plaintext_needs_the_explicit_opt_in(tmp_path: Path) -> None:
    key = write_key(str(tmp_path / "k"))
    with pytest.raises(ValueError, match=r"^cluster\.etcd_ca: required with etcd_endpoints"):
        ClusterConfig(etcd_endpoints=["127.0.0.1:2379"], key_file=key)
    with pytest.raises(ValueError, match=r"^cluster\.etcd_cert"):
        ClusterConfig(etcd_endpoints=["127.0.0.1:2379"], key_file=key, etcd_ca="/ca.pem")
    assert ClusterConfig(etcd_endpoints=["127.0.0.1:2379"], key_file=key, etcd_plaintext=True)
    with pytest.raises(ValueError, match=r"^cluster\.etcd_ca"):
        EtcdClient(["127.0.0.1:2379"])
    from trainguard.agent.config import ConfigError, config_from_dict

    with pytest.raises(ConfigError) as err:
        config_from_dict({"cluster": {"etcd_endpoints": ["10.0.0.5:2379"], "key_file": key}})
    assert err.value.key == "cluster.etcd_ca"


def test_the_cluster_key_file_must_be_private(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"^cluster\.key_file: required"):
        ClusterConfig(etcd_endpoints=["127.0.0.1:2379"], etcd_plaintext=True)
    key = Path(write_key(str(tmp_path / "k")))
    assert len(load_key(str(key))) == 64
    for mode in (0o640, 0o604, 0o660):
        os.chmod(key, mode)
        with pytest.raises(KeyFileError, match=r"^cluster\.key_file: .* group or others"):
            ClusterConfig(etcd_endpoints=["127.0.0.1:2379"], etcd_plaintext=True, key_file=str(key))
    os.chmod(key, 0o600)
    os.symlink(key, tmp_path / "link")
    with pytest.raises(KeyFileError, match="symlink"):
        load_key(str(tmp_path / "link"))
    short = tmp_path / "short"
    short.write_text("abc")
    os.chmod(short, 0o600)
    with pytest.raises(KeyFileError, match="fewer than 32"):
        load_key(str(short))
    if os.geteuid() == 0:
        os.chown(key, 1234, -1)
        with pytest.raises(KeyFileError, match="owned by uid 1234"):
            load_key(str(key))


def test_plaintext_etcd_warns_at_start_and_refusals_are_metrics(tmp_path: Path) -> None:
    from trainguard.agent.cluster.service import ClusterService

    events: list[tuple[str, str, dict[str, Any]]] = []
    cfg = ClusterConfig(etcd_endpoints=["127.0.0.1:9"], etcd_plaintext=True, key_file=write_key(str(tmp_path / "k")),
                        blob_root=str(tmp_path / "held"))
    svc = ClusterService(cfg, node="n1", memory_root=str(tmp_path / "shm"), emit=lambda k, m, f: events.append((k, m, f)))
    assert [k for k, _, _ in events] == ["etcd_plaintext"]
    assert svc.store.key == svc.key == load_key(cfg.key_file) and svc.jobs is not None and svc.jobs.key == svc.key
    assert svc.store.max_bytes > 0 and 0 < svc.store.max_origin_bytes <= svc.store.max_bytes
    samples = {m.name: m.samples[0].value for m in svc.metrics()}
    assert samples["trainguard_cluster_job_records_refused"] == 0
    assert samples["trainguard_cluster_peer_uploads_refused"] == 0


# -- lineage commit records -------------------------------------------------------------------------


def test_only_signed_commit_records_count_so_a_forged_newer_step_makes_nobody_wait() -> None:
    from trainguard.agent.cluster.lineage import CommitRecord, CommitTable, newer_elsewhere

    etcd = FakeEtcd()
    drops: list[tuple[str, int, str]] = []
    table = CommitTable(etcd, "/trainguard/c/", key=KEY, on_drop=lambda *a: drops.append(a))  # type: ignore[arg-type]
    table.write("big", CommitRecord("a", 12, 1, ("a", "b"), 1.0))
    table.write("big", CommitRecord("b", 12, 1, ("a", "b"), 1.0))
    prefix = "/trainguard/c/commits/big/"
    assert json.loads(etcd.kvs[prefix + "a"][0])["sig"]
    # An etcd writer without the key claims both nodes committed step 99: unsigned, guessed key.
    etcd.put(prefix + "a", CommitRecord("a", 99, 1, ("a", "b")).to_json())
    etcd.put(prefix + "b", CommitRecord("b", 99, 1, ("a", "b")).to_json("big", b"x" * 64))
    # A genuine signed record replayed under another node's key, and another job's key.
    etcd.put(prefix + "c", etcd.kvs["/trainguard/c/commits/big/b"][0])
    signed_for_other_job = CommitRecord("d", 99, 1, ("d",)).to_json("small", KEY)
    etcd.put(prefix + "d", signed_for_other_job)
    etcd.put(prefix + "e", b"\xff not json")
    etcd.put(prefix + "f", b"[" * 70_000)
    # Signed by an agent's key but naming a path as a part: validated, not trusted.
    etcd.put(prefix + "g", CommitRecord("g", 99, 1, ("g", "../..")).to_json("big", KEY))
    records = table.read("big")
    assert records == {}
    reasons = {key.rsplit("/", 1)[-1]: why for key, _, why in drops}
    assert set(reasons) == {"a", "b", "c", "d", "e", "f", "g"} and "parts" in reasons["g"]
    assert "not signed" in reasons["a"] and all("bad signature" in reasons[n] for n in "bcd")
    assert newer_elsewhere(10, records, reachable={"a"}) is None  # nothing to wait for
    table.read("big")
    assert table.drops.dropped == 7  # once per revision
    table.write("big", CommitRecord("a", 14, 2, ("a",), 2.0))
    assert table.read("big")["a"].step == 14
    # Without a key (a cluster of one) records are read as before; a signed one is still parsed.
    plain = CommitTable(etcd, "/trainguard/c/")  # type: ignore[arg-type]
    assert plain.read("big")["a"].step == 14
