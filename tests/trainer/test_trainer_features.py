"""Trainer features on real forked gloo ranks: uneven batches, the local gradient norm, checkpoint
round trip and resharding, the agent's plan (applied at one step on every rank), loss falling on
the corpus, precision schedule, compression and fault hooks."""

from __future__ import annotations

import math
import shutil
import threading

import pytest
import torch

from bench.trainjobs import reference_run, run_job, tiny_config
from trainguard.agent.wire import Plan, Telemetry, write_plan_file
from trainguard.trainer.checkpoint import latest_checkpoint, load_full_model_state, step_dir

torch.set_num_threads(1)  # this process forks ranks later: keep it free of OpenMP worker threads


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("corpus"))


def _params(ckpt_dir: str) -> dict[str, torch.Tensor]:
    path = latest_checkpoint(ckpt_dir)
    assert path is not None
    return load_full_model_state(path)


def _assert_params_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], lr: float, steps: int) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        diff = (a[name] - b[name]).abs()
        assert float(diff.max()) <= 2 * lr * steps, name
        bad = int((diff > 2e-6).sum())
        assert bad <= max(2, diff.numel() // 200), f"{name}: {bad} of {diff.numel()} differ"


def test_uneven_batches_give_the_even_update(cache_dir: str, tmp_path) -> None:
    """dp4 FSDP with per-rank batches 2/1/0/5 (one rank idle) equals the single-process run."""
    plan_path = str(tmp_path / "plan.json")
    write_plan_file(plan_path, Plan(version=3, batch_sizes=[2, 1, 0, 5]))
    ckpt = str(tmp_path / "ckpt")
    cfg = tiny_config(cache_dir, parallel={"dp": 4}, ckpt_dir=ckpt)
    result = run_job(cfg, 4, tmp_path / "run", plan_path=plan_path)
    assert result.rc == 0
    ref = reference_run(cfg)
    for row, want, norm in zip(result.rows, ref.losses, ref.grad_norms, strict=True):
        assert math.isclose(row["loss"], want, rel_tol=2e-5)
        assert math.isclose(row["grad_norm"], norm, rel_tol=1e-4)
    for rank, size in enumerate([2, 1, 0, 5]):
        assert [m.batch_size for m in result.telemetry[rank]] == [size] * cfg.steps
        assert all(m.plan_version == 3 for m in result.telemetry[rank])
    _assert_params_close(_params(ckpt), ref.state, cfg.optim.lr, cfg.steps)


def test_local_grad_norm_is_taken_before_reduction(cache_dir: str, tmp_path) -> None:
    """dp2 x tp2 with all 8 samples on dp rank 0: its local gradient is the global one, so its
    local norm² equals the reported global norm² (TP shards summed, replicas counted once), and
    dp rank 1 (no samples) reports 0."""
    plan_path = str(tmp_path / "plan.json")
    write_plan_file(plan_path, Plan(version=1, batch_sizes=[8, 0]))
    cfg = tiny_config(cache_dir, parallel={"dp": 2, "tp": 2}, steps=2)
    result = run_job(cfg, 4, tmp_path / "run", plan_path=plan_path)
    assert result.rc == 0
    for rank, msgs in result.telemetry.items():
        for m in msgs:
            if m.dp_rank == 0:
                assert math.isclose(m.local_grad_sq, m.grad_norm ** 2, rel_tol=1e-4), (rank, m.step)
            else:
                assert m.local_grad_sq == 0.0


def test_checkpoint_resume_is_exact_and_reshards(cache_dir: str, tmp_path) -> None:
    ckpt = str(tmp_path / "a")
    cfg = tiny_config(cache_dir, parallel={"dp": 4}, steps=4, ckpt_dir=ckpt, ckpt_every=2)
    full = run_job(cfg, 4, tmp_path / "run_a")
    assert full.rc == 0
    final = _params(ckpt)

    # Same layout, resumed from step 2: bit-identical losses and weights.
    resumed_dir = str(tmp_path / "b")
    shutil.copytree(step_dir(ckpt, 2), step_dir(resumed_dir, 2))
    cfg_b = tiny_config(cache_dir, parallel={"dp": 4}, steps=4, ckpt_dir=resumed_dir)
    resumed = run_job(cfg_b, 4, tmp_path / "run_b")
    assert resumed.rc == 0
    assert [r["step"] for r in resumed.rows] == [3, 4]
    assert resumed.losses == full.losses[2:]
    got = _params(resumed_dir)
    for name, want in final.items():
        assert torch.equal(got[name], want), name

    # Another dp degree (dp2, DDP) from the same step-2 checkpoint: DCP reshards the FSDP state.
    other_dir = str(tmp_path / "c")
    shutil.copytree(step_dir(ckpt, 2), step_dir(other_dir, 2))
    cfg_c = tiny_config(cache_dir, parallel={"dp": 2, "dp_mode": "ddp"}, steps=4, ckpt_dir=other_dir)
    other = run_job(cfg_c, 2, tmp_path / "run_c")
    assert other.rc == 0
    assert [r["step"] for r in other.rows] == [3, 4]
    for got_loss, want_loss in zip(other.losses, full.losses[2:], strict=True):
        assert math.isclose(got_loss, want_loss, rel_tol=2e-5)
    _assert_params_close(_params(other_dir), final, cfg.optim.lr, 2)


def test_plan_applies_at_one_step_on_every_rank(cache_dir: str, tmp_path) -> None:
    """A plan written mid-run (seen through real telemetry) takes effect at the same step on all
    ranks: new LR scale and per-rank batch sizes; a later plan asking to stop ends the run early."""
    plan_path = str(tmp_path / "plan.json")
    written: dict[int, int] = {}
    lock = threading.Lock()

    def on_telemetry(m: Telemetry) -> None:
        with lock:
            if 1 not in written and m.step >= 3:
                write_plan_file(plan_path, Plan(version=1, lr_scale=0.5, batch_sizes=[3, 5], checkpoint_id=1))
                written[1] = m.step
            elif 1 in written and 2 not in written and m.plan_version == 1:
                write_plan_file(plan_path, Plan(version=2, lr_scale=0.5, batch_sizes=[3, 5], stop=True))
                written[2] = m.step

    ckpt = str(tmp_path / "ckpt")
    # Room for two plans' round trips (telemetry up to ~0.5 s late, a plan ~0.6 s on its way to
    # short steps): the stop ends the run long before its last step.
    cfg = tiny_config(cache_dir, parallel={"dp": 2, "dp_mode": "ddp"}, steps=1000, ckpt_dir=ckpt,
                      optim={"warmup": 0, "cosine": False})
    result = run_job(cfg, 2, tmp_path / "run", plan_path=plan_path, on_telemetry=on_telemetry)
    assert result.rc == 0
    assert 1 in written and 2 in written
    first_v1 = {}
    for rank, msgs in result.telemetry.items():
        # A message sums up a window of steps whose length each rank sets from its own step times:
        # the plan's first step is where the first v1 window began, not where it ended.
        first_v1[rank] = next(m.step - m.steps + 1 for m in msgs if m.plan_version == 1)
        for m in msgs:
            if m.plan_version == 0:
                assert m.batch_size == 4 and math.isclose(m.lr, cfg.optim.lr)
            else:
                assert m.batch_size == [3, 5][m.dp_rank] and math.isclose(m.lr, 0.5 * cfg.optim.lr)
    assert len(set(first_v1.values())) == 1, first_v1
    last = [msgs[-1].step for msgs in result.telemetry.values()]
    assert len(set(last)) == 1 and last[0] < cfg.steps  # stopped early, all ranks at the same step
    # checkpoint_id 1 asked for a checkpoint; stop saved one at the last step.
    saved = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert f"step_{last[0]:08d}" in saved and len(saved) >= 2


def test_loss_falls_on_the_corpus(cache_dir: str, tmp_path) -> None:
    cfg = tiny_config(cache_dir, steps=40, global_batch=16, val_every=20,
                      model={"layers": 2, "d_model": 64, "heads": 4, "context": 32}, optim={"warmup": 5})
    result = run_job(cfg, 1, tmp_path)
    assert result.rc == 0
    vals = [r["val_loss"] for r in result.rows if "val_loss" in r]
    assert len(vals) == 2
    assert result.losses[0] > 5.0  # ~ln 256 at init
    assert vals[-1] < 3.6, vals
    assert sum(result.losses[-5:]) / 5 < result.losses[0] - 1.5


def test_bf16_after_fp32_warmup_steps(cache_dir: str, tmp_path) -> None:
    cfg = tiny_config(cache_dir, precision="bf16", bf16_after_step=1, activation_checkpointing="attention")
    result = run_job(cfg, 1, tmp_path)
    assert result.rc == 0
    ref = reference_run(cfg)
    # Step 1 ran in fp32 (matches the fp32 reference tightly); later steps in bf16 (close, not equal).
    assert math.isclose(result.losses[0], ref.losses[0], rel_tol=1e-5)
    for got, want in zip(result.losses[1:], ref.losses[1:], strict=True):
        assert math.isfinite(got) and abs(got - want) < 0.05
        assert got != want


def test_int8_compression_reports_ratio(cache_dir: str, tmp_path) -> None:
    cfg = tiny_config(cache_dir, parallel={"dp": 2, "dp_mode": "ddp"}, compression="int8")
    result = run_job(cfg, 2, tmp_path)
    assert result.rc == 0
    ref = reference_run(cfg)
    for msgs in result.telemetry.values():
        assert all(m.compress_ratio is not None and 3.0 < m.compress_ratio < 4.1 for m in msgs)
        assert all(m.comm_bytes is not None and m.comm_bytes > 0 for m in msgs)
    assert abs(result.losses[-1] - ref.losses[-1]) < 0.05


def test_fault_hooks_nan_slow_and_kill(cache_dir: str, tmp_path) -> None:
    """NaN at step 1 (reported, update skipped, training goes on); rank 1 slowed 4x from step 2:
    the extra time shows as compute on rank 1 and as waiting on rank 0; a kill ends the job."""
    cfg = tiny_config(cache_dir, parallel={"dp": 2, "dp_mode": "ddp"}, steps=5,
                      faults=["nan:step=1", "slow:rank=1,factor=4,step=2"],
                      model={"layers": 2, "d_model": 64, "heads": 4, "context": 64})
    result = run_job(cfg, 2, tmp_path / "nan", env={"TRAINGUARD_FAULTS": ""})
    assert result.rc == 0
    assert math.isnan(result.losses[1]) and all(math.isfinite(v) for v in result.losses[2:])
    # Telemetry step k reports the step that ran with k-1 steps done, so steps 3.. were slowed.
    fast, slow = ([m for m in result.telemetry[r] if m.step >= 3] for r in (0, 1))
    fast_compute = sum(m.fwd_bwd_s for m in fast)
    slow_compute = sum(m.fwd_bwd_s for m in slow)
    assert slow_compute > 2.0 * fast_compute, (slow_compute, fast_compute)
    assert sum(m.comm_s for m in fast) > 0.5 * (slow_compute - fast_compute)

    cfg = tiny_config(cache_dir, parallel={"dp": 2}, steps=5, faults=["kill:rank=1,step=2"])
    killed = run_job(cfg, 2, tmp_path / "kill", env={"TRAINGUARD_FAULTS": ""})
    assert killed.rc != 0
    assert max(m.step for m in killed.telemetry[1]) == 2


def test_worker_entry_point_runs_one_rank_from_the_environment(cache_dir: str, tmp_path) -> None:
    import json
    import os
    import subprocess
    import sys

    from trainguard.trainer.launch import free_port
    cfg = tiny_config(cache_dir, steps=2)
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), TRAINGUARD_JOB_SPEC=cfg.to_json(), TRAINGUARD_JSON="1")
    env.pop("TRAINGUARD_SOCKET", None)
    proc = subprocess.run([sys.executable, "-m", "trainguard.trainer.worker"], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["step"] for r in rows] == [1, 2] and all(math.isfinite(r["loss"]) for r in rows)
    env["TRAINGUARD_JOB_SPEC"] = json.dumps({"parallel": {"tp": 3}})
    bad = subprocess.run([sys.executable, "-m", "trainguard.trainer.worker"], env=env, capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2 and "parallel.tp" in bad.stderr
