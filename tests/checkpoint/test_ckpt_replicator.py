"""Replication between real tiers (memory in /dev/shm, disk, object over file://), per-tier
intervals and retention, a failing tier on a full tmpfs, and the restore catalog."""

from __future__ import annotations

import os
import subprocess
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from trainguard.agent.checkpoint.catalog import newest_restorable, restore
from trainguard.agent.checkpoint.disk import DiskTier
from trainguard.agent.checkpoint.memory import MemoryTier, open_for_overwrite
from trainguard.agent.checkpoint.objectstore import ObjectStoreConfig, ObjectTier
from trainguard.agent.checkpoint.replicator import TierReplicator
from trainguard.agent.checkpoint.status import METRICS, CheckpointStatus
from trainguard.agent.checkpoint.tier import CheckpointInfo


class Events:
    def __init__(self) -> None:
        self.items: list[tuple[str, dict[str, Any]]] = []
        self.lock = threading.Lock()

    def __call__(self, kind: str, fields: dict[str, Any]) -> None:
        with self.lock:
            self.items.append((kind, fields))

    def of(self, kind: str) -> list[dict[str, Any]]:
        with self.lock:
            return [f for k, f in self.items if k == kind]


@pytest.fixture
def memory() -> Iterator[MemoryTier]:
    root = Path("/dev/shm") / f"trainguard-test-{uuid.uuid4().hex}"
    yield MemoryTier(root, keep=2)
    subprocess.run(["rm", "-rf", str(root)], check=False)


def save(memory: MemoryTier, step: int, size: int = 20_000, ranks: int = 2) -> CheckpointInfo:
    stage = memory.stage("job", step)
    for r in range(ranks):
        with open_for_overwrite(stage / f"__{r}_0.distcp") as f:
            f.write(os.urandom(size))
    (stage / ".metadata").write_bytes(f"step {step}".encode())
    return memory.commit("job", step)


def flip_byte(path: Path) -> None:
    with open(path, "r+b") as f:
        b = f.read(1)
        f.seek(0)
        f.write(bytes([b[0] ^ 0xFF]))


def test_intervals_and_retention(memory: MemoryTier, tmp_path: Path) -> None:
    disk = DiskTier(tmp_path / "disk")
    obj = ObjectTier(ObjectStoreConfig(f"file://{tmp_path}/object"))
    events, status = Events(), CheckpointStatus()
    rep = TierReplicator(memory, [disk, obj], {"disk": 300, "object": 500}, keep={"disk": 2, "object": 5},
                         emit=events, status=status)
    rep.start()
    try:
        for step in range(100, 1100, 100):
            status.observe_commit(save(memory, step))
            rep.notify("job", step)
            assert rep.wait_idle(10)
    finally:
        assert rep.stop(10)
    assert [i.step for i in memory.list("job")] == [900, 1000]
    assert [i.step for i in disk.list("job")] == [600, 900]  # 300 pruned by keep=2
    assert [i.step for i in obj.list("job")] == [500, 1000]
    assert [(e["tier"], e["step"]) for e in events.of("checkpoint_replicated")] == [
        ("disk", 300), ("object", 500), ("disk", 600), ("disk", 900), ("object", 1000)]
    assert not events.of("checkpoint_write_failed")
    assert disk.verify("job", 900).ok and obj.verify("job", 1000).ok
    rows = {(r["tier"], r["job"]): r for r in status.snapshot()}
    assert rows[("disk", "job")]["newest_step"] == 900 and rows[("disk", "job")]["writes"] == 3
    assert rows[("object", "job")]["newest_step"] == 1000 and rows[("memory", "job")]["writes"] == 10


def test_restarted_replicator_does_not_rewrite_the_same_interval(memory: MemoryTier, tmp_path: Path) -> None:
    disk = DiskTier(tmp_path / "disk")
    save(memory, 500)
    disk.write_from(memory.step_path("job", 500), "job", 500)  # written before an agent restart
    events = Events()
    rep = TierReplicator(memory, [disk], {"disk": 500}, emit=events)
    rep.start()
    save(memory, 600)
    rep.notify("job", 600)
    assert rep.wait_idle(10)
    assert events.of("checkpoint_replicated") == []
    rep.notify("job", 600, force=True)  # checkpoint-now from the plan ignores the interval
    assert rep.wait_idle(10) and rep.stop(5)
    assert [i.step for i in disk.list("job")] == [500, 600]


def test_the_same_failure_again_is_counted_not_reported_until_a_copy_succeeds(
        memory: MemoryTier, tiny_tmpfs: Path) -> None:
    disk = DiskTier(tiny_tmpfs)
    events, status = Events(), CheckpointStatus()
    rep = TierReplicator(memory, [disk], {"disk": 100}, emit=events, status=status)
    rep.start()
    for step in (100, 200, 300):
        save(memory, step, size=700_000)  # 1.4 MB: never fits in 1 MiB
        rep.notify("job", step)
        assert rep.wait_idle(10)
    assert [e["step"] for e in events.of("checkpoint_write_failed")] == [100]
    failures = sum(x.value for m in status.metrics() for x in m.samples
                   if x.name == "trainguard_checkpoint_write_failures_total" and x.labels.get("tier") == "disk")
    assert failures == 3
    save(memory, 400)  # small: fits
    rep.notify("job", 400)
    assert rep.wait_idle(10)
    assert events.of("checkpoint_replicated")
    save(memory, 500, size=700_000)
    rep.notify("job", 500)
    assert rep.wait_idle(10) and rep.stop(5)
    # After a success the same error is news again.
    assert [e["step"] for e in events.of("checkpoint_write_failed")] == [100, 500]


def test_full_disk_emits_failure_and_object_still_written(memory: MemoryTier, tiny_tmpfs: Path,
                                                          tmp_path: Path) -> None:
    disk = DiskTier(tiny_tmpfs)
    obj = ObjectTier(ObjectStoreConfig(f"file://{tmp_path}/object"))
    events, status = Events(), CheckpointStatus()
    rep = TierReplicator(memory, [disk, obj], {"disk": 100, "object": 100}, emit=events, status=status)
    rep.start()
    save(memory, 100, size=700_000)  # 1.4 MB: does not fit in 1 MiB
    rep.notify("job", 100)
    assert rep.wait_idle(10) and rep.stop(5)
    failed = events.of("checkpoint_write_failed")
    assert len(failed) == 1 and failed[0]["tier"] == "disk" and failed[0]["step"] == 100
    assert "ENOSPC" in failed[0]["error"]
    assert disk.list("job") == [] and list(tiny_tmpfs.joinpath("job").iterdir()) == []
    assert [i.step for i in obj.list("job")] == [100] and obj.verify("job", 100).ok
    assert memory.verify("job", 100).ok

    reg = CollectorRegistry()

    class _C:
        def collect(self) -> Any:
            return status.metrics()

    reg.register(_C())  # type: ignore[arg-type]
    assert reg.get_sample_value("trainguard_checkpoint_write_failures_total", {"tier": "disk"}) == 1
    assert reg.get_sample_value("trainguard_checkpoint_writes_total", {"tier": "object"}) == 1
    assert reg.get_sample_value("trainguard_checkpoint_writes_total", {"tier": "disk"}) == 0
    assert reg.get_sample_value("trainguard_checkpoint_newest_step", {"tier": "object", "job": "job"}) == 100
    assert reg.get_sample_value("trainguard_checkpoint_size_bytes", {"tier": "object", "job": "job"}) > 1_400_000
    assert reg.get_sample_value("trainguard_checkpoint_age_seconds", {"tier": "object", "job": "job"}) >= 0
    assert {m[0] for m in METRICS} >= {"trainguard_checkpoint_corrupt_total", "trainguard_checkpoint_age_seconds"}


class GatedDisk(DiskTier):
    """A real disk tier whose writes wait for a gate: stands in for a slow NVMe or network."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.gate = threading.Event()
        self.entered = threading.Event()

    def write_from(self, src_dir: Path, job: str, step: int) -> CheckpointInfo:
        self.entered.set()
        assert self.gate.wait(10)
        return super().write_from(src_dir, job, step)


def test_notify_never_blocks_and_coalesces(memory: MemoryTier, tmp_path: Path) -> None:
    memory.keep = 5
    disk = GatedDisk(tmp_path / "disk")
    events = Events()
    rep = TierReplicator(memory, [disk], {"disk": 1}, emit=events)
    rep.start()
    save(memory, 1)
    rep.notify("job", 1)
    assert disk.entered.wait(5)

    def more_saves() -> None:
        for step in (2, 3, 4):
            save(memory, step)
            rep.notify("job", step)

    # The writer is stuck until the gate opens below; the caller is not: it returns before that.
    caller = threading.Thread(target=more_saves)
    caller.start()
    caller.join(30)
    assert not caller.is_alive()
    disk.gate.set()
    assert rep.wait_idle(10) and rep.stop(5)
    assert [e["step"] for e in events.of("checkpoint_replicated")] == [1, 4]


def test_newest_restorable_prefers_fastest_tier_and_skips_corrupt(memory: MemoryTier, tmp_path: Path) -> None:
    disk = DiskTier(tmp_path / "disk")
    obj = ObjectTier(ObjectStoreConfig(f"file://{tmp_path}/object"))
    save(memory, 5)
    disk.write_from(memory.step_path("job", 5), "job", 5)
    save(memory, 10)
    for t in (disk, obj):
        t.write_from(memory.step_path("job", 10), "job", 10)
    tiers = [obj, disk, memory]  # order given must not matter
    events, status = Events(), CheckpointStatus()
    tier, info = newest_restorable("job", tiers, emit=events) or (None, None)
    assert tier is memory and info is not None and info.step == 10

    flip_byte(memory.step_path("job", 10) / "__0_0.distcp")
    tier, info = newest_restorable("job", tiers, emit=events, status=status) or (None, None)
    assert tier is disk and info is not None and info.step == 10
    corrupt = events.of("checkpoint_corrupt")
    assert corrupt[-1]["tier"] == "memory" and corrupt[-1]["step"] == 10
    assert "checksum mismatch: __0_0.distcp" in corrupt[-1]["problems"]

    (disk.step_path("job", 10) / "__1_0.distcp").unlink()
    found = newest_restorable("job", tiers, emit=events, status=status)
    assert found is not None and found[0] is obj and found[1].step == 10
    r = restore("job", tiers, tmp_path / "scratch", emit=events, status=status)
    assert r is not None and r.tier == "object" and r.fetched and r.info.step == 10
    assert (r.path / ".metadata").read_bytes() == b"step 10"
    r.release()
    assert not r.path.exists()

    flip_byte(Path(obj.fs._strip_protocol(f"{obj.job_prefix('job')}/step_10/.metadata")))
    r = restore("job", tiers, tmp_path / "scratch", emit=events, status=status)
    assert r is not None and r.tier == "memory" and r.info.step == 5 and not r.fetched
    assert r.path == memory.step_path("job", 5)
    assert status.snapshot()[0]["corrupt"] >= 1
    r.release()
    r = restore("job", tiers, tmp_path / "scratch", max_step=4)
    assert r is None


def test_in_place_restore_is_pinned_against_pruning(memory: MemoryTier, tmp_path: Path) -> None:
    memory.keep = 1
    save(memory, 1)
    r = restore("job", [memory], tmp_path / "scratch")
    assert r is not None and r.info.step == 1
    save(memory, 2)
    save(memory, 3)
    assert [i.step for i in memory.list("job")] == [1, 3]  # step 1 is being loaded by the ranks
    r.release()
    save(memory, 4)
    assert [i.step for i in memory.list("job")] == [4]


def test_replicator_config_is_validated(memory: MemoryTier, tmp_path: Path) -> None:
    disk = DiskTier(tmp_path / "d")
    with pytest.raises(ValueError, match="checkpoint.disk.interval"):
        TierReplicator(memory, [disk], {"disk": 0})
    with pytest.raises(ValueError, match="checkpoint.disk.keep"):
        TierReplicator(memory, [disk], {"disk": 5}, keep={"disk": 0})
