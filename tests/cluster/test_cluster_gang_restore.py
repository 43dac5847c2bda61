"""Finding and assembling the parts of a spanning job's checkpoint with real tiers (memory tier,
held peer copies, a file:// object tier): the newest complete step, the fallback past a corrupt
copy to the next holder, and to an older step when no holder has a good copy."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from trainguard.agent.checkpoint.errors import CheckpointError
from trainguard.agent.checkpoint.memory import MemoryTier
from trainguard.agent.checkpoint.objectstore import ObjectStoreConfig, ObjectTier
from trainguard.agent.cluster.blobstore import BlobStore
from trainguard.agent.cluster.gang import Gang, GangCoordinator
from trainguard.agent.cluster.jobs import JobRecordDoc
from trainguard.agent.cluster.membership import NodeInfo
from trainguard.agent.wire import part_key


def _write_part(tier: MemoryTier, node: str, step: int, ranks: range, parts: list[str]) -> Path:
    staged = tier.stage(part_key("job", node), step)
    for r in ranks:
        (staged / f"__{r}_0.distcp").write_bytes(bytes([r, step % 256]) * 4096)
    if 0 in ranks:
        (staged / ".metadata").write_bytes(b"meta-%d" % step)
    tier.commit(part_key("job", node), step, {"job": "job", "part": node, "parts": parts}, staged=staged)
    return tier.step_path(part_key("job", node), step)


@pytest.fixture
def survivor(tmp_path: Path) -> dict[str, Any]:
    """Node b after node a was lost: b's own memory tier, b's held copies of a's parts, and a
    shared object tier that a also uploaded to."""
    a_mem, b_mem = MemoryTier(tmp_path / "a-shm"), MemoryTier(tmp_path / "b-shm")
    store = BlobStore(tmp_path / "b-held", own_node="b", own_root=tmp_path / "b-shm")
    obj = ObjectTier(ObjectStoreConfig(url=f"file://{tmp_path / 'bucket'}"))
    for step in (4, 8):
        written = _write_part(a_mem, "a", step, range(0, 2), ["a", "b"])
        store.held("a").write_from(written, part_key("job", "a"), step)  # the peer tier's copy on b
        _write_part(b_mem, "b", step, range(2, 4), ["a", "b"])
    obj.write_from(a_mem.step_path(part_key("job", "a"), 8), part_key("job", "a"), 8)
    events: list[tuple[str, str]] = []
    gang = GangCoordinator("b", None, store, lambda peer: None, scratch=str(tmp_path / "assembled"),  # type: ignore[arg-type]
                           emit=lambda kind, msg, fields: events.append((kind, msg)), is_leader=lambda: True,
                           members=lambda: {"b": NodeInfo("b", "127.0.0.1:1", 2, 0.0)}, wake=lambda: None)
    return {"gang": gang, "store": store, "obj": obj, "events": events, "a_mem": a_mem}


def _find(gang: GangCoordinator, max_step: int | None = None) -> tuple[int, dict[str, list[str]]]:
    rec = JobRecordDoc("job", {}, "b", gang=Gang(nodes_seen=["a", "b"]).to_dict())
    return gang.find_restore(rec, Gang(nodes_seen=["a", "b"]), {"b": "127.0.0.1:1"}, max_step)


def _corrupt(path: Path) -> None:
    victim = path / "__1_0.distcp"
    data = bytearray(victim.read_bytes())
    data[100] ^= 0xFF
    victim.write_bytes(bytes(data))


def test_newest_complete_step_with_every_holder_listed_best_first(survivor: dict[str, Any]) -> None:
    survivor["gang"].shared_tiers = [survivor["obj"]]
    step, sources = _find(survivor["gang"])
    assert step == 8 and sources == {"a": ["b", "tier:object"], "b": ["b"]}
    path, used = survivor["gang"].assemble("job", step, sources)
    assert used == {"a": "b", "b": "b"}
    assert sorted(p.name for p in path.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp",
                                                      "__2_0.distcp", "__3_0.distcp"]
    assert (path / "__3_0.distcp").read_bytes() == bytes([3, 8]) * 4096


def test_corrupt_peer_copy_falls_back_to_the_object_tier(survivor: dict[str, Any]) -> None:
    survivor["gang"].shared_tiers = [survivor["obj"]]
    _corrupt(survivor["store"].held("a").step_path(part_key("job", "a"), 8))
    step, sources = _find(survivor["gang"])
    path, used = survivor["gang"].assemble("job", step, sources)
    assert used == {"a": "tier:object", "b": "b"}
    assert (path / "__1_0.distcp").read_bytes() == bytes([1, 8]) * 4096  # the good bytes, not the flipped ones
    assert [k for k, _ in survivor["events"]] == ["checkpoint_part_unusable"]


def test_no_good_copy_means_an_older_step(survivor: dict[str, Any]) -> None:
    gang = survivor["gang"]  # no object tier this time
    _corrupt(survivor["store"].held("a").step_path(part_key("job", "a"), 8))
    step, sources = _find(gang)
    assert step == 8  # listed: corruption shows only when the bytes are read
    with pytest.raises(CheckpointError, match="no usable copy of part a"):
        gang.assemble("job", step, sources)
    # the node reports bad_step=8; the leader asks again for steps before it
    step, sources = _find(gang, max_step=7)
    path, used = gang.assemble("job", step, sources)
    assert step == 4 and used == {"a": "b", "b": "b"} and (path / "__0_0.distcp").read_bytes() == bytes([0, 4]) * 4096


def test_block_that_would_split_a_tp_group_is_not_started(survivor: dict[str, Any]) -> None:
    gang: GangCoordinator = survivor["gang"]
    gang.supervisor = object()  # type: ignore[assignment]  # must not be reached
    g = Gang(attempt=1, blocks=[["a", 0, 1], ["b", 1, 3]], dp=2, tp=2, master_addr="127.0.0.1", master_port=1)
    rec = JobRecordDoc("job", {"job": "job", "nproc": 4}, "a", gang=g.to_dict())
    gang._start_block(rec, g, (1, 1, 3))
    assert [k for k, _ in survivor["events"]] == ["gang_placement_refused"]
    assert "split a tp=2 group" in survivor["events"][0][1]


def test_new_rank_zero_node_starts_from_the_carried_plan(survivor: dict[str, Any], tmp_path: Path) -> None:
    from trainguard.agent.lifecycle.plans import PlanStore

    gang: GangCoordinator = survivor["gang"]
    gang.plans = PlanStore(str(tmp_path / "plans"))
    spec = {"job": "job", "nproc": 2, "trainer": {"global_batch": 8, "parallel": {"dp": 2}}}
    rec = JobRecordDoc("job", spec, "b", plan={"lr_scale": 2.0, "lr": None, "batch_sizes": [10, 6]})
    gang._carry_plan(rec, Gang(attempt=3, dp=2))  # same dp: the split is kept as it was
    plan = gang.plans.get("job")
    assert plan.lr_scale == 2.0 and plan.batch_sizes == [10, 6]
    # dp changed (on a node that starts the job afresh): the split is dropped, so the global batch
    # returns to the configured 8 from 16, and the LR scale follows by sqrt(8/16)
    fresh = PlanStore(str(tmp_path / "plans2"))
    gang.plans = fresh
    gang._carry_plan(rec, Gang(attempt=4, dp=1))
    assert fresh.get("job").batch_sizes is None and fresh.get("job").lr_scale == pytest.approx(2.0 * (8 / 16) ** 0.5)


def test_a_node_that_cannot_start_its_ranks_asks_for_a_restart_instead_of_going_quiet(survivor: dict[str, Any]) -> None:
    from types import SimpleNamespace

    gang: GangCoordinator = survivor["gang"]

    def refuse(spec: Any, **kw: Any) -> None:
        raise OSError("no space left on device")

    gang.supervisor = SimpleNamespace(jobs={}, submit=refuse)  # type: ignore[assignment]
    g = Gang(attempt=2, blocks=[["a", 0, 1], ["b", 1, 1]], dp=2, master_addr="127.0.0.1", master_port=1)
    rec = JobRecordDoc("job", {"job": "job", "nproc": 2, "nodes": 2}, "a", gang=g.to_dict())
    gang._start_block(rec, g, (1, 1, 1))
    assert [k for k, _ in survivor["events"]] == ["gang_start_failed"]
    req = gang._requests["job"]
    assert req["attempt"] == 2 and "could not start its ranks" in req["cause"] and req["bad_step"] is None


def test_assemble_never_follows_a_symlink_planted_in_its_scratch_tree(survivor: dict[str, Any], tmp_path: Path) -> None:
    """Whoever can write the scratch tree plants ``<scratch>/job`` as a link to a directory of
    someone else's: assemble removes the link itself, never the files behind it, and a job id
    that is a path is refused before anything is touched."""
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("precious")
    scratch = Path(survivor["gang"].scratch)
    scratch.mkdir(parents=True, exist_ok=True)
    (scratch / "job").symlink_to(victim)
    step, sources = _find(survivor["gang"])
    path, used = survivor["gang"].assemble("job", step, sources)
    assert (victim / "keep.txt").read_text() == "precious" and sorted(p.name for p in victim.iterdir()) == ["keep.txt"]
    assert not (scratch / "job").is_symlink() and path.is_relative_to(scratch / "job")
    with pytest.raises(CheckpointError, match="not a valid name"):
        survivor["gang"].assemble("../victim", step, sources)
    assert (victim / "keep.txt").exists()
