"""Agent-owned trees (agent/safefs.py, the local tiers, snapshots): a memory root another uid made
first is moved aside before anything in it is trusted; a checkpoint tree holding another uid's
file, or a symlink, is never handed to ranks; symlinks planted where ranks can write are removed
or refused, never followed, by every cleanup, rename and slot write of the agent."""

from __future__ import annotations

import json
import os
import shutil
import stat
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.security.attacker import ATTACKER_UID, as_attacker
from trainguard.agent.checkpoint import CheckpointManager, CheckpointSettings, MemoryTier, build_manifest
from trainguard.agent.checkpoint.snapshots import DONE, SLOTS, SlotHeader, SnapshotSet, slot_path
from trainguard.agent.safefs import UnsafeTreeError, ensure_agent_dir, rmtree_beneath

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as a second uid")


class Events(list[tuple[str, dict[str, object]]]):
    def __call__(self, kind: str, fields: dict[str, object]) -> None:
        self.append((kind, dict(fields)))

    def of(self, kind: str) -> list[dict[str, object]]:
        return [f for k, f in self if k == kind]


@pytest.fixture
def shm_root() -> Iterator[Path]:
    """A fresh name in world-writable /dev/shm, as the default memory root is."""
    root = Path(f"/dev/shm/tg-sec-{uuid.uuid4().hex[:10]}")
    yield root
    for p in Path("/dev/shm").glob(root.name + "*"):
        shutil.rmtree(p, ignore_errors=True) if not p.is_symlink() else p.unlink()


def _checkpoint_files() -> dict[str, bytes]:
    return {"__0_0.distcp": os.urandom(4096), ".metadata": b"planted", "meta.json": json.dumps({"step": 500}).encode()}


def _plant(root: str, files: dict[str, bytes], manifest: bytes) -> None:
    """As the attacker: make the memory root before the agent and a checkpoint in it."""
    step = os.path.join(root, "job", "step_500")
    os.makedirs(step, mode=0o777)
    os.chmod(root, 0o777)
    for name, data in files.items():
        with open(os.path.join(step, name), "wb") as fh:
            fh.write(data)
    with open(os.path.join(step, "manifest.json"), "wb") as fh:
        fh.write(manifest)


def test_memory_root_planted_by_another_uid_is_taken_over_and_never_restored(shm_root: Path,
                                                                               tmp_path: Path) -> None:
    files = _checkpoint_files()
    # The attacker's manifest checks out (right sizes and CRCs): built over the same bytes.
    model = tmp_path / "model"
    model.mkdir()
    for name, data in files.items():
        (model / name).write_bytes(data)
    manifest = build_manifest(model, "job", 500).to_json()
    as_attacker(_plant, str(shm_root), files, manifest)
    assert os.lstat(shm_root).st_uid == ATTACKER_UID

    events = Events()
    mgr = CheckpointManager(CheckpointSettings(memory_root=str(shm_root), disk_dir=str(tmp_path / "disk")), emit=events)
    mgr.start()
    try:
        taken = events.of("agent_dir_taken_over")
        assert taken and taken[0]["tier"] == "memory" and "uid 54321" in str(taken[0]["reason"])
        st = os.lstat(shm_root)
        assert st.st_uid == os.geteuid() and not st.st_mode & 0o022 and stat.S_ISDIR(st.st_mode)
        assert mgr.restore("job") is None  # the planted step 500 is never handed to ranks
        assert mgr.memory.list("job") == []
        moved = Path(str(taken[0]["moved_to"]))
        assert (moved / "job" / "step_500" / "manifest.json").exists()  # kept aside for an inquiry
    finally:
        mgr.stop()


def test_a_symlinked_memory_root_is_moved_aside_not_followed(shm_root: Path, tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "precious").write_text("keep")
    os.symlink(target, shm_root)
    check = ensure_agent_dir(shm_root)
    assert check.action == "taken_over" and "symlink" in check.reason
    assert not os.path.islink(shm_root) and (target / "precious").read_text() == "keep"


def test_refused_when_not_allowed_to_take_over(shm_root: Path) -> None:
    as_attacker(os.mkdir, str(shm_root), 0o777)
    with pytest.raises(UnsafeTreeError, match="owned by uid 54321"):
        ensure_agent_dir(shm_root, takeover=False)


def _commit(tier: MemoryTier, step: int) -> None:
    staged = tier.stage("job", step)
    (staged / "__0_0.distcp").write_bytes(os.urandom(2048))
    tier.commit("job", step, prune=False)


def test_checkpoint_holding_another_uids_file_is_refused_and_restore_falls_back(tmp_path: Path) -> None:
    events = Events()
    mgr = CheckpointManager(CheckpointSettings(memory_root=str(tmp_path / "shm")), emit=events)
    mgr.start()
    try:
        _commit(mgr.memory, 10)
        _commit(mgr.memory, 20)
        # Another identity wrote into step 20 (its file is theirs; the bytes still match the manifest).
        os.chown(mgr.memory.step_path("job", 20) / "__0_0.distcp", ATTACKER_UID, ATTACKER_UID)
        restored = mgr.restore("job")
        assert restored is not None and restored.info.step == 10
        corrupt = events.of("checkpoint_corrupt")
        assert corrupt and corrupt[0]["step"] == 20 and "uid 54321" in json.dumps(corrupt[0]["problems"])
        restored.release()
        # The job's own user (the launcher's ``user``) is trusted for its own job.
        mgr.set_job_owner(lambda job: (ATTACKER_UID, ATTACKER_UID) if job == "job" else None)
        again = mgr.restore("job")
        assert again is not None and again.info.step == 20
        again.release()
    finally:
        mgr.stop()


def test_symlinked_step_directory_is_refused_at_restore(tmp_path: Path) -> None:
    mgr = CheckpointManager(CheckpointSettings(memory_root=str(tmp_path / "shm")))
    mgr.start()
    try:
        _commit(mgr.memory, 10)
        outside = tmp_path / "outside"
        shutil.copytree(mgr.memory.step_path("job", 10), outside)
        os.symlink(outside, mgr.memory.job_dir("job") / "step_30")  # as a rank in its job dir would
        restored = mgr.restore("job")
        assert restored is not None and restored.info.step == 10
        restored.release()
    finally:
        mgr.stop()


def test_cleanup_and_delete_never_follow_planted_symlinks(tmp_path: Path) -> None:
    tier = MemoryTier(tmp_path / "shm")
    tier.secure_root()
    _commit(tier, 10)
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "manifest.json").write_text("{}")
    (victim / "data").write_text("precious")
    jd = tier.job_dir("job")
    os.symlink(victim, jd / ".tmp-step_11-planted")  # a staging dir swapped for a link
    os.symlink(victim, jd / "step_12")  # a committed step swapped for a link
    assert tier.cleanup_tmp() >= 1
    tier.delete("job", 12)
    assert tier.cleanup_job_tmp("job") >= 0
    assert sorted(p.name for p in victim.iterdir()) == ["data", "manifest.json"]
    assert (victim / "data").read_text() == "precious"
    assert not os.path.lexists(jd / ".tmp-step_11-planted") and not os.path.lexists(jd / "step_12")


def test_snapshot_remove_does_not_follow_a_snapshots_symlink(tmp_path: Path) -> None:
    root = tmp_path / "shm"
    root.mkdir(mode=0o755)
    victim = tmp_path / "victim"
    (victim / "job").mkdir(parents=True)
    (victim / "job" / "important").write_text("keep")
    os.symlink(victim, root / ".snapshots")
    SnapshotSet(root, "job").remove()
    assert (victim / "job" / "important").read_text() == "keep"
    assert not rmtree_beneath(root, root / ".snapshots" / "job")


def _done_slot(path: Path, step: int) -> None:
    path.write_bytes(SlotHeader(DONE, step, 0, 1, 0, 0, 0, 0).pack().ljust(4096, b"\0"))


def test_clear_and_keep_only_never_write_through_a_symlinked_slot(tmp_path: Path) -> None:
    root = tmp_path / "shm"
    snaps = SnapshotSet(root, "job")
    root.mkdir(mode=0o755)
    snaps.prepare()
    victim = tmp_path / "victim-file"
    victim.write_bytes(b"x" * 8192)
    os.symlink(victim, slot_path(snaps.dir, 0, "a"))
    _done_slot(slot_path(snaps.dir, 0, "b"), 3)
    snaps.clear()
    snaps.keep_only(7)
    assert victim.read_bytes() == b"x" * 8192


def test_a_fifo_in_place_of_a_slot_does_not_block_the_agent(tmp_path: Path) -> None:
    root = tmp_path / "shm"
    snaps = SnapshotSet(root, "job")
    root.mkdir(mode=0o755)
    snaps.prepare()
    for slot in SLOTS:
        os.mkfifo(slot_path(snaps.dir, 0, slot))
    result: list[object] = []
    t = threading.Thread(target=lambda: result.append(snaps.common_step(1)), daemon=True)
    t.start()
    t.join(20)
    assert not t.is_alive() and result == [None]


def test_job_subtrees_are_given_to_the_jobs_user(tmp_path: Path) -> None:
    mgr = CheckpointManager(CheckpointSettings(memory_root=str(tmp_path / "shm")))
    mgr.start()
    try:
        mgr.set_job_owner(lambda job: (ATTACKER_UID, ATTACKER_UID))
        mgr.prepare_job("job")
        assert os.lstat(mgr.memory.job_dir("job")).st_uid == ATTACKER_UID
        assert os.lstat(SnapshotSet(mgr.memory.root, "job").dir).st_uid == ATTACKER_UID
        # The roots above them stay the agent's.
        assert os.lstat(mgr.memory.root).st_uid == os.geteuid()
        assert os.lstat(mgr.memory.root / ".snapshots").st_uid == os.geteuid()
    finally:
        mgr.stop()


def test_agent_state_dirs_owned_by_another_uid_or_symlinked_are_refused(tmp_path: Path) -> None:
    from trainguard.agent.paths import AgentPaths

    paths = AgentPaths.for_state_dir(str(tmp_path / "state"))
    assert {c.action for c in paths.ensure()} == {"created"}
    assert {c.action for c in paths.ensure()} == {"ok"}
    os.chown(paths.events_dir, ATTACKER_UID, ATTACKER_UID)  # as if that user had made it first
    with pytest.raises(UnsafeTreeError, match="owned by uid 54321"):
        paths.ensure()
    shutil.rmtree(paths.events_dir)
    os.symlink(tmp_path, paths.events_dir)
    with pytest.raises(UnsafeTreeError, match="symlink"):
        paths.ensure()


def test_a_fifo_in_place_of_a_manifest_does_not_block_listing_or_restore(tmp_path: Path) -> None:
    mgr = CheckpointManager(CheckpointSettings(memory_root=str(tmp_path / "shm")))
    mgr.start()
    try:
        _commit(mgr.memory, 10)
        planted = mgr.memory.job_dir("job") / "step_40"
        planted.mkdir()
        os.mkfifo(planted / "manifest.json")  # as a rank in its own job directory could
        result: list[object] = []
        t = threading.Thread(target=lambda: result.append(mgr.restore("job")), daemon=True)
        t.start()
        t.join(30)
        assert not t.is_alive()
        restored = result[0]
        assert restored is not None and restored.info.step == 10  # type: ignore[attr-defined]
        restored.release()  # type: ignore[attr-defined]
    finally:
        mgr.stop()


def test_a_disk_root_symlinked_by_root_is_followed_once_and_secured(tmp_path: Path, shm_root: Path) -> None:
    """An admin's link to an NVMe mount stays in use; a link another uid made does not (above)."""
    from trainguard.agent.checkpoint import DiskTier

    target = tmp_path / "nvme"
    target.mkdir()
    os.symlink(target, tmp_path / "checkpoints")
    disk = DiskTier(tmp_path / "checkpoints")
    assert disk.secure_root().action == "ok" and disk.root == target
    as_attacker(os.symlink, str(target), str(shm_root))  # in world-writable /dev/shm
    memory = MemoryTier(shm_root)
    check = memory.secure_root()
    assert check.action == "taken_over" and "symlink" in check.reason and memory.root == shm_root
    assert not os.path.islink(shm_root)
