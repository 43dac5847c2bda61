"""Gradient compression hooks on a real 2-rank gloo group (fork-started: spawning costs seconds per rank)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch._dynamo  # noqa: F401  -- DDP() imports it; once here instead of 4-5 s in each child
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.conftest import join_ranks
from trainguard.trainer.compression import (
    CompressionStats,
    dequantize,
    packed_nbytes,
    quantize,
    register_compression,
)

WORLD = 2
SIZES = (3000, 40_000, 513, 20_000)  # several buckets at bucket_cap_mb=0.1, odd sizes for padding


def _entry(rank: int, fn: Callable[..., Any], store: str, args: tuple[Any, ...]) -> None:
    # Forked from a process that may have used the intra-op pool: one thread avoids it, and the
    # machine has two cores for both ranks anyway.
    torch.set_num_threads(1)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        fn(rank, *args)
    finally:
        dist.destroy_process_group()


def run_ranks(tmp_path: Path, fn: Callable[..., Any], *args: Any, timeout: float = 60.0) -> None:
    ctx = mp.start_processes(
        _entry, args=(fn, str(tmp_path / "store"), args), nprocs=WORLD, start_method="fork", join=False
    )
    join_ranks(ctx, fn.__name__, timeout)


class GradEcho(nn.Module):
    """loss = sum(p * g): the gradient of each parameter is exactly the g fed in."""

    def __init__(self) -> None:
        super().__init__()
        self.ps = nn.ParameterList([nn.Parameter(torch.zeros(n)) for n in SIZES])

    def forward(self, gs: list[torch.Tensor]) -> torch.Tensor:
        return sum(((p * g).sum() for p, g in zip(self.ps, gs, strict=True)), torch.zeros(()))


def grads_for(rank: int, step: int, drift: float = 1.0) -> list[torch.Tensor]:
    """Per-rank gradients: a fixed part per rank plus a per-step part weighted by ``drift``."""
    base = torch.Generator().manual_seed(1000 + rank)
    noise = torch.Generator().manual_seed(10_000 * (step + 1) + rank)
    return [
        torch.randn(n, generator=base) * (1 + i) + drift * torch.randn(n, generator=noise)
        for i, n in enumerate(SIZES)
    ]


def echo_steps(model: DDP, rank: int, steps: int, drift: float) -> list[torch.Tensor]:
    """Run ``steps`` backward passes; return each step's reduced gradient (concatenated)."""
    out = []
    for step in range(steps):
        model.zero_grad(set_to_none=True)
        model(grads_for(rank, step, drift)).backward()
        out.append(torch.cat([p.grad.detach().clone() for p in model.module.ps]))
    return out


def exact_mean(step: int, drift: float) -> torch.Tensor:
    return torch.stack([torch.cat(grads_for(r, step, drift)) for r in range(WORLD)]).mean(0)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


# -- pure quantization ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("bits", "levels"), [(8, 127), (4, 7)])
def test_quantize_round_trip(bits: int, levels: int) -> None:
    x = torch.randn(5000) * torch.linspace(0.01, 10, 5000)  # chunks of very different magnitude
    x[1024:1536] = 0.0  # one all-zero chunk
    packed = quantize(x, bits, chunk=512)
    assert packed.dtype == torch.uint8 and packed.numel() == packed_nbytes(5000, bits, 512)
    y = dequantize(packed, 5000, bits, chunk=512)
    assert y.shape == x.shape
    padded = torch.nn.functional.pad(x, (0, 5120 - 5000)).view(-1, 512)
    half_step = (padded.abs().amax(1) / levels / 2).repeat_interleave(512)[:5000]
    assert bool(((y - x).abs() <= half_step * 1.001 + 1e-12).all())
    assert bool((y[1024:1536] == 0).all())
    assert float((y - x).abs().max()) > 0  # it did lose precision: really quantized


def test_bad_spec_is_named() -> None:
    with pytest.raises(ValueError, match="'int3'"):
        register_compression(None, "int3")  # type: ignore[arg-type]
    assert register_compression(None, "none") is None  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="powersgd_start_iter"):
        register_compression(None, "powersgd", powersgd_start_iter=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="chunk"):
        register_compression(None, "int8", chunk=7)  # type: ignore[arg-type]


# -- int8 / int4 through DDP ------------------------------------------------------------------------------


def _quantized_rank(rank: int, out: str, spec: str) -> None:
    torch.manual_seed(0)
    model = DDP(GradEcho(), bucket_cap_mb=0.1)
    stats = register_compression(model, spec, process_group=dist.group.WORLD)
    assert stats is not None
    got = echo_steps(model, rank, steps=3, drift=1.0)
    torch.save({"got": got, "stats": stats}, f"{out}/{spec}_{rank}.pt")


@pytest.mark.parametrize(("spec", "max_err", "ratio"), [("int8", 0.02, (3.8, 4.0)), ("int4", 0.25, (7.4, 8.0))])
def test_quantized_mean_and_ratio(tmp_path: Path, spec: str, max_err: float, ratio: tuple[float, float]) -> None:
    run_ranks(tmp_path, _quantized_rank, str(tmp_path), spec)
    res = [torch.load(tmp_path / f"{spec}_{r}.pt", weights_only=False) for r in range(WORLD)]
    # Step 0 has no residual yet: pure quantization error against the exact mean.
    err = rel_err(res[0]["got"][0], exact_mean(0, 1.0))
    assert 1e-4 < err < max_err, err
    for step in range(3):
        assert torch.equal(res[0]["got"][step], res[1]["got"][step])  # every rank applies the same update
    stats: CompressionStats = res[0]["stats"]
    assert stats.steps == 3
    assert ratio[0] < stats.ratio <= ratio[1], stats
    bits = 8 if spec == "int8" else 4
    assert stats.last_step_bytes_uncompressed == 4 * sum(SIZES)
    # Each bucket is padded separately, so the step total is at least the unbucketed size.
    assert packed_nbytes(sum(SIZES), bits) <= stats.last_step_bytes_sent < stats.last_step_bytes_uncompressed


def _feedback_rank(rank: int, out: str, steps: int) -> None:
    sums = {}
    for feedback in (True, False):
        torch.manual_seed(0)
        model = DDP(GradEcho(), bucket_cap_mb=0.1)
        register_compression(model, "int8", error_feedback=feedback)
        sums[feedback] = torch.stack(echo_steps(model, rank, steps, drift=DRIFT)).sum(0)
    if rank == 0:
        torch.save(sums, f"{out}/sums.pt")


DRIFT = 0.005  # gradients that change little between steps: rounding errors repeat, a bias


def test_error_feedback_sum_converges(tmp_path: Path) -> None:
    steps = 24
    run_ranks(tmp_path, _feedback_rank, str(tmp_path), steps)
    sums = torch.load(tmp_path / "sums.pt")
    exact = torch.stack([exact_mean(s, DRIFT) for s in range(steps)]).sum(0)
    with_fb, without_fb = rel_err(sums[True], exact), rel_err(sums[False], exact)
    # Without feedback the repeating rounding errors add up (relative error stays at one step's);
    # with it they cancel, so the accumulated update lags the exact one by one step's error only.
    assert with_fb < without_fb / 5, (with_fb, without_fb)
    assert with_fb < 0.002, with_fb


# -- PowerSGD -------------------------------------------------------------------------------------------------


def _powersgd_rank(rank: int, out: str) -> None:
    torch.manual_seed(0)  # same init on both ranks
    net = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8))
    model = DDP(net)
    stats = register_compression(model, "powersgd", powersgd_rank=2, powersgd_start_iter=3)
    assert stats is not None
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(7)
    teacher = torch.randn(32, 8, generator=gen) / 32**0.5
    data = torch.Generator().manual_seed(100 + rank)  # each rank its own shard
    losses = []
    for _ in range(40):
        x = torch.randn(64, 32, generator=data)
        loss = nn.functional.mse_loss(model(x), torch.tanh(x @ teacher) * 2)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    torch.save({"losses": losses, "stats": stats, "params": flat}, f"{out}/psgd_{rank}.pt")


def test_powersgd_trains_and_compresses(tmp_path: Path) -> None:
    run_ranks(tmp_path, _powersgd_rank, str(tmp_path))
    res = [torch.load(tmp_path / f"psgd_{r}.pt", weights_only=False) for r in range(WORLD)]
    losses = res[0]["losses"]
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < 0.5 * first, losses
    assert torch.allclose(res[0]["params"], res[1]["params"])  # replicas stay in sync
    stats: CompressionStats = res[0]["stats"]
    assert stats.steps == 40
    assert stats.ratio > 1.5, stats
    # Compressed steps send less than the dense warm-up steps did.
    assert stats.last_step_bytes_sent < stats.last_step_bytes_uncompressed
