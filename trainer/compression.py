"""Gradient compression for DDP runs, as DDP communication hooks, with byte accounting.

- ``powersgd``: torch's own ``powerSGD_hook`` (low-rank P/Q all-reduces, error feedback, warm
  start), wrapped to count the bytes it hands to collectives.
- ``int8`` / ``int4``: per-chunk absmax quantization with error feedback. Each rank's quantized
  bucket (scales + payload, one ``uint8`` tensor) is all-gathered and the dequantized copies are
  summed locally in fp32: an all-reduce on int8 would overflow, and gloo has no int8 sum anyway.
  int4 packs two values per byte.

``bytes_sent`` counts what this rank hands to collectives per step (its payload), and
``bytes_uncompressed`` what plain fp32/bf16 all-reduce would hand over for the same buckets, so
``ratio`` is the payload shrink factor. (The wire traffic of a ring all-reduce is 2(n-1)/n times
its payload and of an all-gather (n-1) times; the trainer reports payload bytes.)
"""

# No `from __future__ import annotations`: DDP checks the hooks' annotations at runtime and
# rejects string ones.
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

SPECS = ("none", "powersgd", "int8", "int4")
DEFAULT_CHUNK = 512
"""Elements per quantization scale: 4 scale bytes per 512 values keeps int8 at ~3.97x, int4 ~7.9x."""


@dataclass
class CompressionStats:
    """Running totals for one rank; the trainer reports ``ratio`` and ``last_step_bytes_sent``."""

    spec: str
    bytes_sent_total: int = 0
    bytes_uncompressed_total: int = 0
    steps: int = 0
    last_step_bytes_sent: int = 0
    last_step_bytes_uncompressed: int = 0
    _step_sent: int = field(default=0, repr=False)
    _step_uncompressed: int = field(default=0, repr=False)

    @property
    def ratio(self) -> float:
        """Uncompressed / sent bytes (1.0 before anything was sent)."""
        return self.bytes_uncompressed_total / self.bytes_sent_total if self.bytes_sent_total else 1.0

    @property
    def bytes_sent_per_step(self) -> float:
        return self.bytes_sent_total / self.steps if self.steps else 0.0

    @property
    def bytes_uncompressed_per_step(self) -> float:
        return self.bytes_uncompressed_total / self.steps if self.steps else 0.0

    def add(self, sent: int, uncompressed: int, *, end_of_step: bool) -> None:
        self.bytes_sent_total += sent
        self.bytes_uncompressed_total += uncompressed
        self._step_sent += sent
        self._step_uncompressed += uncompressed
        if end_of_step:
            self.steps += 1
            self.last_step_bytes_sent, self._step_sent = self._step_sent, 0
            self.last_step_bytes_uncompressed, self._step_uncompressed = self._step_uncompressed, 0


# -- quantization (pure functions) ---------------------------------------------------------------------


def _levels(bits: int) -> int:
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    return 127 if bits == 8 else 7  # symmetric: -q..q, so zero is exact


def padded_numel(numel: int, chunk: int) -> int:
    return -(-numel // chunk) * chunk


def packed_nbytes(numel: int, bits: int, chunk: int = DEFAULT_CHUNK) -> int:
    """Size of :func:`quantize`'s output for ``numel`` values."""
    n = padded_numel(numel, chunk)
    return 4 * (n // chunk) + (n if bits == 8 else n // 2)


def quantize(x: torch.Tensor, bits: int, chunk: int = DEFAULT_CHUNK) -> torch.Tensor:
    """Flat tensor -> one ``uint8`` tensor: fp32 scales (one per chunk) followed by the codes.

    Scales come first so every gathered copy can view them as float32 at offset 0.
    """
    if chunk <= 0 or chunk % 2:
        raise ValueError(f"chunk must be a positive even number, got {chunk}")
    q = _levels(bits)
    flat = x.detach().reshape(-1).to(torch.float32)
    n = padded_numel(flat.numel(), chunk)
    if n != flat.numel():
        flat = torch.nn.functional.pad(flat, (0, n - flat.numel()))
    blocks = flat.view(-1, chunk)
    scale = blocks.abs().amax(dim=1) / q
    # An all-zero chunk keeps scale 0 (decodes to zeros); divide by 1 instead of 0 there.
    codes = torch.round(blocks / torch.where(scale > 0, scale, 1.0).unsqueeze(1)).clamp_(-q, q)
    if bits == 8:
        payload = codes.to(torch.int8).view(torch.uint8).reshape(-1)
    else:
        nib = codes.add_(q + 1).to(torch.uint8).reshape(-1, 2)  # -7..7 -> 1..15: one nibble
        payload = nib[:, 0] | (nib[:, 1] << 4)
    return torch.cat([scale.view(torch.uint8), payload])


def dequantize(packed: torch.Tensor, numel: int, bits: int, chunk: int = DEFAULT_CHUNK) -> torch.Tensor:
    """Inverse of :func:`quantize`: the first ``numel`` values, as float32."""
    q = _levels(bits)
    n = padded_numel(numel, chunk)
    nchunks = n // chunk
    scale = packed[: 4 * nchunks].view(torch.float32)
    payload = packed[4 * nchunks :]
    if bits == 8:
        codes = payload.view(torch.int8).to(torch.float32)
    else:
        lo = (payload & 0x0F).to(torch.int16) - (q + 1)
        hi = (payload >> 4).to(torch.int16) - (q + 1)
        codes = torch.stack([lo, hi], dim=1).reshape(-1).to(torch.float32)
    return (codes.view(nchunks, chunk) * scale.unsqueeze(1)).reshape(-1)[:numel]


# -- hooks ------------------------------------------------------------------------------------------------


@dataclass
class QuantState:
    """State of the int8/int4 hook: the group, the format and the per-bucket residuals."""

    process_group: dist.ProcessGroup | None
    bits: int
    stats: CompressionStats
    chunk: int = DEFAULT_CHUNK
    error_feedback: bool = True
    residuals: dict[int, tuple[tuple[tuple[int, int], ...], torch.Tensor]] = field(default_factory=dict)
    """bucket index -> (parameter layout, what quantization left out last time)."""


def quantized_allreduce_hook(state: QuantState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: mean over ranks of the bucket, through ``state.bits``-bit codes."""
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    buf = bucket.buffer()
    x = buf.detach().to(torch.float32)  # a copy only when the grads are not fp32
    if state.error_feedback:
        # DDP rebuilds its buckets after the first step, so an index alone may name other
        # parameters later: a residual is reused only for the same parameters in the same order.
        layout = tuple((p.data_ptr(), p.numel()) for p in bucket.parameters())
        kept = state.residuals.get(bucket.index())
        if kept is not None and kept[0] == layout:
            x = x + kept[1]
    packed = quantize(x, state.bits, state.chunk)
    if state.error_feedback:
        # What this rank failed to send this time is added to what it sends next time.
        state.residuals[bucket.index()] = (layout, x - dequantize(packed, x.numel(), state.bits, state.chunk))
    state.stats.add(packed.numel(), buf.numel() * buf.element_size(), end_of_step=bucket.is_last())

    gathered = [torch.empty_like(packed) for _ in range(world)]
    work = dist.all_gather(gathered, packed, group=group, async_op=True)
    assert work is not None
    numel, bits, chunk = buf.numel(), state.bits, state.chunk

    def decode(_: torch.futures.Future[object]) -> torch.Tensor:
        total = torch.zeros(numel, dtype=torch.float32, device=buf.device)
        for part in gathered:
            total += dequantize(part, numel, bits, chunk)
        buf.copy_(total.div_(world))
        return buf

    return work.get_future().then(decode)


def _powersgd_counting_hook(
    stats: CompressionStats,
) -> Callable[[psgd.PowerSGDState, dist.GradBucket], torch.futures.Future[torch.Tensor]]:
    def hook(state: psgd.PowerSGDState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buf = bucket.buffer()
        before = state.total_numel_after_compression
        dense = state.iter < state.start_powerSGD_iter  # plain all-reduce during warm-up
        fut = psgd.powerSGD_hook(state, bucket)
        # powerSGD_hook updates its element counters synchronously, before the collectives run.
        elems = buf.numel() if dense else state.total_numel_after_compression - before
        stats.add(elems * buf.element_size(), buf.numel() * buf.element_size(), end_of_step=bucket.is_last())
        return fut

    return hook


def register_compression(
    ddp_model: torch.nn.parallel.DistributedDataParallel,
    spec: str,
    process_group: dist.ProcessGroup | None = None,
    *,
    error_feedback: bool = True,
    chunk: int = DEFAULT_CHUNK,
    powersgd_rank: int = 2,
    powersgd_start_iter: int = 10,
) -> CompressionStats | None:
    """Register the comm hook for ``spec`` (none|powersgd|int8|int4) on a DDP model.

    Call once, after wrapping in DDP and before the first backward. Returns the live stats
    object (None for ``none``: DDP keeps its built-in all-reduce; see :func:`dense_grad_bytes`).
    ``powersgd_start_iter`` steps of plain all-reduce come first, as torch recommends (DDP
    rebuilds buckets after step 1). Steps under ``no_sync()`` (gradient accumulation) do not
    communicate, so ``stats.steps`` counts synchronised steps only.
    """
    if spec not in SPECS:
        raise ValueError(f"gradient compression {spec!r} unknown; expected one of {', '.join(SPECS)}")
    if chunk <= 0 or chunk % 2:
        raise ValueError(f"chunk must be a positive even number, got {chunk}")
    if powersgd_rank < 1:
        raise ValueError(f"powersgd_rank must be >= 1, got {powersgd_rank}")
    if powersgd_start_iter < 2:
        # torch needs plain all-reduce first while DDP settles its buckets (error feedback, warm start).
        raise ValueError(f"powersgd_start_iter must be >= 2, got {powersgd_start_iter}")
    if spec == "none":
        return None
    stats = CompressionStats(spec)
    if spec == "powersgd":
        state = psgd.PowerSGDState(
            process_group=process_group,
            matrix_approximation_rank=powersgd_rank,
            start_powerSGD_iter=powersgd_start_iter,
            use_error_feedback=error_feedback,
            warm_start=True,
        )
        ddp_model.register_comm_hook(state, _powersgd_counting_hook(stats))
    else:
        qstate = QuantState(process_group, 8 if spec == "int8" else 4, stats, chunk, error_feedback)
        ddp_model.register_comm_hook(qstate, quantized_allreduce_hook)
    return stats


def dense_grad_bytes(module: torch.nn.Module) -> int:
    """Bytes per step plain DDP all-reduce hands over (for ``none``): every trainable gradient."""
    return sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)
