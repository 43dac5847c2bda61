"""CheckpointManager end to end on real tiers: a trainer-like process (no torch) stages and
commits into the memory tier, the agent's poll replicates it; an agent restart finds the disk
copies; restore falls back to disk when shared memory was wiped."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from trainguard.agent.checkpoint import CheckpointManager, CheckpointSettings, ObjectStoreConfig

REPO = Path(__file__).resolve().parents[2]

TRAINER = textwrap.dedent("""
    import os, sys
    from trainguard.agent.checkpoint.memory import MemoryTier, open_for_overwrite
    root, job, steps = sys.argv[1], sys.argv[2], [int(s) for s in sys.argv[3:]]
    tier = MemoryTier(root)
    for step in steps:
        path = tier.stage(job, step)              # rank 0 stages and broadcasts the path
        for rank in range(2):                     # each rank writes its shard
            with open_for_overwrite(os.path.join(path, f"__{rank}_0.distcp")) as f:
                f.write(bytes([step % 251]) * 50_000)
        with open_for_overwrite(os.path.join(path, ".metadata")) as f:
            f.write(f"meta {step}".encode())
        tier.commit(job, step, {"world_size": 2}, staged=path, prune=False)
    assert "torch" not in sys.modules
    print("ok")
""")


class Events:
    def __init__(self) -> None:
        self.items: list[tuple[str, dict[str, Any]]] = []

    def __call__(self, kind: str, fields: dict[str, Any]) -> None:
        self.items.append((kind, fields))

    def kinds(self) -> list[str]:
        return [k for k, _ in self.items]


@pytest.fixture
def settings(tmp_path: Path) -> Iterator[CheckpointSettings]:
    shm = Path("/dev/shm") / f"trainguard-test-{uuid.uuid4().hex}"
    yield CheckpointSettings(memory_root=str(shm), memory_keep=2, disk_dir=str(tmp_path / "disk"),
                             disk_interval=200, disk_keep=2,
                             object_store=ObjectStoreConfig(f"file://{tmp_path}/object"), object_interval=400)
    subprocess.run(["rm", "-rf", str(shm)], check=False)


def run_trainer(settings: CheckpointSettings, *steps: int) -> None:
    out = subprocess.run([sys.executable, "-c", TRAINER, settings.memory_root, "job", *map(str, steps)],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_trainer_commits_agent_replicates_and_restores(settings: CheckpointSettings) -> None:
    events = Events()
    mgr = CheckpointManager(settings, emit=events)
    mgr.start()
    try:
        run_trainer(settings, 100, 200, 300, 400)
        mgr.poll()
        assert mgr.replicator.wait_idle(10)
        assert mgr.disk is not None and mgr.object is not None
        assert [i.step for i in mgr.memory.list("job")] == [300, 400]  # pruned by the agent
        assert [i.step for i in mgr.disk.list("job")] == [400]  # newest memory checkpoint only
        assert [i.step for i in mgr.object.list("job")] == [400]
        r = mgr.restore("job")
        assert r is not None and r.tier == "memory" and r.info.step == 400 and not r.fetched
        assert (r.path / "__1_0.distcp").read_bytes() == bytes([400 % 251]) * 50_000
        r.release()
        rows = {r["tier"]: r for r in mgr.status_rows()}
        assert rows["memory"]["newest_step"] == 400 and rows["disk"]["newest_step"] == 400
        assert {c["tier"] for c in mgr.catalog("job")} == {"memory", "disk", "object"}
        assert "checkpoint_replicated" in events.kinds()
    finally:
        assert mgr.stop(10)


def test_agent_restart_then_memory_lost(settings: CheckpointSettings) -> None:
    mgr = CheckpointManager(settings)
    mgr.start()
    run_trainer(settings, 200)
    mgr.poll()
    assert mgr.replicator.wait_idle(10) and mgr.stop(10)
    # The agent dies mid-save: a staging directory is left behind in shared memory.
    leftover = Path(settings.memory_root) / "job" / ".tmp-step_300-abc"
    leftover.mkdir()
    (leftover / "__0_0.distcp").write_bytes(b"half")

    events = Events()
    mgr2 = CheckpointManager(settings, emit=events)
    mgr2.start()
    try:
        assert not leftover.exists() and "checkpoint_tmp_cleaned" in events.kinds()
        rows = {r["tier"]: r for r in mgr2.status_rows()}
        assert rows["disk"]["newest_step"] == 200 and rows["object"]["newest_step"] is None  # 200 < 400
        subprocess.run(["rm", "-rf", os.path.join(settings.memory_root, "job")], check=True)  # reboot
        r = mgr2.restore("job")
        assert r is not None and r.tier == "disk" and r.info.step == 200
        assert (r.path / ".metadata").read_bytes() == b"meta 200"
        r.release()
    finally:
        mgr2.stop(10)


def test_settings_name_the_bad_key() -> None:
    with pytest.raises(ValueError, match="checkpoint.disk_interval"):
        CheckpointSettings(disk_interval=0)
    with pytest.raises(ValueError, match="checkpoint.memory_root"):
        CheckpointSettings(memory_root="relative")


def test_poll_reads_an_unchanged_job_once_and_prunes_what_a_restore_held(settings: CheckpointSettings) -> None:
    events = Events()
    mgr = CheckpointManager(settings, emit=events)
    mgr.start()
    lists: list[str] = []
    polled: list[str] = []  # the reads made by poll itself (the replicator's thread reads too)
    listing = mgr.memory.list
    me = threading.get_ident()

    def counted(job: str) -> Any:
        lists.append(job)
        if threading.get_ident() == me:
            polled.append(job)
        return listing(job)

    mgr.memory.list = counted  # type: ignore[method-assign]
    try:
        run_trainer(settings, 100, 200)
        time.sleep(0.1)  # older than the stamp's settling time
        mgr.poll()
        assert mgr.replicator.wait_idle(10)
        assert [i.step for i in listing("job")] == [100, 200] and lists
        read = len(lists)
        for _ in range(3):
            mgr.poll()
        assert len(lists) == read, "an unchanged job directory is not read again"
        held = mgr.restore("job")  # a restore reading step 200 holds it
        assert held is not None and held.info.step == 200
        run_trainer(settings, 300, 400)
        time.sleep(0.1)
        before = len(polled)
        mgr.poll()
        assert len(polled) - before == 1, "a changed job's checkpoints are read once a poll, pruning included"
        assert [f["step"] for k, f in events.items if k == "checkpoint_committed"] == [200, 400]
        assert [i.step for i in listing("job")] == [200, 300, 400]  # 200 is being read
        time.sleep(0.1)
        mgr.poll()  # a poll that deletes nothing while 200 is held
        held.release()
        mgr.poll()  # the directory did not change, but 200 was left to prune
        assert [i.step for i in listing("job")] == [300, 400]
    finally:
        assert mgr.stop(10)
