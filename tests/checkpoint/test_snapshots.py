"""Per-step snapshots (trainguard/checkpoint/snapshot/, agent/checkpoint/snapshots.py): a round trip of a
model, its optimizer, plain values and the RNG; two slots so a copy cut short leaves the previous
snapshot; the agent's choice of the newest step every rank holds; a full tmpfs and a state that
snapshots cannot carry are clear errors, never a SIGBUS or a half-restored state."""

from __future__ import annotations

import collections
import copy
import os
import threading
import time
import types
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from trainguard.agent.checkpoint.snapshots import (
    DONE,
    WRITING,
    SnapshotSet,
    read_header,
    slot_path,
    snapshot_dir,
)
from trainguard.checkpoint.snapshot.cost import cost_scale, overlap_pays
from trainguard.checkpoint.snapshot.errors import SnapshotError
from trainguard.checkpoint.snapshot.load import load_snapshot
from trainguard.checkpoint.snapshot.writer import SnapshotWriter, _LateCopy
from trainguard.trainer.checkpoint import TrainerState


def _trained(seed: int = 0, steps: int = 3) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(5, 8)).pow(2).mean().backward()
        opt.step()
    return model, opt


@pytest.mark.parametrize("overlap", [False, True])
def test_round_trip_restores_parameters_optimizer_plain_values_and_rng(tmp_path: Path, overlap: bool) -> None:
    """With ``overlap`` the helper thread writes the RNG state into the skeleton after ``take``
    returned and the generator went on: the state restored is the one at ``take``."""
    model, opt = _trained()
    writer = SnapshotWriter(str(tmp_path), rank=0, world_size=1, attempt=0, overlap=overlap)
    state = {"model": model, "optim": opt, "epoch": 3, "cursor": [7, 9]}
    torch.manual_seed(123)
    writer.take(4, state, {"plan": {"version": 2}})
    expected_rand = torch.rand(3)
    writer.check_restorable()
    assert writer.stats.overlapped == int(overlap)
    params = {k: v.clone() for k, v in model.state_dict().items()}
    exp_avg = [opt.state[p]["exp_avg"].clone() for p in model.parameters()]
    writer.close()

    fresh, fresh_opt = _trained(seed=1, steps=0)  # no optimizer state yet: it is made on load
    restored = {"model": fresh, "optim": fresh_opt, "epoch": 0, "cursor": []}
    meta = load_snapshot(str(tmp_path), 0, 1, 4, restored)
    assert meta == {"plan": {"version": 2}}
    assert restored["epoch"] == 3 and restored["cursor"] == [7, 9]
    for name, value in fresh.state_dict().items():
        assert torch.equal(value, params[name]), name
    assert all(torch.equal(fresh_opt.state[p]["exp_avg"], e) for p, e in zip(fresh.parameters(), exp_avg, strict=True))
    assert torch.equal(torch.rand(3), expected_rand)
    # Training goes on from the restored optimizer exactly as from the original.
    x = torch.randn(5, 8)
    for m, o in ((model, opt), (fresh, fresh_opt)):
        o.zero_grad()
        m(x).pow(2).mean().backward()
        o.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters(), strict=True))


@pytest.mark.parametrize("overlap", [False, True])
def test_each_snapshot_keeps_its_own_per_step_values_as_they_grow_and_the_layout_changes(
        tmp_path: Path, overlap: bool) -> None:
    """A slot rewrites only the skeleton's per-step part while its layout holds: values that
    change length from one snapshot to the next, and a layout that changes (an optimizer's state
    appearing), each read back as taken, in both slots."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    writer = SnapshotWriter(str(tmp_path), rank=0, world_size=1, attempt=0, overlap=overlap)
    taken = {}
    for step in range(1, 8):
        if step == 4:  # the first optimizer step: its state makes a new layout
            model(torch.randn(5, 8)).pow(2).mean().backward()
            opt.step()
        opt.param_groups[0]["lr"] = 1e-2 / step
        state = {"model": model, "optim": opt, "note": "x" * (step * 37), "seen": list(range(step))}
        writer.take(step, state, {"step": step})
        writer.wait()
        taken[step] = {k: v.clone() for k, v in model.state_dict().items()}
        for back in (step - 1, step):  # both slots: the newest and the one before it
            if back < 1:
                continue
            fresh, fresh_opt = _trained(seed=1, steps=0)
            restored = {"model": fresh, "optim": fresh_opt, "note": "", "seen": []}
            assert load_snapshot(str(tmp_path), 0, 1, back, restored) == {"step": back}
            assert restored["note"] == "x" * (back * 37) and restored["seen"] == list(range(back))
            assert fresh_opt.param_groups[0]["lr"] == pytest.approx(1e-2 / back)
            assert all(torch.equal(v, taken[back][k]) for k, v in fresh.state_dict().items())
    writer.close()


def test_a_copy_cut_short_leaves_the_previous_snapshot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, opt = _trained()
    state = {"model": model, "optim": opt}
    writer = SnapshotWriter(str(tmp_path), rank=0, world_size=1, attempt=0)
    writer.take(1, state, {})
    writer.take(2, state, {})

    def killed(*_: object, **__: object) -> None:
        raise KeyboardInterrupt("the rank dies in the middle of the copy")

    monkeypatch.setattr(torch, "_foreach_copy_", killed)
    monkeypatch.setattr(torch, "cat", killed)  # CPU tensors go by runs, one cat each
    with pytest.raises(KeyboardInterrupt):
        writer.take(3, state, {})
    headers = {s: read_header(slot_path(tmp_path, 0, s)) for s in ("a", "b")}
    assert sorted((h.state, h.step) for h in headers.values() if h) == [(WRITING, 3), (DONE, 2)]
    assert SnapshotSet(tmp_path.parent, tmp_path.name).common_step(1) is None  # not the layout SnapshotSet reads
    monkeypatch.undo()
    writer.close()
    # A new writer (the restarted rank) overwrites the unfinished slot, not step 2's.
    again = SnapshotWriter(str(tmp_path), rank=0, world_size=1, attempt=1)
    again.take(3, state, {})
    assert sorted(h.step for s in ("a", "b") if (h := read_header(slot_path(tmp_path, 0, s)))) == [2, 3]
    again.close()


def _three_rank_writers(tmp_path: Path) -> tuple[dict, Path, str, str, list[SnapshotWriter]]:
    """A trained state and one snapshot writer per rank of a 3-rank job under ``tmp_path``."""
    model, opt = _trained()
    root, job = tmp_path / "shm", "job"
    directory = str(snapshot_dir(root, job))
    writers = [SnapshotWriter(directory, rank=r, world_size=3, attempt=0) for r in range(3)]
    return {"model": model, "optim": opt}, root, job, directory, writers


def test_the_agent_picks_the_newest_step_every_rank_holds(tmp_path: Path) -> None:
    state, root, job, directory, writers = _three_rank_writers(tmp_path)
    for step in (4, 5):
        for w in writers:
            w.take(step, state, {})
    writers[0].take(6, state, {})  # rank 0 got one step further; the others died in step 6
    writers[1].take(6, state, {})
    snaps = SnapshotSet(root, job)
    assert snaps.common_step(3) == 5
    assert snaps.common_step(3, max_step=4) is None  # rank 0 holds 5 and 6 only
    assert snaps.common_step(3, max_step=5) == 5
    assert snaps.common_step(2) is None  # another world size: never a snapshot
    snaps.keep_only(5)
    assert [sorted(snaps.done_steps(r, 3)) for r in range(3)] == [[5], [5], [5]]
    for w in writers:
        w.close()
    # The restarted ranks write on from step 5 and keep it until step 6 is done.
    again = SnapshotWriter(directory, rank=0, world_size=3, attempt=1)
    again.take(6, state, {})
    assert sorted(snaps.done_steps(0, 3)) == [5, 6]
    again.close()
    snaps.clear()
    assert snaps.common_step(3) is None


class FakeClock:
    """A monotonic clock that moves only when the code under test sleeps; ``at_sleep`` runs a
    callable at the given sleep (1 = the first)."""

    def __init__(self, at_sleep: dict[int, Callable[[], object]] | None = None) -> None:
        self.now = 100.0
        self.sleeps = 0
        self.at_sleep = at_sleep or {}

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps += 1
        self.now += seconds
        if (action := self.at_sleep.get(self.sleeps)) is not None:
            action()


def test_the_agent_waits_for_a_survivor_still_copying_the_step_the_dead_rank_finished(tmp_path: Path) -> None:
    state, root, job, directory, writers = _three_rank_writers(tmp_path)
    for w in writers:
        w.take(4, state, {})
    writers[1].take(5, state, {})  # rank 1 snapshotted step 5 and died; rank 2 holds it already
    writers[2].take(5, state, {})
    snaps = SnapshotSet(root, job)
    # The agent's clock is the test's: rank 0 is still copying and finishes during the tenth wait.
    clock = FakeClock(at_sleep={10: lambda: writers[0].take(5, state, {})})
    waited = snaps.settle(dead=[1], alive=[0, 2], world_size=3, within_s=10.0, clock=clock, sleep=clock.sleep)
    assert clock.sleeps == 10 and 0 < waited < 10.0, (clock.sleeps, waited)
    assert snaps.common_step(3) == 5
    # Nothing to wait for: the survivors hold the dead rank's newest step, or it has none.
    clock = FakeClock()
    assert snaps.settle(dead=[1], alive=[0, 2], world_size=3, within_s=10.0, clock=clock, sleep=clock.sleep) == 0.0
    assert clock.sleeps == 0
    assert SnapshotSet(tmp_path / "none", job).settle(dead=[1], alive=[0], world_size=3, within_s=10.0) == 0.0
    # A survivor that never gets there costs the bound, not more.
    writers[1].take(6, state, {})
    clock = FakeClock()
    waited = snaps.settle(dead=[1], alive=[0, 2], world_size=3, within_s=0.3, clock=clock, sleep=clock.sleep)
    assert 0.3 <= waited < 0.31, waited
    assert snaps.common_step(3) == 5
    for w in writers:
        w.close()


Cursor = collections.namedtuple("Cursor", "epoch offset")


class _Sampler:
    """A per-step state of a user's own: an OrderedDict state_dict holding a tensor twice."""

    def __init__(self, seed: int) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.loaded: dict | None = None

    def state_dict(self) -> collections.OrderedDict:
        rng = self.gen.get_state()
        return collections.OrderedDict(rng=rng, again=rng, order=(3, 1, 2))

    def load_state_dict(self, state: dict) -> None:
        self.loaded = state
        self.gen.set_state(state["rng"])


def test_containers_of_a_users_own_come_back_as_plain_ones_with_their_tensors(tmp_path: Path) -> None:
    model, opt = _trained()
    sampler = _Sampler(5)
    writer = SnapshotWriter(str(tmp_path), rank=0, world_size=1, attempt=0)
    writer.take(2, {"model": model, "optim": opt, "sampler": sampler, "cursor": Cursor(1, 640)}, {})
    expected = torch.randint(0, 1000, (4,), generator=sampler.gen)
    writer.check_restorable()
    writer.close()

    fresh = _Sampler(99)
    restored = {"model": _trained(seed=1, steps=0)[0], "optim": opt, "sampler": fresh, "cursor": None}
    load_snapshot(str(tmp_path), 0, 1, 2, restored)
    assert restored["cursor"] == (1, 640) and type(restored["cursor"]) is tuple
    assert fresh.loaded is not None and type(fresh.loaded) is dict and fresh.loaded["order"] == (3, 1, 2)
    assert torch.equal(fresh.loaded["again"], fresh.loaded["rng"])
    assert torch.equal(torch.randint(0, 1000, (4,), generator=fresh.gen), expected)


class Opaque:
    """A user's object with no state_dict: snapshots carry tensors and plain Python data only."""


def test_a_state_snapshots_cannot_carry_is_named(tmp_path: Path) -> None:
    class Local:
        pass

    model, _ = _trained(steps=0)
    writer = SnapshotWriter(str(tmp_path), rank=0, world_size=1, attempt=0)
    with pytest.raises(SnapshotError, match="Local"):
        writer.take(1, {"model": model, "thing": Local()}, {})
    writer.take(1, {"model": model, "thing": Opaque()}, {})  # picklable, but not by the restricted reader
    with pytest.raises(SnapshotError, match="Opaque"):
        writer.check_restorable()
    writer.close()


def test_a_snapshot_of_another_layout_is_refused_not_half_loaded(tmp_path: Path) -> None:
    model, opt = _trained()
    writer = SnapshotWriter(str(tmp_path), rank=0, world_size=1, attempt=0)
    writer.take(1, {"model": model}, {})
    writer.close()
    with pytest.raises(SnapshotError, match="optim"):
        load_snapshot(str(tmp_path), 0, 1, 1, {"model": model, "optim": opt})
    with pytest.raises(SnapshotError, match="no complete snapshot of step 2"):
        load_snapshot(str(tmp_path), 0, 1, 2, {"model": model})
    bigger = nn.Sequential(nn.Linear(8, 32))
    with pytest.raises(SnapshotError, match="model"):
        load_snapshot(str(tmp_path), 0, 1, 1, {"model": bigger})


def test_a_full_tmpfs_is_a_clear_error_not_a_sigbus(tiny_tmpfs: Path) -> None:
    big = nn.Linear(1024, 1024)  # 4 MiB of weights: more than the 1 MiB tmpfs holds
    writer = SnapshotWriter(str(tiny_tmpfs / "snap"), rank=0, world_size=1, attempt=0)
    with pytest.raises(SnapshotError, match="no room"):
        writer.take(1, {"model": big}, {})
    writer.close()
    assert os.path.isdir(tiny_tmpfs)


def test_a_replaced_parameter_or_new_optimizer_state_is_seen_by_the_next_snapshot(tmp_path: Path) -> None:
    model, opt = _trained(steps=0)  # no optimizer state yet
    state = {"model": model, "optim": opt}
    writer = SnapshotWriter(str(tmp_path), rank=0, world_size=1, attempt=0)
    writer.take(1, state, {})
    opt.zero_grad()
    model(torch.randn(5, 8)).pow(2).mean().backward()
    opt.step()  # the optimizer's state appears
    with torch.no_grad():
        model[0].weight = nn.Parameter(torch.full_like(model[0].weight, 0.5))  # a new object, same name
    writer.take(2, state, {})
    writer.close()
    fresh, fresh_opt = _trained(seed=1, steps=0)
    load_snapshot(str(tmp_path), 0, 1, 2, {"model": fresh, "optim": fresh_opt})
    assert torch.equal(fresh[0].weight, torch.full_like(fresh[0].weight, 0.5))
    assert len(fresh_opt.state) == len(list(model.parameters())) - 0  # every parameter's Adam state came back


@pytest.mark.parametrize("overlap", [False, True])
def test_an_optimizer_rolled_back_by_load_state_dict_is_snapshotted_as_loaded(tmp_path: Path, overlap: bool) -> None:
    """A script's own rollback (``optimizer.load_state_dict`` of an older state) gives the optimizer
    new state tensors; the next snapshot holds those, not the ones it had found before."""
    model, opt = _trained(steps=2)
    older = copy.deepcopy(opt.state_dict())
    opt.zero_grad()
    model(torch.randn(5, 8)).pow(2).mean().backward()
    opt.step()
    state = {"model": model, "optim": opt}
    writer = SnapshotWriter(str(tmp_path), rank=0, world_size=1, attempt=0, overlap=overlap)
    writer.take(1, state, {})
    opt.load_state_dict(older)
    want = [{k: v.clone() for k, v in opt.state[p].items()} for p in model.parameters()]
    writer.take(2, state, {})
    writer.close()
    fresh, fresh_opt = _trained(seed=1, steps=1)
    load_snapshot(str(tmp_path), 0, 1, 2, {"model": fresh, "optim": fresh_opt})
    got = [fresh_opt.state[p] for p in fresh.parameters()]
    assert all(torch.equal(g[k], w[k]) for g, w in zip(got, want, strict=True) for k in w)


def test_a_state_mapping_built_anew_each_step_keeps_the_worked_out_copy(tmp_path: Path) -> None:
    """Only modules and optimizers must stay the same objects: a per-step wrapper of a sampler (the
    embedded trainer's) does not make every snapshot walk the model again."""

    class Position:
        def __init__(self, cursor: int) -> None:
            self.cursor = cursor

        def state_dict(self) -> dict[str, int]:
            return {"cursor": self.cursor}

    model, opt = _trained()
    writer = SnapshotWriter(str(tmp_path), rank=0, world_size=1, attempt=0)
    writer.take(1, {"model": model, "optim": opt, "pos": Position(1)}, {})
    plan = writer._plan
    writer.take(2, {"model": model, "optim": opt, "pos": Position(2)}, {})
    assert writer._plan is plan
    writer.take(3, {"model": model, "optim": opt}, {})  # another set of keys: worked out again
    assert writer._plan is not plan
    writer.close()


class _Mixed(nn.Module):
    """Tensors of several dtypes in an order that switches dtype, and a non-contiguous buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.randn(3, 5))
        self.register_buffer("count", torch.arange(7, dtype=torch.int64))
        self.b = nn.Parameter(torch.randn(11))
        self.register_buffer("low", torch.randn(9).to(torch.bfloat16))
        self.register_buffer("flag", torch.tensor([True, False, True]))
        self.c = nn.Parameter(torch.randn(2, 3))


@pytest.mark.parametrize("strided", [False, True])
def test_every_dtype_run_and_a_swapped_tensor_come_back_at_each_step(tmp_path: Path, strided: bool) -> None:
    """Stable CPU tensors go in by runs of one dtype from flat views kept between snapshots: a
    tensor whose storage was swapped under the same object (``p.data = ...``) must be read anew, and
    a non-contiguous one (no flat view) must still be copied."""
    model = _Mixed()
    if strided:
        model.count = torch.arange(14, dtype=torch.int64)[::2]  # a view with stride 2
    writer = SnapshotWriter(str(tmp_path), rank=0, world_size=1, attempt=0)
    seen: dict[int, dict[str, torch.Tensor]] = {}
    for step in range(1, 5):
        with torch.no_grad():
            model.a.add_(1.0)  # in place: the kept views see it
            model.count.add_(step)
            if step == 3:
                model.b.data = torch.full((11,), 42.0)  # the same Parameter object, new storage
        writer.take(step, {"model": model}, {})
        seen[step] = {k: v.clone() for k, v in model.state_dict().items()}
        assert set(seen[step]) == {"a", "b", "c", "count", "low", "flag"}
        fresh = _Mixed()
        if strided:
            fresh.count = torch.zeros(7, dtype=torch.int64)
        load_snapshot(str(tmp_path), 0, 1, step, {"model": fresh})
        for name, value in fresh.state_dict().items():
            assert value.dtype == seen[step][name].dtype, name
            assert torch.equal(value, seen[step][name]), (step, name)
    writer.close()


# -- overlap: the optimizer-owned tensors copied while the next step runs --------------------------
def test_the_copy_overlaps_the_next_step_only_where_a_core_is_left_for_each_ranks_helper() -> None:
    assert not overlap_pays(4, cpus=2, threads=1)  # the recovery bench: 4 ranks on 2 cores
    assert not overlap_pays(2, cpus=2, threads=1)
    assert overlap_pays(1, cpus=2, threads=1)  # one rank, one compute thread, a core to spare
    assert overlap_pays(8, cpus=96, threads=8)
    assert not overlap_pays(8, cpus=64, threads=8)
    assert overlap_pays(0, cpus=2, threads=1)  # a run that does not know its local ranks counts one


def test_a_snapshot_costs_the_job_more_where_its_ranks_outnumber_the_cores() -> None:
    assert cost_scale(4, cpus=2) == 2.0  # the recovery bench: every rank's snapshot slows all four
    assert cost_scale(3, cpus=2) == 1.5
    assert cost_scale(2, cpus=2) == 1.0  # a core each: a snapshot holds up its own rank only
    assert cost_scale(8, cpus=96) == 1.0
    assert cost_scale(0, cpus=2) == 1.0
    assert cost_scale(4, cpus=0) == 4.0  # no cores known: one




@pytest.fixture
def gated_copy(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """The helper thread's copy waits until the returned event is set (a copy still running)."""
    gate = threading.Event()
    original = _LateCopy.run

    def held(*args: object) -> None:
        assert gate.wait(30)
        original(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(_LateCopy, "run", held)
    return gate


def _states(directory: Path) -> list[tuple[int, int]]:
    """(state, step) of this rank's slots that hold a header."""
    return sorted((h.state, h.step) for s in ("a", "b") if (h := read_header(slot_path(directory, 0, s))))


def _release_after(gate: threading.Event, seconds: float) -> None:
    threading.Timer(seconds, gate.set).start()


def _restored(directory: Path, step: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    model, opt = _trained(seed=1, steps=0)
    load_snapshot(str(directory), 0, 1, step, {"model": model, "optim": opt})
    return model, opt


def test_an_overlapped_copy_holds_its_step_though_the_optimizer_steps_at_once(
        tmp_path: Path, gated_copy: threading.Event) -> None:
    model, opt = _trained()
    writer = SnapshotWriter(str(tmp_path), rank=0, world_size=1, attempt=0, overlap=True)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    avg = [opt.state[p]["exp_avg"].clone() for p in model.parameters()]
    writer.take(4, {"model": model, "optim": opt}, {})
    assert writer.stats.overlapped == 1
    # Every tensor's copy is deferred: the slot is untouched until it runs, and only complete after
    # (a crash now leaves the previous snapshot).
    assert _states(tmp_path) == []
    opt.zero_grad()
    model(torch.randn(5, 8)).pow(2).mean().backward()
    _release_after(gated_copy, 0.3)
    t0 = time.monotonic()
    opt.step()  # its pre-hook waits for the copy before changing what it copies
    assert time.monotonic() - t0 >= 0.25
    assert not torch.equal(model[0].weight, before["0.weight"])
    assert _states(tmp_path) == [(DONE, 4)]
    assert writer.stats.last_step == 4 and writer.stats.last_stall_s >= 0.25  # the wait counts as stall
    assert 0 < writer.stats.last_cost_s < 0.2  # but not as CPU spent on the snapshot
    writer.close()
    fresh, fresh_opt = _restored(tmp_path, 4)
    assert all(torch.equal(v, before[k]) for k, v in fresh.state_dict().items())
    assert all(torch.equal(fresh_opt.state[p]["exp_avg"], a) for p, a in zip(fresh.parameters(), avg, strict=True))


def test_load_state_dict_and_the_next_snapshot_wait_for_the_copy(tmp_path: Path, gated_copy: threading.Event) -> None:
    model, opt = _trained()
    state = {"model": model, "optim": opt}
    writer = SnapshotWriter(str(tmp_path), rank=0, world_size=1, attempt=0, overlap=True)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    writer.take(1, state, {})
    _release_after(gated_copy, 0.3)
    t0 = time.monotonic()
    model.load_state_dict({k: torch.zeros_like(v) for k, v in before.items()})
    assert time.monotonic() - t0 >= 0.25
    fresh, _ = _restored(tmp_path, 1)
    assert all(torch.equal(v, before[k]) for k, v in fresh.state_dict().items())
    # The next snapshot waits for the copy in flight before it picks a slot.
    gated_copy.clear()
    writer.take(2, state, {})
    _release_after(gated_copy, 0.3)
    t0 = time.monotonic()
    writer.take(3, state, {})
    assert time.monotonic() - t0 >= 0.25
    gated_copy.set()
    writer.close()  # waits for step 3's copy
    assert _states(tmp_path) == [(DONE, 2), (DONE, 3)]
    fresh, _ = _restored(tmp_path, 3)
    assert all(torch.equal(v, torch.zeros_like(v)) for v in fresh.state_dict().values())


def test_a_buffer_a_forward_updates_is_copied_before_take_returns(tmp_path: Path, gated_copy: threading.Event) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(8, 4)).sum().backward()
    opt.step()
    writer = SnapshotWriter(str(tmp_path), rank=0, world_size=1, attempt=0, overlap=True)
    running = model[1].running_mean.clone()
    writer.take(1, {"model": model, "optim": opt}, {})
    assert writer._plan is not None and sum(writer._plan.deferred) == 4  # the parameters, not the buffers
    model(torch.randn(8, 4) + 5)  # the next step's forward moves the running mean in place
    assert not torch.equal(model[1].running_mean, running)
    gated_copy.set()
    writer.close()
    fresh = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    load_snapshot(str(tmp_path), 0, 1, 1, {"model": fresh, "optim": torch.optim.SGD(fresh.parameters(), lr=0.1)})
    assert torch.equal(fresh[1].running_mean, running)


def test_an_optimizer_trainguard_does_not_know_is_copied_at_once(tmp_path: Path) -> None:
    class Custom(torch.optim.SGD):  # its own module: it might change parameters outside step()
        pass

    model = nn.Linear(4, 4)
    opt = Custom(model.parameters(), lr=0.1)
    writer = SnapshotWriter(str(tmp_path), rank=0, world_size=1, attempt=0, overlap=True)
    writer.take(1, {"model": model, "optim": opt}, {})
    assert writer.stats.overlapped == 0 and writer._plan is not None and writer._plan.deferred == ()
    assert _states(tmp_path) == [(DONE, 1)]
    writer.close()


def test_a_failed_copy_is_named_at_the_next_snapshot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, opt = _trained()
    state = {"model": model, "optim": opt}
    writer = SnapshotWriter(str(tmp_path), rank=0, world_size=1, attempt=0, overlap=True)
    writer.take(1, state, {})
    writer.wait()

    def broken(*_: object) -> None:
        raise OSError("the copy failed")

    monkeypatch.setattr(_LateCopy, "run", broken)
    writer.take(2, state, {})
    with pytest.raises(SnapshotError, match="copy of the previous snapshot failed: OSError"):
        writer.take(3, state, {})
    assert _states(tmp_path) == [(DONE, 1)]  # the failed copy never touched its slot
    writer.close()


def test_a_fork_waits_for_the_copy(tmp_path: Path, gated_copy: threading.Event) -> None:
    model, opt = _trained()
    writer = SnapshotWriter(str(tmp_path), rank=0, world_size=1, attempt=0, overlap=True)
    writer.take(1, {"model": model, "optim": opt}, {})
    _release_after(gated_copy, 0.3)
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    assert time.monotonic() - t0 >= 0.25
    os.waitpid(pid, 0)
    assert _states(tmp_path) == [(DONE, 1)]
    writer.close()


def _new_storage(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    model[0].weight.data = torch.full_like(model[0].weight, 3.0)  # the same Parameter object


def _new_parameter(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    model[0].weight = nn.Parameter(torch.full_like(model[0].weight, 3.0))  # another object in the module


def _new_optimizer_state(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    entry = opt.state[model[0].weight]
    entry["exp_avg"] = torch.full_like(entry["exp_avg"], 3.0)


@pytest.mark.parametrize("swap", [_new_storage, _new_parameter, _new_optimizer_state])
def test_tensors_swapped_before_the_copy_skip_that_snapshot_and_the_next_sees_them(
        tmp_path: Path, gated_copy: threading.Event, swap: Callable[[nn.Module, torch.optim.Optimizer], None]) -> None:
    model, opt = _trained()
    state = {"model": model, "optim": opt}
    writer = SnapshotWriter(str(tmp_path), rank=0, world_size=1, attempt=0, overlap=True)
    writer.take(1, state, {})
    gated_copy.set()
    writer.wait()
    gated_copy.clear()
    writer.take(2, state, {})
    swap(model, opt)
    gated_copy.set()
    writer.wait()
    assert writer.stats.skipped == 1 and writer.stats.last_step == 1
    assert _states(tmp_path) == [(DONE, 1)]  # step 2 was not recorded, step 1 stands
    writer.take(3, state, {})
    writer.close()
    fresh, fresh_opt = _restored(tmp_path, 3)
    if swap is _new_optimizer_state:
        restored = fresh_opt.state[fresh[0].weight]["exp_avg"]
        assert torch.equal(restored, torch.full_like(restored, 3.0))
    else:
        assert torch.equal(fresh[0].weight, torch.full_like(fresh[0].weight, 3.0))


def test_meta_with_values_of_their_own_equality_comes_back_from_each_snapshot(tmp_path: Path) -> None:
    """The meta is pickled once while it stays equal; a value whose ``==`` is no plain answer (a
    tensor) neither breaks that comparison nor leaves an older meta in a snapshot."""
    model, opt = _trained()
    state = {"model": model, "optim": opt}
    writer = SnapshotWriter(str(tmp_path), rank=0, world_size=1, attempt=0)
    for step in (1, 2, 3):
        writer.take(step, state, {"plan": {"version": step // 2}, "scale": [step]})
    writer.close()
    fresh, fresh_opt = _trained(seed=1)
    assert load_snapshot(str(tmp_path), 0, 1, 3, {"model": fresh, "optim": fresh_opt}) == {
        "plan": {"version": 1}, "scale": [3]}
    odd = SnapshotWriter(str(tmp_path / "odd"), rank=0, world_size=1, attempt=0)
    for step in (1, 2):  # comparing two of these metas raises in torch: pickled anew, not a failure
        odd.take(step, state, {"weights": torch.ones(3)})
    odd.close()


def test_the_trainers_snapshot_view_is_kept_while_its_stages_and_optimizers_stay_the_same() -> None:
    """``TrainerState.snapshot_state`` gives the same mapping from step to step, and a new one as
    soon as a stage or an optimizer is another object (a re-planned trainer builds new ones)."""
    model, opt = _trained(steps=0)
    trainer = types.SimpleNamespace(chunks=[model], optimizers=[opt], sampler=None)
    state = TrainerState(trainer)  # type: ignore[arg-type]
    first = state.snapshot_state()
    assert first["stage0"] is model and first["optim0"] is opt and state.snapshot_state() is first
    other = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer.optimizers = [other]
    second = state.snapshot_state()
    assert second is not first and second["optim0"] is other and second["stage0"] is model
    trainer.chunks = [model, nn.Linear(2, 2)]
    assert state.snapshot_state().keys() == {"stage0", "stage1", "optim0", "sampler"}
