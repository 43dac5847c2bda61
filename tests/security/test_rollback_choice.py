"""The agent's restore choice (agent/recovery/service.py, agent/heal/rollback.py): a rollback after a loss divergence
never picks the checkpoint the diverged attempt started from, so a damaged copy cannot make the
job diverge the same way round after round; a snapshot whose tensor bytes fail their crc32 is an
event and the restore falls back to the memory tier's checkpoint."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from tests.helpers.events import EventRecorder
from trainguard.agent.checkpoint import CheckpointManager, CheckpointSettings
from trainguard.agent.checkpoint.snapshots import HEADER_BYTES, SnapshotSet, read_header, slot_path
from trainguard.agent.config import AgentConfig
from trainguard.agent.heal.counts import ActionCounts
from trainguard.agent.heal.rollback import Rollback
from trainguard.agent.recovery.service import ENV_RESTORE, RecoveryService
from trainguard.checkpoint.snapshot.writer import SnapshotWriter


class _Plans:
    def __init__(self) -> None:
        self.lr_scale = 1.0

    def get(self, job: str) -> SimpleNamespace:
        return SimpleNamespace(lr_scale=self.lr_scale)

    def update(self, job: str, change: dict[str, Any]) -> None:
        self.lr_scale = change.get("lr_scale", self.lr_scale)


def _service(tmp_path: Path) -> tuple[RecoveryService, CheckpointManager, SimpleNamespace, EventRecorder]:
    mgr = CheckpointManager(CheckpointSettings(memory_root=str(tmp_path / "shm")))
    mgr.start()
    record = SimpleNamespace(job="job", block=None, spec=SimpleNamespace(nproc=1), restore_max_step=None,
                             restored_from=None)
    events = EventRecorder()
    restarts: list[str] = []
    supervisor = SimpleNamespace(jobs={"job": record}, restart=lambda job, cause, **_: restarts.append(cause))
    counts = ActionCounts()
    rollback = Rollback(supervisor, _Plans(), events, counts, lr_factor=0.5)  # type: ignore[arg-type]
    cfg = AgentConfig()
    return (RecoveryService(lambda: cfg, events, supervisor, None, mgr, rollback, counts),  # type: ignore[arg-type]
            mgr, record, events)


def _commit(mgr: CheckpointManager, step: int) -> None:
    staged = mgr.memory.stage("job", step)
    (staged / "__0_0.distcp").write_bytes(os.urandom(1024))
    mgr.memory.commit("job", step, prune=False)


def test_rollback_never_picks_the_checkpoint_it_rolled_back_from(tmp_path: Path) -> None:
    svc, mgr, record, events = _service(tmp_path)
    try:
        _commit(mgr, 10)
        _commit(mgr, 20)
        env = svc.launch_env(record)
        assert record.restored_from["step"] == 20 and env[ENV_RESTORE].endswith("step_20")
        svc.rollback("job", "loss spike", before_step=35)
        env = svc.launch_env(record)
        assert record.restored_from["step"] == 10 and env[ENV_RESTORE].endswith("step_10")
        rollback = events.of("rollback")
        assert rollback and rollback[0]["excluded_steps"] == [20]
        # Still excluded at a later start of the same job (a crash before a newer checkpoint).
        svc.launch_env(record)
        assert record.restored_from["step"] == 10
    finally:
        mgr.stop()


def test_a_damaged_snapshot_is_an_event_and_the_checkpoint_is_restored(tmp_path: Path) -> None:
    svc, mgr, record, events = _service(tmp_path)
    try:
        _commit(mgr, 20)
        snaps = SnapshotSet(mgr.memory.root, "job")
        torch.manual_seed(0)
        model = nn.Linear(32, 32)
        writer = SnapshotWriter(str(snaps.dir), rank=0, world_size=1, attempt=0)
        writer.take(30, {"model": model}, {})
        writer.close()
        assert snaps.common_step(1) == 30
        path = next(slot_path(snaps.dir, 0, s) for s in ("a", "b")
                    if (h := read_header(slot_path(snaps.dir, 0, s))) and h.step == 30)
        with open(path, "r+b") as fh:
            fh.seek(HEADER_BYTES + 7)
            fh.write(b"\x00\x01\x02")
        svc.launch_env(record)
        assert record.restored_from["tier"] == "memory" and record.restored_from["step"] == 20
        corrupt = events.of("snapshot_corrupt")
        assert len(corrupt) == 1 and "step 30" in corrupt[0]["problem"]
    finally:
        mgr.stop()
