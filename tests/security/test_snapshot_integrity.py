"""Snapshot integrity (agent/checkpoint/snapshots.py, trainguard/checkpoint/snapshot/):
a forged header whose sizes the slot file cannot hold is a counted skip, never a MemoryError in
the agent's thread; tensor bytes damaged in a slot after the snapshot are caught by their crc32,
by the agent (the slot is emptied, the older snapshot or the checkpoint restored) and by the
rank's own loader (it falls back to the checkpoint)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch
from torch import nn

from trainguard.agent.checkpoint import snapshots as snaps_mod
from trainguard.agent.checkpoint.snapshots import (
    DONE,
    HEADER_BYTES,
    SlotHeader,
    SnapshotSet,
    read_done,
    read_header,
    slot_path,
)
from trainguard.checkpoint.snapshot.errors import SnapshotError
from trainguard.checkpoint.snapshot.load import load_snapshot
from trainguard.checkpoint.snapshot.writer import SnapshotWriter


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return model, opt


def _snapshots(root: Path, steps: list[int], overlap: bool = False) -> tuple[Path, dict[int, torch.Tensor]]:
    """Snapshots of a model whose weight changes before each; returns the weight at each step."""
    directory = root / ".snapshots" / "job"
    model, opt = _model()
    writer = SnapshotWriter(str(directory), rank=0, world_size=1, attempt=0, overlap=overlap)
    weights = {}
    for step in steps:
        with torch.no_grad():
            model.weight.add_(1.0)
        weights[step] = model.weight.detach().clone()
        writer.take(step, {"model": model, "optim": opt}, {})
        writer.wait()  # the weight changes outside the optimizer next: the deferred copy first
    writer.close()  # waits for the copy and the crc32 of the newest slot
    return directory, weights


def test_forged_huge_skeleton_bytes_is_a_counted_skip_not_a_memory_error(tmp_path: Path) -> None:
    directory = tmp_path / ".snapshots" / "job"
    directory.mkdir(parents=True)
    forged = SlotHeader(DONE, 9, 0, 1, 0, payload_bytes=0, skeleton_bytes=1 << 60, skeleton_crc=0)
    slot_path(directory, 0, "a").write_bytes(forged.pack().ljust(HEADER_BYTES, b"\0"))
    before = snaps_mod.REJECTED["header_bounds"]
    problems: list[str] = []
    assert read_done(slot_path(directory, 0, "a"), problems=problems) is None
    assert snaps_mod.REJECTED["header_bounds"] == before + 1
    assert len(problems) == 1 and "header out of bounds" in problems[0]
    # The agent's choice, on the thread that makes it: no exception, no snapshot.
    result: list[object] = []
    errors: list[BaseException] = []

    def choose() -> None:
        try:
            result.append(SnapshotSet(tmp_path, "job").common_step(1, verify=True))
        except BaseException as exc:  # noqa: BLE001 - the test's point: nothing escapes
            errors.append(exc)

    t = threading.Thread(target=choose)
    t.start()
    t.join(30)
    assert errors == [] and result == [None]


def test_payload_crc_is_recorded_once_the_slot_is_done(tmp_path: Path) -> None:
    directory, _ = _snapshots(tmp_path, [1, 2])
    for slot in ("a", "b"):
        header = read_header(slot_path(directory, 0, slot))
        assert header is not None and header.state == DONE and header.payload_summed == 1


@pytest.mark.parametrize("overlap", [False, True])
def test_damaged_tensor_bytes_are_caught_and_the_older_snapshot_is_used(tmp_path: Path, overlap: bool) -> None:
    directory, weights = _snapshots(tmp_path, [1, 2], overlap=overlap)
    newest = next(s for s in ("a", "b") if (h := read_header(slot_path(directory, 0, s))) and h.step == 2)
    path = slot_path(directory, 0, newest)
    with open(path, "r+b") as fh:  # a bit flipped in shared memory after the snapshot
        fh.seek(HEADER_BYTES + 100)
        byte = fh.read(1)
        fh.seek(HEADER_BYTES + 100)
        fh.write(bytes([byte[0] ^ 0x10]))
    # The rank's loader refuses it (Run then restores the checkpoint instead).
    fresh, opt = _model()
    with pytest.raises(SnapshotError, match="damaged"):
        load_snapshot(str(directory), 0, 1, 2, {"model": fresh, "optim": opt})
    # The agent's choice skips it, tells why, and empties the slot so no later start uses it.
    before = snaps_mod.REJECTED["payload_crc"]
    snaps = SnapshotSet(tmp_path, "job")
    assert snaps.common_step(1, verify=True) == 1
    assert snaps_mod.REJECTED["payload_crc"] == before + 1
    assert any("step 2" in p and "damaged" in p for p in snaps.problems)
    header = read_header(path)
    assert header is not None and header.state != DONE
    # The older snapshot is intact and restores.
    load_snapshot(str(directory), 0, 1, 1, {"model": fresh, "optim": opt})
    assert torch.equal(fresh.weight, weights[1])


def test_without_verify_the_damage_is_not_looked_for(tmp_path: Path) -> None:
    """The crc32 check is what catches it: the header alone still says the slot is complete."""
    directory, _ = _snapshots(tmp_path, [1, 2])
    path = next(slot_path(directory, 0, s) for s in ("a", "b")
                if (h := read_header(slot_path(directory, 0, s))) and h.step == 2)
    with open(path, "r+b") as fh:
        fh.seek(HEADER_BYTES + 5)
        fh.write(b"\xff\xff")
    assert SnapshotSet(tmp_path, "job").common_step(1) == 2
    assert os.path.exists(path)


def test_above_the_agents_limit_the_rank_loader_is_the_check(tmp_path: Path) -> None:
    directory, _ = _snapshots(tmp_path, [1, 2])
    path = next(slot_path(directory, 0, s) for s in ("a", "b")
                if (h := read_header(slot_path(directory, 0, s))) and h.step == 2)
    with open(path, "r+b") as fh:
        fh.seek(HEADER_BYTES + 9)
        fh.write(b"\xaa")
    snaps = SnapshotSet(tmp_path, "job")
    snaps.verify_max_bytes = 16  # a state too large for the agent to sum before a restart
    assert snaps.common_step(1, verify=True) == 2 and snaps.problems == []
    fresh, opt = _model()
    with pytest.raises(SnapshotError, match="damaged"):
        load_snapshot(str(directory), 0, 1, 2, {"model": fresh, "optim": opt})
