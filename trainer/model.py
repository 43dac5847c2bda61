"""A small GPT-style byte-level decoder, built so that any pipeline stage of it is itself a module.

Parameter names do not depend on the layout: blocks live in ``layers`` keyed by their global index
(``layers.3.attn.q.weight``), the embedding in ``embed`` and the final norm and head in ``final``.
A pipeline stage holds a subset of these, so the stages' checkpoints together are exactly the
single-process model's, and a checkpoint saved with one layout loads into another.

Initialisation is deterministic per parameter (a generator seeded by the run seed and the
parameter's name), so every stage builds the same weights it would hold in the full model.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from trainguard.trainer.config import ModelConfig

VOCAB = 256


class Attention(nn.Module):
    """Causal self-attention with separate q/k/v projections.

    Separate projections (rather than one fused qkv) make column-wise tensor parallelism split
    whole heads: each TP rank then holds ``heads / tp`` heads, read back from the local width.
    """

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.head_dim = d_model // heads
        self.q = nn.Linear(d_model, d_model, bias=False)
        self.k = nn.Linear(d_model, d_model, bias=False)
        self.v = nn.Linear(d_model, d_model, bias=False)
        self.o = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (proj(x).view(b, t, -1, self.head_dim).transpose(1, 2) for proj in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.up = nn.Linear(d_model, 4 * d_model, bias=False)
        self.down = nn.Linear(4 * d_model, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    """Pre-norm transformer block; ``checkpointing`` selects what is recomputed in backward."""

    def __init__(self, cfg: ModelConfig, checkpointing: str = "none") -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg.d_model, cfg.heads)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg.d_model)
        self.checkpointing = checkpointing

    def _attn(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(self.ln1(x))

    def _body(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpointing == "attention" and torch.is_grad_enabled():
            # Attention activations (q, k, v, scores) dominate memory at long context; the MLP's are
            # cheap to keep, so recompute only the attention half.
            x = x + checkpoint(self._attn, x, use_reentrant=False)
        else:
            x = x + self._attn(x)
        return x + self.mlp(self.ln2(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpointing == "all" and torch.is_grad_enabled():
            out: torch.Tensor = checkpoint(self._body, x, use_reentrant=False)
            return out
        return self._body(x)


class Embed(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, cfg.d_model)
        self.pos = nn.Embedding(cfg.context, cfg.d_model)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.tok(idx) + self.pos(pos)


class Final(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, VOCAB, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln(x))


class GPT(nn.Module):
    """The whole model (``layer_ids`` = all) or one pipeline stage of it.

    Input: byte ids (B, T) for a stage holding ``embed``, else activations (B, T, d_model).
    Output: logits (B, T, 256) for a stage holding ``final``, else activations.
    """

    def __init__(self, cfg: ModelConfig, layer_ids: Sequence[int] | None = None, *, first: bool = True,
                 last: bool = True, checkpointing: str = "none") -> None:
        super().__init__()
        ids = list(range(cfg.layers)) if layer_ids is None else list(layer_ids)
        self.embed = Embed(cfg) if first else None
        self.layers = nn.ModuleDict({str(i): Block(cfg, checkpointing) for i in ids})
        self.final = Final(cfg) if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for block in self.layers.values():
            x = block(x)
        if self.final is not None:
            x = self.final(x)
        return x


def stage_layers(n_layers: int, n_stages: int, stage: int) -> list[int]:
    """Global layer indices of ``stage`` when n_layers are split into n_stages contiguous runs
    (the first stages take the remainder, one extra layer each).

    >>> [stage_layers(5, 2, s) for s in range(2)]
    [[0, 1, 2], [3, 4]]
    """
    base, extra = divmod(n_layers, n_stages)
    start = stage * base + min(stage, extra)
    return list(range(start, start + base + (1 if stage < extra else 0)))


def build_stage(cfg: ModelConfig, seed: int, stage: int = 0, n_stages: int = 1,
                checkpointing: str = "none") -> GPT:
    """Pipeline stage ``stage`` of ``n_stages`` (0 of 1: the whole model), deterministically initialised."""
    model = GPT(cfg, stage_layers(cfg.layers, n_stages, stage), first=stage == 0,
                last=stage == n_stages - 1, checkpointing=checkpointing)
    init_params(model, seed, cfg.layers)
    return model


def init_params(model: nn.Module, seed: int, n_layers: int) -> None:
    """GPT-2 style init; each parameter drawn from its own generator keyed by (seed, name)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            if name.endswith(("ln1.weight", "ln2.weight", "ln.weight")):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                std = 0.02
                if name.endswith(("attn.o.weight", "mlp.down.weight")):
                    std = 0.02 / (2 * n_layers) ** 0.5  # residual projections, scaled by depth
                p.copy_(torch.randn(p.shape, generator=gen) * std)


def param_count(cfg: ModelConfig) -> int:
    d = cfg.d_model
    per_block = 4 * d * d + 8 * d * d + 4 * d
    return VOCAB * d + cfg.context * d + cfg.layers * per_block + 2 * d + d * VOCAB


def flops_per_token(cfg: ModelConfig) -> float:
    """Training FLOPs per token: 6 x parameters (matmuls fwd+bwd) + attention scores (12 L d T)."""
    return 6.0 * param_count(cfg) + 12.0 * cfg.layers * cfg.d_model * cfg.context
