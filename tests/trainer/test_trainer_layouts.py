"""Every parallel layout against a single-process reference on the same global batches.

Each case trains a tiny GPT for 3 steps on forked gloo ranks, saves a checkpoint at the end, and
compares (a) rank 0's per-step loss and (b) every parameter of the saved checkpoint with a plain
single-process loop (bench/trainjobs.py reference_run). The checkpoint must hold exactly the full
model's parameter names and shapes (TP + DDP loses weights silently after the first forward).
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from bench.trainjobs import reference_run, run_job, tiny_config
from trainguard.trainer.checkpoint import latest_checkpoint

torch.set_num_threads(1)  # this process forks ranks later: keep it free of OpenMP worker threads

LAYOUTS = {
    # name: (nproc, parallel section, extra top-level config)
    "dp4_fsdp": (4, {"dp": 4}, {}),
    "dp4_ddp": (4, {"dp": 4, "dp_mode": "ddp"}, {}),
    "dp2xtp2": (4, {"dp": 2, "tp": 2}, {}),
    "pp2xdp2_1f1b": (4, {"pp": 2, "dp": 2, "pp_schedule": "1f1b"}, {}),
    "pp2xtp2_gpipe": (4, {"pp": 2, "tp": 2, "pp_schedule": "gpipe", "microbatches": 4}, {}),
    "pp2xdp2_interleaved": (4, {"pp": 2, "dp": 2, "pp_schedule": "interleaved"},
                            {"model": {"layers": 4}}),
    # Gradient accumulation and full activation checkpointing must not change the numbers.
    "dp2_accum2_ac": (2, {"dp": 2}, {"grad_accum": 2, "activation_checkpointing": "all"}),
}


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("corpus"))


def _load_full(path: str, workdir: str) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    out = os.path.join(workdir, "full.pt")
    dcp_to_torch_save(path, out)
    return torch.load(out, weights_only=False)


def _check_against_reference(cfg, result, ckpt_dir: str) -> None:
    assert result.rc == 0
    ref = reference_run(cfg)
    assert [r["step"] for r in result.rows] == list(range(1, cfg.steps + 1))
    for step, (row, want, want_norm) in enumerate(zip(result.rows, ref.losses, ref.grad_norms, strict=True), 1):
        assert math.isclose(row["loss"], want, rel_tol=2e-5), f"step {step}: loss {row['loss']} != {want}"
        # Adam hides a wrong gradient scale from the weights; the pre-clip norm does not.
        assert math.isclose(row["grad_norm"], want_norm, rel_tol=1e-4), f"step {step}: grad norm"
    assert ref.losses[-1] < ref.losses[0]  # the weights moved, so equality below means something
    # Validation through every layout (pipeline stages pass activations point to point).
    assert math.isclose(result.rows[-1]["val_loss"], ref.val_loss, rel_tol=1e-4)
    path = latest_checkpoint(ckpt_dir)
    assert path is not None and path.endswith(f"step_{cfg.steps:08d}")
    full = _load_full(path, ckpt_dir)
    saved = full["model"]
    assert sorted(saved) == sorted(ref.state), "checkpoint parameter names differ from the full model's"
    for name in saved:  # AdamW state: both moments for every parameter, full shape
        for moment in ("exp_avg", "exp_avg_sq"):
            assert full["optim"][f"state.{name}.{moment}"].shape == saved[name].shape, (name, moment)
    for name, want in ref.state.items():
        got = saved[name]
        assert got.shape == want.shape, name
        diff = (got - want).abs()
        # Adam turns a gradient element that is ~0 into a +-lr step whose sign rounding decides, so
        # a handful of elements may differ by up to 2 lr per step; the rest must agree closely.
        assert float(diff.max()) <= 2 * cfg.optim.lr * cfg.steps, f"{name}: max diff {float(diff.max())}"
        bad = int((diff > 2e-6).sum())
        assert bad <= max(2, diff.numel() // 200), f"{name}: {bad} of {diff.numel()} elements differ"


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_process(name: str, cache_dir: str, tmp_path) -> None:
    nproc, parallel, extra = LAYOUTS[name]
    ckpt = str(tmp_path / "ckpt")
    cfg = tiny_config(cache_dir, parallel=parallel, ckpt_dir=ckpt, **extra)
    result = run_job(cfg, nproc, tmp_path)
    _check_against_reference(cfg, result, ckpt)
    # Every rank reported every step, with its own place in the layout, in messages the agent accepts.
    assert not result.telemetry_errors, result.telemetry_errors[:3]
    assert sorted(result.telemetry) == list(range(nproc))
    for rank, msgs in result.telemetry.items():
        assert [m.step for m in msgs] == list(range(1, cfg.steps + 1)), rank
        assert all(m.world_size == nproc and m.tokens == m.samples * cfg.model.context for m in msgs)
        assert all(m.mem_bytes > 0 and m.comm_s >= 0 and m.fwd_bwd_s > 0 and m.flops_per_s for m in msgs)
        assert all(m.local_grad_sq > 0 and m.plan_version == 0 for m in msgs)
        # The LR guard's signal: from the third step on (it needs a previous update), a cosine.
        assert [m.update_cos is None for m in msgs[:2]] == [True, True]
        assert all(m.update_cos is not None and -1 <= m.update_cos <= 1 for m in msgs[2:]), rank
        if cfg.parallel.dp == 1:  # the local gradient is the global one (pp stages and tp shards summed)
            assert all(math.isclose(m.local_grad_sq, m.grad_norm ** 2, rel_tol=1e-6) for m in msgs)
        if cfg.parallel.pp > 1:
            assert all(m.bubble_frac is not None and 0 < m.bubble_frac < 1 for m in msgs)


@pytest.mark.slow
def test_3d_layout_on_8_processes(cache_dir: str, tmp_path) -> None:
    ckpt = str(tmp_path / "ckpt")
    cfg = tiny_config(cache_dir, parallel={"pp": 2, "dp": 2, "tp": 2}, ckpt_dir=ckpt)
    result = run_job(cfg, 8, tmp_path)
    _check_against_reference(cfg, result, ckpt)

