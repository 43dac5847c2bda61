"""agent/safefs.py, the helpers every tree another identity can write is handled with: a symlink
at any depth below the trusted root is refused or removed as a link, never followed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from trainguard.agent.safefs import (
    UnsafeTreeError,
    chown_tree,
    copy_tree_beneath,
    ensure_agent_dir,
    open_beneath,
    relparts,
    rename_beneath,
    rmtree_beneath,
    walk_files,
    write_atomic,
)


@pytest.fixture
def tree(tmp_path: Path) -> tuple[Path, Path]:
    root = tmp_path / "root"
    root.mkdir()
    victim = tmp_path / "victim"
    (victim / "b").mkdir(parents=True)
    (victim / "b" / "file").write_text("precious")
    os.symlink(victim, root / "a")  # planted where a rank could write
    return root, victim


def test_rmtree_beneath_refuses_an_intermediate_symlink(tree: tuple[Path, Path]) -> None:
    root, victim = tree
    assert rmtree_beneath(root, root / "a" / "b") is False
    assert (victim / "b" / "file").read_text() == "precious"
    assert rmtree_beneath(root, root / "a") is True  # the link itself goes
    assert not os.path.lexists(root / "a") and (victim / "b" / "file").exists()


def test_open_rename_and_write_beneath_refuse_symlinks(tree: tuple[Path, Path]) -> None:
    root, victim = tree
    with pytest.raises(UnsafeTreeError):
        open_beneath(root, root / "a" / "b" / "file", os.O_RDONLY)
    (root / "real").mkdir()
    os.symlink(victim / "b" / "file", root / "real" / "link")
    with pytest.raises(OSError):
        open_beneath(root, root / "real" / "link", os.O_WRONLY)
    with pytest.raises(UnsafeTreeError):
        rename_beneath(root, root / "real", root / "a" / "moved")
    with pytest.raises(UnsafeTreeError):
        write_atomic(root / "a" / "b" / "record.json", b"{}", root=root)
    assert sorted(p.name for p in (victim / "b").iterdir()) == ["file"]


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to a second uid needs root")
def test_walk_files_refuses_links_and_other_owners(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "x").write_bytes(b"1")
    assert [rel for rel, _ in walk_files(root, uids={os.geteuid()})] == ["sub/x"]
    os.chown(root / "sub" / "x", 54_321, 54_321)
    with pytest.raises(UnsafeTreeError, match="owned by uid 54321"):
        walk_files(root, uids={os.geteuid()})
    os.symlink("/etc/passwd", root / "sub" / "y")
    with pytest.raises(UnsafeTreeError):
        walk_files(root)


def test_relparts_stays_below_the_root(tmp_path: Path) -> None:
    assert relparts(tmp_path, tmp_path / "a" / "b") == ["a", "b"]
    with pytest.raises(UnsafeTreeError):
        relparts(tmp_path / "a", tmp_path / "ab")
    with pytest.raises(UnsafeTreeError):
        relparts(tmp_path, "/etc")


def test_ensure_agent_dir_tightens_its_own_loose_directory(tmp_path: Path) -> None:
    loose = tmp_path / "loose"
    loose.mkdir()
    os.chmod(loose, 0o777)
    check = ensure_agent_dir(loose)
    assert check.action == "tightened" and not os.lstat(loose).st_mode & 0o022


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to a second uid needs root")
def test_chown_tree_gives_a_subtree_without_following_links(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "job" / "d").mkdir(parents=True)
    (root / "job" / "d" / "f").write_bytes(b"")
    outside = tmp_path / "outside"
    outside.write_bytes(b"")
    os.symlink(outside, root / "job" / "link")
    chown_tree(root, root / "job", 54_321, 54_321)
    assert os.lstat(root / "job" / "d" / "f").st_uid == 54_321
    assert os.lstat(outside).st_uid == os.geteuid()


def test_copy_tree_beneath_copies_files_and_refuses_a_tree_with_a_link(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    (src / "d" / "f").write_bytes(b"abc")
    (src / "g").write_bytes(b"12345")
    assert copy_tree_beneath(tmp_path, src, tmp_path, tmp_path / "out" / "copy") == 8
    assert (tmp_path / "out" / "copy" / "d" / "f").read_bytes() == b"abc"
    os.symlink("/etc/shadow", src / "d" / "leak")
    with pytest.raises(UnsafeTreeError):
        copy_tree_beneath(tmp_path, src, tmp_path, tmp_path / "out" / "again")
    assert not (tmp_path / "out" / "again").exists()
