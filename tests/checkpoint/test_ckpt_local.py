"""Memory and disk tiers on real filesystems: atomic commit, crash leftovers, buffer reuse in
/dev/shm, and a disk tier on a real 1 MiB tmpfs mount that fills up."""

from __future__ import annotations

import errno
import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from trainguard.agent.checkpoint.disk import DiskTier
from trainguard.agent.checkpoint.errors import CheckpointError, CheckpointWriteError
from trainguard.agent.checkpoint.manifest import MANIFEST_NAME, read_manifest
from trainguard.agent.checkpoint.memory import REUSE_DIRNAME, SPARE_PREFIX, MemoryTier, open_for_overwrite


def fake_dcp(d: Path, ranks: int = 2, size: int = 40_000, seed: bytes = b"") -> dict[str, bytes]:
    d.mkdir(parents=True, exist_ok=True)
    files = {".metadata": os.urandom(200)} | {f"__{r}_0.distcp": os.urandom(size + r) for r in range(ranks)}
    for name, data in files.items():
        (d / name).write_bytes(data)
    return files


def write_ranks(stage: Path, files: dict[str, bytes]) -> None:
    """What the trainer's DCP FileSystem does with the reuse opener."""
    for name, data in files.items():
        with open_for_overwrite(stage / name) as f:
            f.write(data)


@pytest.fixture
def shm_root() -> Iterator[Path]:
    root = Path("/dev/shm") / f"trainguard-test-{uuid.uuid4().hex}"
    yield root
    subprocess.run(["rm", "-rf", str(root)], check=False)


def test_staged_checkpoint_is_invisible_until_commit(shm_root: Path) -> None:
    tier = MemoryTier(shm_root, keep=3)
    stage = tier.stage("job", 100)
    assert stage.parent == shm_root / "job" and stage.name.startswith(".tmp-step_100-")
    files = {f"__{r}_0.distcp": os.urandom(10_000) for r in range(2)} | {".metadata": b"meta"}
    write_ranks(stage, files)
    assert tier.list("job") == []
    assert tier.open("job", 100) is None
    info = tier.commit("job", 100, extra={"world_size": 2})
    assert not stage.exists()
    assert [i.step for i in tier.list("job")] == [100]
    assert info.size == sum(len(v) for v in files.values())
    path = tier.open("job", 100)
    assert path == shm_root / "job" / "step_100"
    assert {p.name for p in path.iterdir()} == set(files) | {MANIFEST_NAME}
    assert read_manifest(path).extra == {"world_size": 2}
    assert tier.verify("job", 100).ok


def test_crash_leftovers_are_ignored_and_cleaned(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path / "disk")
    fake_dcp(tmp_path / "src")
    tier.write_from(tmp_path / "src", "job", 5)
    jd = tmp_path / "disk" / "job"
    # A crash mid-write: a tmp dir full of data (even with a manifest), and a step dir that
    # never got its manifest (written by hand, not by us).
    leftover = jd / ".tmp-step_9-deadbeef"
    fake_dcp(leftover)
    (leftover / MANIFEST_NAME).write_bytes((jd / "step_5" / MANIFEST_NAME).read_bytes())
    fake_dcp(jd / "step_11")
    assert [i.step for i in tier.list("job")] == [5]
    assert tier.cleanup_tmp() == 1
    assert not leftover.exists()
    assert [i.step for i in DiskTier(tmp_path / "disk").list("job")] == [5]


def test_recommit_same_step_replaces_and_delete_uncommits(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path / "disk")
    first = fake_dcp(tmp_path / "a")
    second = fake_dcp(tmp_path / "b", ranks=1)
    tier.write_from(tmp_path / "a", "job", 7)
    tier.write_from(tmp_path / "b", "job", 7)
    path = tier.step_path("job", 7)
    assert {p.name for p in path.iterdir()} - {MANIFEST_NAME} == set(second)
    assert (path / "__0_0.distcp").read_bytes() == second["__0_0.distcp"] != first["__0_0.distcp"]
    assert tier.verify("job", 7).ok
    tier.delete("job", 7)
    assert tier.list("job") == []
    assert [p.name for p in (tmp_path / "disk" / "job").iterdir()] == []


def test_memory_prune_keeps_newest_and_skips_pinned(shm_root: Path) -> None:
    tier = MemoryTier(shm_root, keep=2, spare_buffers=0)
    release = None
    for step in (10, 20, 30, 40):
        write_ranks(tier.stage("job", step), {"__0_0.distcp": os.urandom(1000)})
        if step == 20:
            tier.commit("job", step)
            release = tier.acquire("job", 20)  # a restore is reading step 20
            continue
        tier.commit("job", step)
    assert [i.step for i in tier.list("job")] == [20, 30, 40]
    assert release is not None
    release()
    assert tier.prune("job", 2) == [20]
    assert [i.step for i in tier.list("job")] == [30, 40]


def test_buffer_reuse_overwrites_pruned_files_in_place(shm_root: Path) -> None:
    tier = MemoryTier(shm_root, keep=1, spare_buffers=1)
    big = {"__0_0.distcp": os.urandom(300_000), "__1_0.distcp": os.urandom(300_000), ".metadata": b"m" * 100}
    write_ranks(tier.stage("job", 1), big)
    tier.commit("job", 1)
    inode_before = os.stat(tier.step_path("job", 1) / "__0_0.distcp").st_ino
    write_ranks(tier.stage("job", 2), big)
    tier.commit("job", 2)  # prunes step 1 into the spare pool
    spares = [p for p in (shm_root / "job").iterdir() if p.name.startswith(SPARE_PREFIX)]
    assert len(spares) == 1 and not (spares[0] / MANIFEST_NAME).exists()
    assert os.stat(spares[0] / "__0_0.distcp").st_ino == inode_before

    stage = tier.stage("job", 3)
    assert tier.reused_stages == 1  # stage 2 found no spare yet; stage 3 got step 1's files
    assert (stage / REUSE_DIRNAME / "__0_0.distcp").exists()
    # Smaller world now: rank 1 writes nothing, rank 0 writes less than the old file held.
    small = {"__0_0.distcp": os.urandom(1234), ".metadata": b"new-meta"}
    write_ranks(stage, small)
    assert os.stat(stage / "__0_0.distcp").st_ino == inode_before  # the same pages, not a new file
    info = tier.commit("job", 3)
    path = tier.step_path("job", 3)
    assert {p.name for p in path.iterdir()} == {"__0_0.distcp", ".metadata", MANIFEST_NAME}
    assert (path / "__0_0.distcp").read_bytes() == small["__0_0.distcp"]  # cut to what was written
    assert (path / ".metadata").read_bytes() == b"new-meta"
    assert info.size == 1234 + 8
    assert tier.verify("job", 3).ok


def test_abort_and_commit_without_stage(shm_root: Path) -> None:
    tier = MemoryTier(shm_root)
    stage = tier.stage("job", 5)
    (stage / "__0_0.distcp").write_bytes(b"partial")
    tier.abort("job", 5)
    assert not stage.exists()
    with pytest.raises(CheckpointError, match="not staged"):
        tier.commit("job", 5)
    with pytest.raises(ValueError, match="job name"):
        tier.stage("../evil", 1)


def test_disk_tier_write_error_leaves_nothing_half_written(tmp_path: Path, shm_root: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The full-filesystem path without a real full filesystem (the tmpfs test below needs root):
    the second file's copy fails with ENOSPC."""
    import trainguard.agent.checkpoint.local as local

    disk = DiskTier(tmp_path / "ckpt")
    small = tmp_path / "small"
    fake_dcp(small, ranks=1, size=1000)
    disk.write_from(small, "job", 100)
    memory = MemoryTier(shm_root)
    write_ranks(memory.stage("job", 200), {f"__{r}_0.distcp": os.urandom(1000) for r in range(3)})
    memory.commit("job", 200)
    real, calls = local.copy_checked, []

    def fill_up(src: Path, dst: Path, algorithm: str, *, durable: bool, src_root: Path | None = None) -> tuple[int, str]:
        calls.append(dst)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device", str(dst))
        return real(src, dst, algorithm, durable=durable, src_root=src_root)

    monkeypatch.setattr(local, "copy_checked", fill_up)
    with pytest.raises(CheckpointWriteError) as ei:
        disk.write_from(memory.step_path("job", 200), "job", 200)
    assert ei.value.step == 200 and ei.value.cause.errno == errno.ENOSPC  # type: ignore[union-attr]
    assert [i.step for i in disk.list("job")] == [100]
    assert sorted(p.name for p in (tmp_path / "ckpt" / "job").iterdir()) == ["step_100"]


def test_disk_tier_on_full_filesystem(tiny_tmpfs: Path, tmp_path: Path, shm_root: Path) -> None:
    disk = DiskTier(tiny_tmpfs / "ckpt")
    small = tmp_path / "small"
    fake_dcp(small, ranks=1, size=100_000)
    disk.write_from(small, "job", 100)  # fits

    memory = MemoryTier(shm_root)
    write_ranks(memory.stage("job", 200), {f"__{r}_0.distcp": os.urandom(400_000) for r in range(3)})
    memory.commit("job", 200)
    with pytest.raises(CheckpointWriteError) as ei:
        disk.write_from(memory.step_path("job", 200), "job", 200)
    err = ei.value
    assert err.tier == "disk" and err.step == 200
    assert isinstance(err.cause, OSError) and err.cause.errno == errno.ENOSPC
    assert "ENOSPC" in str(err)
    # Nothing partial committed, the tmp dir is gone, the older checkpoint is intact.
    assert [i.step for i in disk.list("job")] == [100]
    assert sorted(p.name for p in (tiny_tmpfs / "ckpt" / "job").iterdir()) == ["step_100"]
    assert disk.verify("job", 100).ok
    # The memory tier is unaffected, and the disk tier still takes a checkpoint that fits.
    assert memory.verify("job", 200).ok
    disk.write_from(small, "job", 300)
    assert [i.step for i in disk.list("job")] == [100, 300]


def test_commit_from_another_process_accepts_only_its_staging_dir(shm_root: Path, tmp_path: Path) -> None:
    agent_side = MemoryTier(shm_root)
    trainer_side = MemoryTier(shm_root)
    stage = trainer_side.stage("job", 8)
    write_ranks(stage, {"__0_0.distcp": b"x" * 100})
    other = tmp_path / "elsewhere"
    other.mkdir()
    for bad in (other, shm_root / "job" / "step_1", trainer_side.stage("job", 9)):
        with pytest.raises(CheckpointError, match="not a staging directory"):
            agent_side.commit("job", 8, staged=bad)
    info = agent_side.commit("job", 8, staged=stage, prune=False)
    assert info.step == 8 and agent_side.verify("job", 8).ok
