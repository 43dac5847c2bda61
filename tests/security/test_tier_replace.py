"""Replace, then delete, in the disk and object tiers: a step saved again is never absent and
never lost to a failure half-way (a crash between the disk tier's two renames, an upload that
fails), and records are fsync'd with their directory."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from trainguard.agent.checkpoint import DiskTier, ObjectStoreConfig, ObjectTier, read_manifest
from trainguard.agent.checkpoint import local as local_mod
from trainguard.agent.checkpoint import objectstore as object_mod
from trainguard.agent.checkpoint.errors import CheckpointWriteError
from trainguard.agent.safefs import write_atomic


def _source(tmp_path: Path, name: str, data: bytes) -> Path:
    src = tmp_path / name
    src.mkdir()
    (src / "__0_0.distcp").write_bytes(data)
    return src


def test_disk_resave_is_one_exchange_never_absent(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path / "disk")
    disk.secure_root()
    disk.write_from(_source(tmp_path, "one", b"first" * 100), "job", 5)
    disk.write_from(_source(tmp_path, "two", b"second" * 100), "job", 5)
    assert disk.verify("job", 5).ok
    assert (disk.step_path("job", 5) / "__0_0.distcp").read_bytes() == b"second" * 100
    assert [p.name for p in disk.job_dir("job").iterdir()] == ["step_5"]  # the old copy retired


def test_disk_crash_between_the_two_renames_loses_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the filesystem cannot exchange: the old copy is renamed aside, then the process dies
    before the new one is renamed in. The next start puts the old copy back."""
    disk = DiskTier(tmp_path / "disk")
    disk.secure_root()
    disk.write_from(_source(tmp_path, "one", b"first" * 100), "job", 5)
    monkeypatch.setattr(local_mod, "exchange_at", lambda *a: False)
    real_rename = os.rename
    calls: list[str] = []

    def crash_on_second(src: str, dst: str, **kw: object) -> None:
        calls.append(str(src))
        if len(calls) == 2:
            raise KeyboardInterrupt("the agent dies here")
        real_rename(src, dst, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(local_mod.os, "rename", crash_on_second)
    with pytest.raises(KeyboardInterrupt):
        disk.write_from(_source(tmp_path, "two", b"second" * 100), "job", 5)
    monkeypatch.setattr(local_mod.os, "rename", real_rename)
    assert disk.list("job") == []  # the window the crash hit
    fresh = DiskTier(tmp_path / "disk")  # the agent's next start
    fresh.cleanup_tmp()
    assert [i.step for i in fresh.list("job")] == [5] and fresh.verify("job", 5).ok
    assert (fresh.step_path("job", 5) / "__0_0.distcp").read_bytes() == b"first" * 100


def _object(tmp_path: Path) -> ObjectTier:
    return ObjectTier(ObjectStoreConfig(url=f"file://{tmp_path}/object"))


def test_object_resave_failing_half_way_keeps_the_previous_copy(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    tier = _object(tmp_path)
    tier.write_from(_source(tmp_path, "one", b"first" * 1000), "job", 7)
    real = ObjectTier._upload

    def fail(self: ObjectTier, *args: object) -> bool:
        raise OSError("connection reset")

    monkeypatch.setattr(ObjectTier, "_upload", fail)
    with pytest.raises(CheckpointWriteError):
        tier.write_from(_source(tmp_path, "two", b"second" * 1000), "job", 7)
    monkeypatch.setattr(ObjectTier, "_upload", real)
    assert [i.step for i in tier.list("job")] == [7] and tier.verify("job", 7).ok
    out = tier.fetch("job", 7, tmp_path / "back")
    assert (out / "__0_0.distcp").read_bytes() == b"first" * 1000


def test_object_resave_replaces_then_deletes_the_old_copy(tmp_path: Path) -> None:
    tier = _object(tmp_path)
    tier.write_from(_source(tmp_path, "one", b"first" * 1000), "job", 7)
    tier.write_from(_source(tmp_path, "two", b"second" * 1000), "job", 7)
    tier.write_from(_source(tmp_path, "three", b"third" * 1000), "job", 7)
    assert tier.verify("job", 7).ok
    step_dir = tmp_path / "object" / "default" / "unscoped" / "job" / "step_7"
    generations = [p.name for p in step_dir.iterdir() if p.is_dir()]
    assert len(generations) == 1 and not (step_dir / "__0_0.distcp").exists()  # older copies gone
    out = tier.fetch("job", 7, tmp_path / "back")
    assert (out / "__0_0.distcp").read_bytes() == b"third" * 1000
    # A generation a crash left behind (never committed) goes once it is old.
    stray = step_dir / "g0123456789ab"
    stray.mkdir()
    (stray / "__0_0.distcp").write_bytes(b"partial")
    os.utime(stray / "__0_0.distcp", (1.0, 1.0))
    assert tier.cleanup_tmp(min_age_s=60) == 1 and not stray.exists() and tier.verify("job", 7).ok
    assert object_mod.GENERATION_KEY in read_manifest(out).extra


def test_records_are_written_atomically_and_fsynced_with_their_directory(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[bool] = []
    real = os.fsync

    def spy(fd: int) -> None:
        synced.append(os.path.isdir(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    write_atomic(tmp_path / "record.json", b'{"job": "a"}')
    assert synced == [False, True]  # the file, then its directory
    assert (tmp_path / "record.json").read_bytes() == b'{"job": "a"}'
    assert [p.name for p in tmp_path.iterdir()] == ["record.json"]
