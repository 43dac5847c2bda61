"""Per-step measurements that are not the loss: the local gradient norm before reduction, memory,
model FLOPs, estimated collective bytes and the pipeline bubble."""

from __future__ import annotations

import os
import time
from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from trainguard.trainer.config import TrainConfig
from trainguard.trainer.model import param_count
from trainguard.trainer.parallel import local_piece, replicas

# Dense bf16 peak FLOP/s by device-name fragment, for MFU. CPUs are left out: no honest peak.
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12, "L4": 121e12}


class LocalGradMeter:
    """Squared norm of this dp rank's own gradient, before the dp reduction.

    A post-accumulate-grad hook sees each gradient right after autograd wrote it and before DDP
    averages the bucket or FSDP2 reduce-scatters it; both write the reduced value without going
    through autograd again, so the hook never sees it. Under FSDP2 the hooked tensors are the
    unsharded parameters, which exist only during forward: a forward-pre hook, registered after
    ``fully_shard`` so it runs after the all-gather, finds them. Each parameter keeps its latest
    value: with accumulation the last write holds the sum over micro-batches.
    """

    def __init__(self, chunks: Iterable[nn.Module], tp: int) -> None:
        self.tp = tp
        self._latest: dict[int, torch.Tensor] = {}
        self._hooked: set[int] = set()
        for chunk in chunks:
            fsdp = [m for m in chunk.modules() if isinstance(m, FSDPModule)]
            if fsdp:
                # FSDP2 also runs post-accumulate hooks on the sharded parameters once it has
                # written the reduced shard: those are after reduction, never hook them.
                self._hooked.update(id(p) for p in chunk.parameters())
                for m in fsdp:
                    m.register_forward_pre_hook(self._on_forward)
            else:
                for p in chunk.parameters():
                    self._hook(p)

    def _on_forward(self, module: nn.Module, args: object) -> None:
        for p in module.parameters():
            self._hook(p)

    def _hook(self, p: torch.Tensor) -> None:
        if id(p) in self._hooked or not p.requires_grad:
            return
        self._hooked.add(id(p))
        p.register_post_accumulate_grad_hook(self._record)

    def _record(self, p: torch.Tensor) -> None:
        g = p.grad
        if g is None:
            return
        self._latest[id(p)] = local_piece(g).detach().double().pow(2).sum() / replicas(g, {"tp": self.tp})

    def reset(self) -> None:
        self._latest.clear()

    def share(self) -> float:
        """This rank's share; summed over the dp rank's tp and pp ranks it is the full norm²."""
        # One device sync per step, not one per parameter inside backward.
        return float(torch.stack(list(self._latest.values())).sum()) if self._latest else 0.0


_RSS_EVERY_S = 1.0
_rss: list[float] = [-_RSS_EVERY_S, 0]  # when /proc/self/statm was last read, the RSS it gave


def mem_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    # The RSS at most once a second: reading /proc/self/statm every step (an open, a read and a
    # close) was ~1 % of a rank's on-CPU samples between steps of ~20 ms.
    now = time.monotonic()
    if now - _rss[0] >= _RSS_EVERY_S:
        try:
            with open("/proc/self/statm") as fh:
                _rss[1] = int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            _rss[1] = 0
        _rss[0] = now
    return int(_rss[1])


def mem_frag(device: torch.device) -> float | None:
    """Share of the caching allocator's reserved memory not in use (GPU only)."""
    if device.type != "cuda":
        return None
    reserved = torch.cuda.memory_reserved(device)
    return 1.0 - torch.cuda.memory_allocated(device) / reserved if reserved else 0.0


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_FLOPS.items() if k in name), None)


def bubble_frac(cfg: TrainConfig) -> float | None:
    """Idle share of a pipeline schedule: (p-1)/(v*m + p-1) for p stages-ranks, m microbatches,
    v stages per rank (the standard analysis for GPipe/1F1B, v=1, and interleaved 1F1B)."""
    p = cfg.parallel
    if p.pp == 1:
        return None
    return (p.pp - 1) / (p.stages_per_rank * p.microbatches + p.pp - 1)


def comm_bytes_estimate(cfg: TrainConfig, local_samples: int) -> int:
    """Bytes this rank sends through collectives in one step, from the layout (ring algorithms).

    dp: DDP all-reduce 2(n-1)/n x grads; FSDP2 all-gather in forward and backward plus
    reduce-scatter, (n-1)/n x params each. tp: two activation all-reduces per block in forward and
    two in backward. pp: activations and their gradients across each stage boundary.
    """
    m, p = cfg.model, cfg.parallel
    stage_params = param_count(m) / (p.pp * p.tp)
    total = 0.0
    if p.dp > 1:
        frac = (p.dp - 1) / p.dp
        total += (2 * frac * stage_params if p.uses_ddp else 3 * frac * stage_params) * 4
    act = local_samples * m.context * m.d_model * 4
    if p.tp > 1:
        layers = m.layers / p.pp
        total += 4 * layers * 2 * (p.tp - 1) / p.tp * act
    if p.pp > 1:
        total += 2 * act * p.stages_per_rank
    return int(total)
