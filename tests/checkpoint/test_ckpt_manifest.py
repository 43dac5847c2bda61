"""Checkpoint manifests: build/verify round trip, and verify naming every kind of damage;
crafted manifests with path traversal are rejected before any path is used."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from trainguard.agent.checkpoint.errors import CheckpointError, ManifestError, UnsafePathError
from trainguard.agent.checkpoint.local import LocalDirTier
from trainguard.agent.checkpoint.manifest import (
    ALGORITHMS,
    MANIFEST_NAME,
    Manifest,
    build_manifest,
    read_manifest,
    safe_relpath,
    verify,
    write_manifest,
)


def fake_dcp(d: Path, ranks: int = 3, size: int = 50_000) -> Path:
    """A directory shaped like a DCP checkpoint: .metadata plus one shard file per rank."""
    d.mkdir(parents=True, exist_ok=True)
    (d / ".metadata").write_bytes(os.urandom(300))
    for r in range(ranks):
        (d / f"__{r}_0.distcp").write_bytes(os.urandom(size + r))
    return d


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    d = fake_dcp(tmp_path / "ckpt")
    write_manifest(d, build_manifest(d, "job-a", 100, {"world_size": 3}))
    return d


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_round_trip_every_algorithm(tmp_path: Path, algorithm: str) -> None:
    d = fake_dcp(tmp_path / "c")
    m = build_manifest(d, "j", 7, {"k": 1}, algorithm=algorithm)
    write_manifest(d, m)
    back = read_manifest(d)
    assert back == m
    assert back.algorithm == algorithm
    assert back.total_bytes == sum(p.stat().st_size for p in d.iterdir() if p.name != MANIFEST_NAME)
    assert {f.path for f in back.files} == {".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp"}
    assert verify(d).ok


def test_flipped_byte_is_a_checksum_mismatch(ckpt: Path) -> None:
    p = ckpt / "__1_0.distcp"
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0x01
    p.write_bytes(bytes(data))
    r = verify(ckpt)
    assert not r.ok
    assert r.checksum_mismatch == ("__1_0.distcp",)
    assert not r.size_mismatch and not r.missing
    assert "checksum mismatch: __1_0.distcp" in r.problems()


def test_truncation_missing_and_extra_are_named(ckpt: Path) -> None:
    with open(ckpt / "__0_0.distcp", "r+b") as f:
        f.truncate(1000)
    (ckpt / "__2_0.distcp").unlink()
    (ckpt / "stray.bin").write_bytes(b"x")
    r = verify(ckpt)
    assert r.size_mismatch == ("__0_0.distcp",)
    assert r.missing == ("__2_0.distcp",)
    assert r.extra == ("stray.bin",)
    assert not r.ok


def test_no_manifest_or_garbage_manifest_is_not_ok(tmp_path: Path) -> None:
    d = fake_dcp(tmp_path / "c")
    r = verify(d)
    assert not r.ok and "no manifest" in (r.error or "")
    (d / MANIFEST_NAME).write_bytes(b"\x80\x04K\x01.")  # a pickle: must never be loaded as one
    r = verify(d)
    assert not r.ok and "invalid manifest" in (r.error or "")


@pytest.mark.parametrize(
    "bad",
    ["../../etc/passwd", "/etc/passwd", "a/../../b", "a//b", "./x", "a\\..\\b", "x\x00y", "C:/x", "", MANIFEST_NAME],
)
def test_unsafe_paths_rejected(bad: str) -> None:
    with pytest.raises(UnsafePathError):
        safe_relpath(bad)


def test_nested_relative_path_is_fine() -> None:
    assert safe_relpath("sub/dir/__0_0.distcp") == "sub/dir/__0_0.distcp"
    assert safe_relpath(".metadata") == ".metadata"


def _crafted(ckpt: Path, path: str) -> None:
    doc = json.loads((ckpt / MANIFEST_NAME).read_bytes())
    doc["files"][0]["path"] = path
    (ckpt / MANIFEST_NAME).write_text(json.dumps(doc))


def test_crafted_manifest_with_traversal_is_rejected(ckpt: Path, tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    _crafted(ckpt, "../victim.txt")
    with pytest.raises(UnsafePathError):
        read_manifest(ckpt)
    r = verify(ckpt)
    assert not r.ok and "invalid manifest" in (r.error or "")
    # Copying such a source into a tier must refuse, never read or write outside the tree.
    tier = LocalDirTier("disk", tmp_path / "tier", 20, durable=True, restore_in_place=True)
    with pytest.raises(UnsafePathError):  # a corrupt source, reported as such, not copied on
        tier.write_from(ckpt, "job-a", 100)
    assert tier.list("job-a") == []
    assert victim.read_text() == "keep me"
    assert [p.name for p in (tmp_path / "tier" / "job-a").iterdir()] == []


def test_manifest_schema_is_strict() -> None:
    good = {"format": "trainguard-checkpoint", "version": 1, "job": "j", "step": 1, "created": 1.0,
            "algorithm": "crc32", "files": [{"path": "a", "size": 1, "checksum": "00"}], "extra": {}}
    Manifest.from_json(json.dumps(good).encode())
    for key, value in [("step", -1), ("step", "1"), ("algorithm", "md5"), ("files", {}), ("job", ""),
                       ("version", 2), ("format", "other")]:
        with pytest.raises(ManifestError):
            Manifest.from_json(json.dumps(good | {key: value}).encode())
    dup = good | {"files": [good["files"][0], good["files"][0]]}  # type: ignore[list-item]
    with pytest.raises(ManifestError, match="twice"):
        Manifest.from_json(json.dumps(dup).encode())


def test_symlink_inside_checkpoint_is_refused(tmp_path: Path) -> None:
    d = fake_dcp(tmp_path / "c")
    (d / "link").symlink_to("/etc/hostname")
    with pytest.raises(CheckpointError):
        build_manifest(d, "j", 1)
