"""The public Python API (``trainguard.init`` / ``Run``): a no-op without an agent, real telemetry
over a real socket, one plan version at the same step on every rank of a real gloo job, exact
gradients with uneven batches, checkpoints of any state into a real memory tier and restore into
another world size."""

from __future__ import annotations

import itertools
import math
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import trainguard
from bench.trainjobs import TelemetryCapture
from tests.conftest import join_ranks
from trainguard.agent.checkpoint.memory import MemoryTier
from trainguard.agent.checkpoint.snapshots import SnapshotSet, snapshot_dir
from trainguard.agent.lifecycle.launcher import free_port
from trainguard.agent.wire import Plan, write_plan_file
from trainguard.run.environment import SNAPSHOT_AUTO, RunEnvironment
from trainguard.run.plansync import MAX_GAP, SYNC_TARGET_S
from trainguard.run.run import Run
from trainguard.run.snapshot_cadence import SNAPSHOT_COST_WINDOW, SNAPSHOT_EARLY_MIN


def test_no_agent_is_a_working_no_op(tmp_path: Path) -> None:
    run = trainguard.init(environ={"HOME": str(tmp_path)})
    assert not run.has_agent and run.rank == 0 and run.world_size == 1
    model = nn.Linear(2, 1)
    state = {"model": model}
    assert run.restore(state) == 0
    for step in range(3):
        with run.step(step, samples=4) as s:
            with s.phase("compute"):
                model(torch.zeros(4, 2)).sum().backward()
            s.report(loss=float("nan"), lr=float("inf"), grad_norm=None)  # junk never raises
        assert run.checkpoint(step, state) is False
    assert run.plan == trainguard.RunPlan() and run.plan.lr_for(0.1) == 0.1
    run.close()


def test_a_failing_step_is_not_reported(tmp_path: Path) -> None:
    sock = str(tmp_path / "t.sock")
    cap = TelemetryCapture(sock)
    try:
        run = trainguard.init(environ={"TRAINGUARD_SOCKET": sock, "TRAINGUARD_JOB": "j"})
        with pytest.raises(ZeroDivisionError), run.step(0, samples=1):
            1 / 0  # noqa: B018
        with run.step(1, samples=2) as s:
            with s.phase("compute"):
                t0 = time.thread_time()
                while time.thread_time() - t0 < 0.03:
                    pass
            with s.phase("comm"):
                time.sleep(0.05)
            with s.phase("optim"):
                time.sleep(0.02)  # waiting inside the optimizer is not compute either
        deadline = time.monotonic() + 3
        while not cap.messages and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        cap.close()
    [msg] = cap.messages
    assert msg.step == 2 and msg.samples == 2 and msg.job == "j" and msg.pid == os.getpid()
    assert not msg.has_loss and math.isnan(msg.loss)
    assert 0.025 <= msg.fwd_bwd_s <= 0.06 and msg.opt_s < 0.01
    assert msg.comm_s >= 0.065 and msg.step_s >= 0.1


def test_loss_weight_and_batch_size_follow_the_plan(tmp_path: Path) -> None:
    plan_path = str(tmp_path / "plan.json")
    write_plan_file(plan_path, Plan(version=3, batch_sizes=[12, 4], lr_scale=0.5, checkpoint_id=1))
    env = {"TRAINGUARD_PLAN": plan_path, "RANK": "1", "WORLD_SIZE": "2"}
    run = trainguard.init(batch_size=8, environ=env)
    assert run.plan.batch_size == 8 and run.plan.loss_weight == 1.0
    loss = torch.tensor(3.0, requires_grad=True) * 1.0
    assert run.step(0).weighted(loss) is loss  # an even split: no multiply, no backward node
    run._start()  # no process group: rank reads the plan itself
    p = run.plan
    assert p.version == 3 and p.batch_size == 4 and p.batch_sizes == (12, 4)
    assert p.loss_weight == pytest.approx(2 * 4 / 16) and p.lr_for(0.2) == pytest.approx(0.1)
    assert run.step(0).weighted(loss).item() == pytest.approx(3.0 * 0.5)
    assert p.checkpoint_now  # no checkpoint answered that request yet
    write_plan_file(plan_path, Plan(version=4, batch_sizes=[1, 2, 3]))  # a split for another world size
    run._after_step(run.step(0), 0.0, 0.0)
    assert run.plan.version == 4 and run.plan.batch_size == 8 and run.plan.batch_sizes is None


# --- real gloo jobs, forked ------------------------------------------------------------------


def _spawn(fn: Any, nproc: int, *args: Any) -> None:
    port = free_port()
    join_ranks(mp.start_processes(fn, args=(nproc, port, *args), nprocs=nproc, start_method="fork", join=False),
               fn.__name__)


def _init(rank: int, nproc: int, port: int, extra: dict[str, str]) -> None:
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), **extra})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=nproc)


def _plan_ranks(rank: int, nproc: int, port: int, plan_path: str, out_dir: str, steps: int, write_at: int,
                step_sleep: float) -> None:
    _init(rank, nproc, port, {"TRAINGUARD_PLAN": plan_path, "TRAINGUARD_JOB": "p"})
    run = trainguard.init()
    seen = []
    t = torch.zeros(1)
    for step in range(steps):
        with run.step(step):
            if rank == 0 and step == write_at:
                write_plan_file(plan_path, Plan(version=9, lr_scale=0.25, reason="test"))
            time.sleep(step_sleep + (0.003 if rank == 1 else 0.0))  # the ranks drift apart within a step, as real ones do
            dist.all_reduce(t)
        seen.append(run.plan.version)
    Path(out_dir, f"rank{rank}").write_text(",".join(map(str, seen)))
    Path(out_dir, f"points{rank}").write_text(str(run._sync.points))
    dist.destroy_process_group()


def _plan_job(tmp_path: Path, steps: int, write_at: int, step_sleep: float) -> tuple[list[int], list[int]]:
    """Run ``_plan_ranks`` on 2 ranks: (plan versions per step, the same on every rank; sync points per rank)."""
    plan_path = str(tmp_path / "plan.json")
    write_plan_file(plan_path, Plan(version=1))
    _spawn(_plan_ranks, 2, plan_path, str(tmp_path), steps, write_at, step_sleep)
    seen = [(tmp_path / f"rank{r}").read_text() for r in (0, 1)]
    assert seen[0] == seen[1], seen
    versions = [int(v) for v in seen[0].split(",")]
    assert versions[0] == 1 and versions[-1] == 9
    return versions, [int((tmp_path / f"points{r}").read_text()) for r in (0, 1)]


@pytest.mark.parametrize("world, rank, want, weight", [(1, 0, 16, 1.0), (3, 0, 6, 18 / 16), (3, 2, 5, 15 / 16)])
def test_a_checkpoint_of_another_world_keeps_its_global_batch(world: int, rank: int, want: int, weight: float) -> None:
    """Saved by two ranks of 8 (a node since lost or joined): the ranks of the new world split the
    16 samples between them, and weight their loss so the gradient stays the mean over the 16."""
    saver = trainguard.init(batch_size=8, environ={"RANK": "0", "WORLD_SIZE": "2"})
    meta = saver.checkpoint_meta()
    assert meta["global_batch"] == 16 and meta["dp_size"] == 2
    run = trainguard.init(batch_size=8, environ={"RANK": str(rank), "WORLD_SIZE": str(world)})
    run.take_meta(meta)
    assert run.plan.batch_size == want and run.plan.loss_weight == pytest.approx(weight)
    assert run.checkpoint_meta()["global_batch"] == 16  # and a later restore keeps it again
    same = trainguard.init(batch_size=8, environ={"RANK": "0", "WORLD_SIZE": "2"})
    same.take_meta(meta)
    assert same.plan.batch_size == 8 and same.plan.batch_sizes is None
    # A script that takes no batch sizes (the Hugging Face and Lightning callbacks) keeps its own,
    # and its LR follows the global batch by the agent's rule, here and in its next checkpoint.
    for rule, want_lr in (("sqrt", (8 * world / 16) ** 0.5), ("linear", 8 * world / 16), ("none", 1.0)):
        env = {"RANK": str(rank), "WORLD_SIZE": str(world), "TRAINGUARD_LR_BATCH_RULE": rule}
        fixed = trainguard.init(batch_size=8, environ=env, applies=["lr"])
        fixed.take_meta(meta)
        assert fixed.plan.batch_size == 8 and fixed.plan.lr_for(0.1) == pytest.approx(0.1 * want_lr)
        again = trainguard.init(batch_size=8, environ=env, applies=["lr"])
        again.take_meta(fixed.checkpoint_meta())
        assert again.plan.lr_for(0.1) == pytest.approx(0.1 * want_lr)


def test_every_rank_applies_a_plan_at_the_same_step(tmp_path: Path) -> None:
    versions, _ = _plan_job(tmp_path, 40, 7, 0.03)
    first = versions.index(9)
    # Written during step 7; steps of 30 ms or more have a sync point at least every
    # ceil(SYNC_TARGET_S / 0.03) steps: rank 0 sees it at the first one after step 7 and every rank
    # takes it at the next, within two gaps.
    assert 8 <= first <= 7 + 2 * max(4, math.ceil(SYNC_TARGET_S / 0.03))


def test_short_steps_sync_less_often_and_still_agree(tmp_path: Path) -> None:
    """Steps of ~1 ms: rank 0 widens the gaps between sync points (about one per SYNC_TARGET_S, at
    most MAX_GAP steps apart, not one per 4 steps), and every rank still switches to a new plan at
    the same step."""
    steps = 5 * MAX_GAP  # the plan arrives within two gaps of its writing, whatever the step time
    versions, points = _plan_job(tmp_path, steps, 100, 0.0)
    assert versions.index(9) > 100
    assert points[0] == points[1] and points[0] < steps // 4 // 2, points  # fewer than half the fixed schedule's


def _uneven(rank: int, nproc: int, port: int, plan_path: str, out: str) -> None:
    _init(rank, nproc, port, {"TRAINGUARD_PLAN": plan_path, "TRAINGUARD_JOB": "u"})
    torch.manual_seed(0)
    model = DDP(nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    run = trainguard.init(batch_size=4)
    g = torch.Generator().manual_seed(1)
    xs, ys = torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)
    with run.step(0) as s:
        sizes = run.plan.batch_sizes
        assert sizes == (12, 4)
        lo = sum(sizes[:rank])
        x, y = xs[lo:lo + sizes[rank]], ys[lo:lo + sizes[rank]]
        loss = nn.functional.mse_loss(model(x), y) * s.loss_weight
        loss.backward()
        opt.step()
    if rank == 0:
        torch.save(model.module.state_dict(), out)
    # DDP's reducer must go before the process group: destroyed after it, its destructor can
    # deadlock a gloo rank at exit (seen in CI; the examples do the same).
    del model, opt
    dist.destroy_process_group()


def test_uneven_batches_keep_the_gradient_exact(tmp_path: Path) -> None:
    plan_path = str(tmp_path / "plan.json")
    write_plan_file(plan_path, Plan(version=2, batch_sizes=[12, 4]))
    out = str(tmp_path / "after.pt")
    _spawn(_uneven, 2, plan_path, out)
    torch.manual_seed(0)
    ref = nn.Linear(4, 1)
    g = torch.Generator().manual_seed(1)
    xs, ys = torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)
    nn.functional.mse_loss(ref(xs), ys).backward()
    torch.optim.SGD(ref.parameters(), lr=0.1).step()
    got = torch.load(out, weights_only=True)
    for k, v in ref.state_dict().items():
        assert torch.allclose(got[k], v, atol=1e-6), (k, got[k], v)


class Counter:
    """Any object with state_dict/load_state_dict is saved and restored."""

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, int]:
        return {"n": self.n}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.n = int(sd["n"])


def _make_state() -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return {"model": model, "optim": opt, "sched": sched, "counter": Counter(), "note": "start"}


def _save_ranks(rank: int, nproc: int, port: int, root: str, out: str) -> None:
    _init(rank, nproc, port, {"TRAINGUARD_SOCKET": "/nonexistent", "TRAINGUARD_JOB": "ck",
                              "TRAINGUARD_CKPT_MEMORY_ROOT": root, "TRAINGUARD_CKPT_MEMORY_EVERY": "5"})
    state = _make_state()
    model = DDP(state["model"])
    run = trainguard.init()
    saved = []
    for step in range(10):
        with run.step(step, samples=2):
            x = torch.full((2, 4), float(rank + step))
            model(x).sum().backward()
            state["optim"].step()
            state["optim"].zero_grad()
            state["sched"].step()
            state["counter"].n += 1
        state["note"] = f"after {step}"
        saved.append(run.checkpoint(step, state))
    assert saved == [False] * 4 + [True] + [False] * 4 + [True], saved
    if rank == 0:
        torch.save({"model": state["model"].state_dict(), "lr": state["optim"].param_groups[0]["lr"]}, out)
    del model
    dist.destroy_process_group()


def test_checkpoint_any_state_and_restore_into_another_world_size(tmp_path: Path) -> None:
    root = str(tmp_path / "shm")
    out = str(tmp_path / "final.pt")
    _spawn(_save_ranks, 2, root, out)
    tier = MemoryTier(root)
    steps = [i.step for i in tier.list("ck")]
    assert steps == [5, 10] and all(tier.verify("ck", s).ok for s in steps)
    # One process (world size 1) restores what two ranks wrote: DCP reshards, the run says step 10.
    state = _make_state()
    run = trainguard.init(environ={"TRAINGUARD_SOCKET": "/nonexistent", "TRAINGUARD_JOB": "ck",
                                   "TRAINGUARD_RESTORE": str(tier.step_path("ck", 10))})
    assert run.restore(state) == 10
    want = torch.load(out, weights_only=True)
    for k, v in state["model"].state_dict().items():
        assert torch.equal(v, want["model"][k]), k
    assert state["counter"].n == 10 and state["note"] == "after 9"
    assert state["sched"].last_epoch == 10 and state["optim"].param_groups[0]["lr"] == pytest.approx(want["lr"])
    assert state["optim"].state_dict()["state"], "optimizer moments restored"


def _stage_ranks(rank: int, nproc: int, port: int, root: str, out: str, restore: str) -> None:
    """Each rank holds a different stage (pipeline-style): not replicas, so every rank writes its own."""
    env = {"TRAINGUARD_SOCKET": "/nonexistent", "TRAINGUARD_JOB": "st", "TRAINGUARD_CKPT_MEMORY_ROOT": root,
           "TRAINGUARD_CKPT_MEMORY_EVERY": "2"}
    if restore:
        env["TRAINGUARD_RESTORE"] = restore
    _init(rank, nproc, port, env)
    torch.manual_seed(10 + rank)
    stage = nn.Linear(3 + rank, 2)
    state = {f"stage{rank}": stage}
    run = trainguard.init()
    if restore:
        assert run.restore(state) == 2
        torch.save(stage.state_dict(), f"{out}.restored{rank}")
    else:
        for step in range(2):
            with run.step(step):
                stage.weight.data += 1.0
            run.checkpoint(step, state)
        torch.save(stage.state_dict(), f"{out}.saved{rank}")
    dist.destroy_process_group()


def test_replicas_are_written_by_rank_0_alone_and_distinct_stages_by_every_rank(tmp_path: Path) -> None:
    root = str(tmp_path / "shm")
    _spawn(_save_ranks, 2, root, str(tmp_path / "final.pt"))
    files = {p.name for p in MemoryTier(root).step_path("ck", 10).iterdir() if p.suffix == ".distcp"}
    assert files == {"__0_0.distcp"}, files  # DDP replicas: one copy, no collective save
    out = str(tmp_path / "stage")
    _spawn(_stage_ranks, 2, root, out, "")
    path = MemoryTier(root).step_path("st", 2)
    assert {p.name for p in path.iterdir() if p.suffix == ".distcp"} == {"__0_0.distcp", "__1_0.distcp"}
    _spawn(_stage_ranks, 2, root, out, str(path))
    for rank in (0, 1):
        saved, restored = torch.load(f"{out}.saved{rank}"), torch.load(f"{out}.restored{rank}")
        assert all(torch.equal(saved[k], restored[k]) for k in saved)


@pytest.mark.parametrize("free", [4096, 64 << 10], ids=["in-the-step", "in-the-background-writer"])
def test_a_full_memory_tier_skips_the_save_and_training_goes_on(tiny_tmpfs: Path, free: int) -> None:
    """The tier's tmpfs is full: the checkpoint is skipped and reported, nothing half-written stays,
    and the next save works again once there is room. With 4 KB left even the step's own RNG file
    fails; with 64 KB that fits and the model's DCP file fails in the background writer."""
    filler = tiny_tmpfs / "filler"
    filler.write_bytes(b"x" * ((1 << 20) - free))
    env = {"TRAINGUARD_SOCKET": "/nonexistent", "TRAINGUARD_JOB": "full",
           "TRAINGUARD_CKPT_MEMORY_ROOT": str(tiny_tmpfs / "tier"), "TRAINGUARD_CKPT_MEMORY_EVERY": "1"}
    run = trainguard.init(environ=env)
    state = {"model": nn.Linear(256, 256)}
    with run.step(0):
        pass
    run.checkpoint(0, state)
    assert run.wait_checkpoint() is False and run.checkpoint_failures == 1
    leftovers = [p for p in (tiny_tmpfs / "tier").rglob("*") if p.is_file()] if (tiny_tmpfs / "tier").exists() else []
    assert not leftovers, leftovers
    filler.unlink()
    assert run.checkpoint(1, state) is True
    assert run.wait_checkpoint() is True and run.checkpoint_failures == 1
    assert [i.step for i in MemoryTier(str(tiny_tmpfs / "tier")).list("full")] == [2]
    run.close()


def test_without_an_agents_plan_no_rank_waits_on_a_sync_point(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A torchrun job with no agent (no plan file): every rank keeps the plan it has, so no step
    pays the store round trips of a sync point (the process group is there: a fake says so)."""
    run = trainguard.init(job="alone", environ={"HOME": str(tmp_path), "RANK": "1", "WORLD_SIZE": "2"})
    asked: list[str] = []

    class Initialised:
        def is_available(self) -> bool:
            asked.append("available")
            return True

        def is_initialized(self) -> bool:
            return True

    monkeypatch.setitem(sys.modules, "torch.distributed", Initialised())
    assert run.world_size == 2 and not run.plans.path
    assert run._plan_sync() is None and asked == []
    with run.step(0) as s:
        s.report(loss=1.0)
    assert run.plan.version == 0


SNAP_STEPS = 200
"""Sync points come every ~SYNC_TARGET_S (15 of these 20 ms steps): the agreed interval holds
from the second one on, and must then outweigh the first ones' narrow interval."""


def _snapshot_ranks(rank: int, nproc: int, port: int, plan_path: str, snap_dir: str, out_dir: str) -> None:
    """Rank 0 holds 64 MB of extra state: its copy costs a third of a 20 ms step or more, so it
    wants the widest snapshot interval (64); rank 1's tiny state would snapshot every step or
    nearly (every 16 under fresh-clone CI's load, where 16 MB on rank 0 had wanted only 32)."""
    _init(rank, nproc, port, {"TRAINGUARD_PLAN": plan_path, "TRAINGUARD_JOB": "snap", "TRAINGUARD_SNAPSHOT_DIR": snap_dir,
                              "TRAINGUARD_SNAPSHOT_EVERY": "auto", "TRAINGUARD_SOCKET": "/nonexistent"})
    state: dict[str, Any] = {"w": torch.zeros(4)}
    if rank == 0:
        state["big"] = torch.zeros(16 << 20)
    run = trainguard.init()
    taken = []
    t = torch.zeros(1)
    for step in range(SNAP_STEPS):
        with run.step(step):
            time.sleep(0.02)
            dist.all_reduce(t)
            state["w"] += 1
        if run.checkpoint(step, state):
            taken.append(step + 1)
    Path(out_dir, f"taken{rank}").write_text(",".join(map(str, taken)))
    Path(out_dir, f"wish{rank}").write_text(str(run._cadence.wish))
    dist.destroy_process_group()


def test_automatic_snapshot_intervals_are_agreed_so_every_rank_keeps_the_same_steps(tmp_path: Path) -> None:
    """Ranks whose stalls differ would tune their intervals apart, and with two slots each they
    would share no step to restore (a crash then fell back to the last DCP checkpoint): rank 0's
    interval is taken by every rank at the plan sync points."""
    plan_path = str(tmp_path / "plan.json")
    write_plan_file(plan_path, Plan(version=1))
    snap_dir = str(snapshot_dir(tmp_path / "shm", "snap"))
    _spawn(_snapshot_ranks, 2, plan_path, snap_dir, str(tmp_path))
    taken = [[int(s) for s in (tmp_path / f"taken{r}").read_text().split(",")] for r in (0, 1)]
    wishes = [int((tmp_path / f"wish{r}").read_text()) for r in (0, 1)]
    assert wishes[0] >= 2 * wishes[1], wishes  # the ranks really did want different intervals
    assert taken[0] == taken[1], taken
    # Rank 0's wide interval won, not rank 1's narrow one: judged on the run's second half, after
    # the sync points agreed it (the first ~15 steps snapshot every step, and under load rank 1
    # wants every 8, so a count over the whole run could not tell the two apart).
    late_gaps = [b - a for a, b in itertools.pairwise(taken[0]) if a >= SNAP_STEPS // 2]
    assert late_gaps and min(late_gaps) >= 2 * wishes[1], (wishes, taken)
    assert SnapshotSet(tmp_path / "shm", "snap").common_step(2) == taken[0][-1]


def test_the_automatic_snapshot_interval_keeps_within_one_percent_and_ignores_noise(tmp_path: Path) -> None:
    """A cost whose median is under 1 % of the step snapshots every step though single snapshots
    cost more (a median of a few samples crossed 1 % on the recovery bench's job); a cost over it
    goes to the fewest steps, a power of two, that bring it under."""
    env = RunEnvironment(job="j", rank=0, local_rank=0, world_size=1, local_world_size=1, attempt=0, socket="",
                         plan_path="", memory_root="", memory_every=100, restore_path="", part="", parts=(),
                         launched_by_agent=True, snapshot_dir=str(tmp_path / "snap"), snapshot_every=SNAPSHOT_AUTO)
    run = Run(env)
    assert run.snapshot_every == 1
    run._last_step_s = 0.027
    rng = random.Random(5)  # lognormal noise around 0.85 % of the step: a median of 9 crosses 1 % 14 times
    every_seen = []
    for i in range(200):
        cost = 0.027 * 0.0085 * math.exp(rng.gauss(0, 0.25))
        run._tune_snapshots(cost * (30.0 if i == 100 else 1.0))  # and one copy 30x slower
        if i >= 10:
            every_seen.append(run.snapshot_every)
    assert set(every_seen) == {1}, every_seen
    for _ in range(30):
        run._tune_snapshots(0.027 * 0.025)  # 2.5 %: every 4 steps (0.63 %), not 2 (1.25 %)
    assert run.snapshot_every == 4
    run.close()
    # A new attempt's first snapshots: a little over the budget waits for a full window of costs,
    # far over it moves at once.
    first = Run(env)
    first._last_step_s = 0.027
    for _ in range(SNAPSHOT_COST_WINDOW - 1):
        first._tune_snapshots(0.027 * 0.015)
    assert first.snapshot_every == 1
    first._tune_snapshots(0.027 * 0.015)
    assert first.snapshot_every == 2
    first.close()
    costly = Run(env)
    costly._last_step_s = 0.027
    for _ in range(SNAPSHOT_EARLY_MIN - 1):
        costly._tune_snapshots(0.027 * 0.06)
    assert costly.snapshot_every == 1
    costly._tune_snapshots(0.027 * 0.06)
    assert costly.snapshot_every == 8
    # ... and a median that comes down narrows it at once.
    for _ in range(2 * SNAPSHOT_EARLY_MIN):
        costly._tune_snapshots(0.027 * 0.005)
    assert costly.snapshot_every == 1
    costly.close()
    # One or two cold costs far over the budget (a slot's first fill, 15-34 % of the step on the
    # recovery bench) move nothing: they once set every 16 steps until a full window of costs.
    cold = Run(env)
    cold._last_step_s = 0.027
    for cost in (0.34, 0.15, 0.02, 0.02, 0.02, 0.02):
        cold._tune_snapshots(0.027 * cost / 2)
    assert cold.snapshot_every == 1
    cold.close()
    # Where the node's ranks outnumber its cores, each rank's snapshot slows every rank: a stall of
    # 0.8 % of the step on a node with twice as many ranks as cores costs the job 1.6 %.
    crowded = Run(env)
    crowded._last_step_s = 0.027
    crowded._cadence.cost_scale = 2.0
    for _ in range(SNAPSHOT_COST_WINDOW):
        crowded._tune_snapshots(0.027 * 0.008)
    assert crowded.snapshot_every == 2
    crowded.close()
    # Widening costs a crash steps: at every 2, a cost of 1.1 % of the step there keeps it (the
    # budget's noise on a loaded node), 1.3 % goes to 4; a cost that fits a narrower one goes back.
    hold = Run(env)
    hold._last_step_s = 0.027
    for cost, every in ((0.015, 2), (0.022, 2), (0.026, 4), (0.015, 2)):
        for _ in range(SNAPSHOT_COST_WINDOW):
            hold._tune_snapshots(0.027 * cost)
        assert hold.snapshot_every == every, (cost, hold.snapshot_every)
    hold.close()


_LET_GO = """
import os, sys, weakref
import torch, torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
import trainguard
dist.init_process_group("gloo")
model = DDP(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)))
optim = torch.optim.SGD(model.parameters(), lr=0.01)
run = trainguard.init(batch_size=4)
state = {"model": model, "optim": optim}
run.restore(state)
run.watch_gradients(model.parameters())
for step in range(6):
    with run.step(step, samples=4) as s:
        loss = model(torch.randn(4, 8)).pow(2).mean()
        optim.zero_grad()
        s.weighted(loss).backward()
        optim.step()
        s.report(loss=loss.item())
    run.checkpoint(step, state)
assert run.snapshot_stats is not None and run.snapshot_stats.taken > 0 and run.last_checkpoint
run.close()
ref = weakref.ref(model)
del model, optim, state, s, loss
print("kept" if ref() is not None else "let go")  # no gc: its last reference must be gone
dist.destroy_process_group()
"""


def test_a_closed_run_lets_the_scripts_model_go(tmp_path: Path) -> None:
    """After ``run.close()`` nothing of trainguard's holds the script's DDP model (the memory tier's
    learned state dicts did, and DCP's reference cycles until the collector ran): a script that
    drops it before ``destroy_process_group`` frees its reducer there. Freed after the group
    instead, the reducer's destructor joins gloo's threads holding the GIL, and one of them waiting
    for the GIL hung the rank's exit (seen under load in the suite: a rank of a finished job asleep
    in ``~ProcessGroupGloo`` for good)."""
    script = tmp_path / "let_go.py"
    script.write_text(_LET_GO)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]), "RANK": "0", "WORLD_SIZE": "1",
           "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "TRAINGUARD_JOB": "letgo", "TRAINGUARD_SOCKET": str(tmp_path / "no-agent.sock"),
           "TRAINGUARD_SNAPSHOT_DIR": str(tmp_path / "snap"), "TRAINGUARD_SNAPSHOT_EVERY": "1",
           "TRAINGUARD_CKPT_MEMORY_ROOT": str(tmp_path / "mem"), "TRAINGUARD_CKPT_MEMORY_EVERY": "2"}
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "let go", out.stdout + out.stderr[-2000:]
