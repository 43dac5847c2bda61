"""Object tier against a real moto S3 server on 127.0.0.1 (free port) and against file://:
manifest-last commit, verified fetch, corruption, traversal in a crafted manifest, prune."""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from trainguard.agent.checkpoint.errors import CheckpointCorrupt, CheckpointWriteError, UnsafePathError
from trainguard.agent.checkpoint.manifest import MANIFEST_NAME, build_manifest, write_manifest
from trainguard.agent.checkpoint.objectstore import ObjectScope, ObjectStoreConfig, ObjectTier, StaleEpoch


def fake_dcp(d: Path, ranks: int = 2, size: int = 30_000) -> dict[str, bytes]:
    d.mkdir(parents=True, exist_ok=True)
    files = {".metadata": os.urandom(200)} | {f"__{r}_0.distcp": os.urandom(size + r) for r in range(ranks)}
    for name, data in files.items():
        (d / name).write_bytes(data)
    write_manifest(d, build_manifest(d, "job", 0))
    return files


@pytest.fixture(scope="module")
def moto_endpoint() -> Iterator[str]:
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture(params=["s3", "file"])
def tier(request: pytest.FixtureRequest, tmp_path: Path) -> ObjectTier:
    if request.param == "file":
        return ObjectTier(ObjectStoreConfig(f"file://{tmp_path}/store/ckpts"))
    endpoint = request.getfixturevalue("moto_endpoint")
    bucket = f"b-{os.urandom(4).hex()}"
    cfg = ObjectStoreConfig(f"s3://{bucket}/ckpts", endpoint_url=endpoint, key="testing", secret="testing",
                            region="us-east-1", timeout_s=5, retries=1)
    import boto3

    boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing", aws_secret_access_key="testing",
                 region_name="us-east-1").create_bucket(Bucket=bucket)
    return ObjectTier(cfg)


def test_write_list_verify_fetch(tier: ObjectTier, tmp_path: Path) -> None:
    files = fake_dcp(tmp_path / "src")
    info = tier.write_from(tmp_path / "src", "job", 2000)
    assert info.step == 2000 and info.size == sum(len(v) for v in files.values())
    assert info.location.endswith("/ckpts/default/unscoped/job/step_2000")
    assert [i.step for i in tier.list("job")] == [2000]
    assert tier.verify("job", 2000).ok
    dest = tier.fetch("job", 2000, tmp_path / "scratch" / "restore")
    for name, data in files.items():
        assert (dest / name).read_bytes() == data
    assert tier.open("job", 2000) is None  # never read in place


def test_data_without_manifest_is_not_listed(tier: ObjectTier, tmp_path: Path) -> None:
    fake_dcp(tmp_path / "src")
    tier.write_from(tmp_path / "src", "job", 10)
    # An upload that died before its manifest: data objects only.
    tier.fs.pipe_file(f"{tier.job_prefix('job')}/step_20/__0_0.distcp", b"half")
    tier.fs.pipe_file(f"{tier.job_prefix('job')}/.tmp-x/__0_0.distcp", b"junk")
    assert [i.step for i in tier.list("job")] == [10]


def test_corrupt_object_fails_verify_and_fetch(tier: ObjectTier, tmp_path: Path) -> None:
    files = fake_dcp(tmp_path / "src")
    tier.write_from(tmp_path / "src", "job", 30)
    key = f"{tier.job_prefix('job')}/step_30/__1_0.distcp"
    bad = bytearray(files["__1_0.distcp"])
    bad[7] ^= 0xFF
    tier.fs.pipe_file(key, bytes(bad))
    r = tier.verify("job", 30)
    assert not r.ok and r.checksum_mismatch == ("__1_0.distcp",)
    dest = tmp_path / "scratch" / "x"
    with pytest.raises(CheckpointCorrupt) as ei:
        tier.fetch("job", 30, dest)
    assert ei.value.problems == ["checksum mismatch: __1_0.distcp"]
    assert not dest.exists() and list((tmp_path / "scratch").iterdir()) == []
    tier.fs.rm_file(key)
    assert tier.verify("job", 30).missing == ("__1_0.distcp",)


def test_traversal_in_stored_manifest_is_rejected(tier: ObjectTier, tmp_path: Path) -> None:
    fake_dcp(tmp_path / "src")
    tier.write_from(tmp_path / "src", "job", 40)
    mkey = f"{tier.job_prefix('job')}/step_40/{MANIFEST_NAME}"
    doc = json.loads(tier.fs.cat_file(mkey))
    doc["files"][0]["path"] = "../../../escape.txt"
    tier.fs.pipe_file(mkey, json.dumps(doc).encode())
    scratch = tmp_path / "scratch"
    with pytest.raises(UnsafePathError):
        tier.fetch("job", 40, scratch / "r")
    assert not (tmp_path / "escape.txt").exists() and not scratch.joinpath("r").exists()
    assert not tier.verify("job", 40).ok


def test_corrupt_source_is_not_uploaded(tier: ObjectTier, tmp_path: Path) -> None:
    fake_dcp(tmp_path / "src")
    with open(tmp_path / "src" / "__0_0.distcp", "r+b") as f:
        f.write(b"\x00\x01\x02")
    with pytest.raises(CheckpointCorrupt):
        tier.write_from(tmp_path / "src", "job", 50)
    assert tier.list("job") == []
    assert not tier.fs.exists(f"{tier.job_prefix('job')}/step_50/__1_0.distcp")


def test_prune_and_overwrite(tier: ObjectTier, tmp_path: Path) -> None:
    fake_dcp(tmp_path / "src")
    for step in (1, 2, 3):
        tier.write_from(tmp_path / "src", "job", step)
    assert tier.prune("job", 2) == [1]
    assert [i.step for i in tier.list("job")] == [2, 3]
    assert not tier.fs.exists(f"{tier.job_prefix('job')}/step_1/__0_0.distcp")
    files = fake_dcp(tmp_path / "src2", ranks=1)
    tier.write_from(tmp_path / "src2", "job", 3)
    r = tier.verify("job", 3)
    assert r.ok, r.problems()
    assert tier.fetch("job", 3, tmp_path / "o").joinpath("__0_0.distcp").read_bytes() == files["__0_0.distcp"]


def test_unreachable_store_is_a_write_error(tmp_path: Path) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = ObjectStoreConfig("s3://nobucket/p", endpoint_url=f"http://127.0.0.1:{port}", key="k", secret="s",
                            region="us-east-1", timeout_s=1, retries=1)
    fake_dcp(tmp_path / "src")
    with pytest.raises(CheckpointWriteError) as ei:
        ObjectTier(cfg).write_from(tmp_path / "src", "job", 1)
    assert ei.value.tier == "object"


@pytest.mark.parametrize("url", ["http://x/y", "s3://", "file://relative/path", "ftp://a/b"])
def test_config_rejects_bad_urls(url: str) -> None:
    with pytest.raises(ValueError, match="checkpoint.object.url"):
        ObjectStoreConfig(url)


def test_config_hides_secret() -> None:
    cfg = ObjectStoreConfig("s3://b/p", key="AKIA", secret="TOPSECRET")
    assert "TOPSECRET" not in repr(cfg)
    with pytest.raises(ValueError, match="together"):
        ObjectStoreConfig("s3://b/p", key="AKIA")


def test_orphaned_uploads_are_cleaned_only_when_old(tier: ObjectTier, tmp_path: Path) -> None:
    fake_dcp(tmp_path / "src")
    tier.write_from(tmp_path / "src", "job", 1)
    tier.fs.pipe_file(f"{tier.job_prefix('job')}/step_2/__0_0.distcp", b"orphan of a crashed upload")
    assert tier.cleanup_tmp() == 0  # young: maybe another agent is still uploading
    assert tier.fs.exists(f"{tier.job_prefix('job')}/step_2/__0_0.distcp")
    assert tier.cleanup_tmp(min_age_s=0) == 1
    assert not tier.fs.exists(f"{tier.job_prefix('job')}/step_2/__0_0.distcp")
    assert [i.step for i in tier.list("job")] == [1] and tier.verify("job", 1).ok


# -- scoping by cluster and job uid, fencing by epoch ------------------------------------------------

UID_OLD, UID_NEW = "a1" * 8, "b2" * 8


def _scoped(tier: ObjectTier, cluster: str, uid: str, epoch: int) -> ObjectTier:
    """Another agent's view of the same store: its own cluster name, job uid and writer epoch."""
    return ObjectTier(tier.config, cluster=cluster, scope=lambda _job: ObjectScope(uid, epoch))


def test_older_epoch_neither_commits_nor_prunes_newer_steps(tier: ObjectTier, tmp_path: Path) -> None:
    fake_dcp(tmp_path / "src")
    fenced = _scoped(tier, "prod", UID_OLD, 3)  # the copy cut off from etcd, still running
    owner = _scoped(tier, "prod", UID_OLD, 4)   # the copy the leader moved the job to
    fenced.write_from(tmp_path / "src", "train", 100)
    owner.write_from(tmp_path / "src", "train", 110)
    owner.write_from(tmp_path / "src", "train", 120)
    with pytest.raises(StaleEpoch):
        fenced.write_from(tmp_path / "src", "train", 130)
    with pytest.raises(StaleEpoch):
        fenced.write_from(tmp_path / "src", "train", 120)  # nor replace one of the owner's steps
    assert [i.step for i in owner.list("train")] == [100, 110, 120]
    assert not tier.fs.exists(f"{owner.job_prefix('train')}/step_130")  # its upload was removed
    assert fenced.prune("train", 1) == []
    assert [i.step for i in owner.list("train")] == [100, 110, 120]
    assert owner.verify("train", 120).ok and owner.verify("train", 110).ok
    assert owner.prune("train", 2) == [100]  # the current owner prunes as before


def test_delete_hook_spares_a_step_committed_by_a_newer_epoch(tier: ObjectTier, tmp_path: Path) -> None:
    fake_dcp(tmp_path / "src")
    old = _scoped(tier, "prod", UID_OLD, 1)
    old.write_from(tmp_path / "src", "train", 10)
    old.write_from(tmp_path / "src", "train", 20)
    listed = old.list("train")  # the old writer's listing, taken before the new owner commits
    _scoped(tier, "prod", UID_OLD, 2).write_from(tmp_path / "src", "train", 30)
    assert old.prune("train", 1, listed=listed) == []
    assert [i.step for i in old.list("train")] == [10, 20, 30]


def test_two_clusters_and_two_submissions_do_not_see_each_others_steps(tier: ObjectTier, tmp_path: Path) -> None:
    fake_dcp(tmp_path / "src")
    a = _scoped(tier, "east", UID_OLD, 0)
    b = _scoped(tier, "west", UID_OLD, 9)  # same uid, other cluster: still apart
    again = _scoped(tier, "east", UID_NEW, 0)  # `train` submitted again in the same cluster
    a.write_from(tmp_path / "src", "train", 5)
    b.write_from(tmp_path / "src", "train", 7)
    again.write_from(tmp_path / "src", "train", 9)
    assert [i.step for i in a.list("train")] == [5]
    assert [i.step for i in b.list("train")] == [7]
    assert [i.step for i in again.list("train")] == [9]
    assert b.prune("train", 1) == [] and a.prune("train", 1) == []
    a.write_from(tmp_path / "src", "train", 6)  # west's epoch 9 does not fence east's epoch 0
    assert a.prune("train", 1) == [5]
    assert [i.step for i in b.list("train")] == [7] and [i.step for i in again.list("train")] == [9]
    assert a.cleanup_tmp(min_age_s=0) == 0


def test_scope_rejects_bad_uid_and_resolver_failure_is_unscoped(tier: ObjectTier) -> None:
    with pytest.raises(ValueError, match="uid"):
        ObjectScope("../../etc", 0)
    with pytest.raises(ValueError, match="cluster"):
        ObjectTier(tier.config, cluster="../x")

    def boom(_job: str) -> ObjectScope:
        raise KeyError(_job)

    assert ObjectTier(tier.config, scope=boom).scope("train").uid == "unscoped"


def test_job_uid_is_drawn_per_submission_and_kept_by_its_records() -> None:
    from trainguard.agent.lifecycle.jobs import JobSpec, JobSpecError

    first, second = JobSpec.from_dict({"job": "train", "nproc": 1}), JobSpec.from_dict({"job": "train", "nproc": 1})
    assert first.uid != second.uid and ObjectScope(first.uid).uid == first.uid
    # What the disk record and the etcd record hold is parsed again on adoption or a move: same uid.
    assert JobSpec.from_dict(first.to_dict()).uid == first.uid
    with pytest.raises(JobSpecError, match="uid"):
        JobSpec.from_dict({"job": "train", "nproc": 1, "uid": "../other-job"})


def test_the_agent_scopes_a_key_by_its_jobs_uid_and_epoch_or_attempt() -> None:
    from types import SimpleNamespace

    from trainguard.agent.daemon import Agent

    single = SimpleNamespace(spec=SimpleNamespace(uid=UID_OLD), block=None)
    span = SimpleNamespace(spec=SimpleNamespace(uid=UID_NEW), block=SimpleNamespace(attempt=7))
    cluster = SimpleNamespace(epoch_of={"train": 3}.get, job_uid={"elsewhere": "c3" * 8}.get)
    fake = SimpleNamespace(supervisor=SimpleNamespace(jobs={"train": single, "big": span}),
                           cluster=SimpleNamespace(epoch_of=lambda j: cluster.epoch_of(j, 0),
                                                   job_uid=lambda j: cluster.job_uid(j, "")))
    assert Agent._object_scope(fake, "train") == ObjectScope(UID_OLD, 3)  # type: ignore[arg-type]
    assert Agent._object_scope(fake, "big.part-node-b") == ObjectScope(UID_NEW, 7)  # type: ignore[arg-type]
    assert Agent._object_scope(fake, "elsewhere") == ObjectScope("c3" * 8, 0)  # type: ignore[arg-type]
    assert Agent._object_scope(fake, "unknown") is None  # type: ignore[arg-type]
