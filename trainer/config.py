"""Typed, validated training configuration. Torch-free: the agent CLI imports this module to build
and check job specs, and the agent never imports torch.

A job spec is ``TrainConfig.to_dict()`` as JSON; ``TrainConfig.from_dict`` rebuilds it and every
error names the key it is about (``parallel.tp: 3 does not divide model.heads=4``).

>>> cfg = TrainConfig.from_dict({"parallel": {"dp": 2, "tp": 2}, "steps": 5})
>>> cfg.parallel.world_size
4
>>> TrainConfig.from_dict(cfg.to_dict()) == cfg
True
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field
from typing import Any


class ConfigError(ValueError):
    """A configuration value that does not fit; the message starts with the dotted key."""


def _check(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {message}")


def _positive(value: int | float, key: str) -> None:
    _check(not isinstance(value, bool) and isinstance(value, (int, float)) and value > 0, key,
           f"{value!r} must be > 0")


def _nonneg(value: int | float, key: str) -> None:
    _check(not isinstance(value, bool) and isinstance(value, (int, float)) and value >= 0, key,
           f"{value!r} must be >= 0")


@dataclass
class ModelConfig:
    """A GPT-style byte-level decoder (vocabulary 256, pre-norm blocks, MLP width 4 x d_model)."""

    layers: int = 4
    """Transformer blocks."""
    d_model: int = 128
    """Residual stream width."""
    heads: int = 4
    """Attention heads; must divide d_model (and be divisible by parallel.tp)."""
    context: int = 128
    """Tokens per sample (each sample is context + 1 bytes: inputs and shifted targets)."""

    def __post_init__(self) -> None:
        for name in ("layers", "d_model", "heads", "context"):
            _check(isinstance(getattr(self, name), int), f"model.{name}", "must be an integer")
            _positive(getattr(self, name), f"model.{name}")
        _check(self.d_model % self.heads == 0, "model.heads",
               f"{self.heads} does not divide model.d_model={self.d_model}")

    @property
    def vocab(self) -> int:
        return 256


PP_SCHEDULES = ("gpipe", "1f1b", "interleaved")
DP_MODES = ("fsdp", "ddp")


@dataclass
class ParallelConfig:
    """Process layout on a (pp, dp, tp) device mesh; world size = pp * dp * tp."""

    dp: int = 1
    """Data-parallel degree (FSDP2 shards; DDP for dp-only runs with dp_mode=ddp)."""
    tp: int = 1
    """Tensor-parallel degree (column/row-wise attention and MLP)."""
    pp: int = 1
    """Pipeline stages (ranks); 'interleaved' places 2 stages on each rank."""
    pp_schedule: str = "1f1b"
    """One of gpipe, 1f1b, interleaved."""
    microbatches: int = 2
    """Pipeline microbatches per step (pp > 1 only)."""
    dp_mode: str = "fsdp"
    """fsdp or ddp. DDP only applies when tp == pp == 1 (it is where comm hooks such as gradient
    compression apply); with tp or pp, dp always uses FSDP2 (TP + DDP loses parameters from
    state_dict after the first forward)."""

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "microbatches"):
            _check(isinstance(getattr(self, name), int), f"parallel.{name}", "must be an integer")
            _positive(getattr(self, name), f"parallel.{name}")
        _check(self.pp_schedule in PP_SCHEDULES, "parallel.pp_schedule",
               f"{self.pp_schedule!r} not in {PP_SCHEDULES}")
        _check(self.dp_mode in DP_MODES, "parallel.dp_mode", f"{self.dp_mode!r} not in {DP_MODES}")
        if self.pp > 1 and self.pp_schedule == "interleaved":
            rounds = max(1, self.microbatches // self.pp)
            _check(self.microbatches % rounds == 0, "parallel.microbatches",
                   f"{self.microbatches} must be a multiple of the rounds ({rounds}) for interleaved")

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    @property
    def stages_per_rank(self) -> int:
        return 2 if self.pp > 1 and self.pp_schedule == "interleaved" else 1

    @property
    def num_stages(self) -> int:
        return self.pp * self.stages_per_rank

    @property
    def uses_ddp(self) -> bool:
        return self.dp_mode == "ddp" and self.tp == 1 and self.pp == 1 and self.dp > 1

    def check_world(self, world_size: int) -> None:
        """Raise ConfigError unless pp * dp * tp == world_size. Call before any process group exists."""
        _check(self.world_size == world_size, "parallel",
               f"pp*dp*tp = {self.pp}*{self.dp}*{self.tp} = {self.world_size} != world size {world_size}")


@dataclass
class OptimConfig:
    """AdamW with linear warmup then cosine decay to min_lr_ratio * lr."""

    lr: float = 3e-3
    warmup: int = 10
    """Warmup steps (linear from lr/warmup to lr)."""
    cosine: bool = True
    """Cosine decay over train.steps after warmup; False keeps lr flat."""
    min_lr_ratio: float = 0.1
    clip: float = 1.0
    """Global gradient-norm clip; 0 disables clipping (the norm is still reported)."""
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95

    def __post_init__(self) -> None:
        _positive(self.lr, "optim.lr")
        _check(isinstance(self.warmup, int), "optim.warmup", "must be an integer")
        _nonneg(self.warmup, "optim.warmup")
        _check(isinstance(self.cosine, bool), "optim.cosine", "must be a boolean")
        _check(0 <= self.min_lr_ratio <= 1, "optim.min_lr_ratio", f"{self.min_lr_ratio} not in [0, 1]")
        _nonneg(self.clip, "optim.clip")
        _nonneg(self.weight_decay, "optim.weight_decay")
        _check(0 <= self.beta1 < 1, "optim.beta1", f"{self.beta1} not in [0, 1)")
        _check(0 <= self.beta2 < 1, "optim.beta2", f"{self.beta2} not in [0, 1)")


@dataclass
class DataConfig:
    """Byte-level corpus: the running interpreter's standard-library source files."""

    cache_dir: str = ""
    """Where the token files are cached; empty: $TRAINGUARD_CACHE or ~/.cache/trainguard."""
    max_bytes: int = 0
    """Cap on the corpus size in bytes (0: all files). Smaller corpora build faster for tests."""
    val_samples: int = 32
    """Held-out windows used for validation loss (fixed set, same every evaluation)."""

    def __post_init__(self) -> None:
        _check(isinstance(self.max_bytes, int), "data.max_bytes", "must be an integer")
        _nonneg(self.max_bytes, "data.max_bytes")
        _check(isinstance(self.val_samples, int), "data.val_samples", "must be an integer")
        _positive(self.val_samples, "data.val_samples")


PRECISIONS = ("fp32", "bf16")
AC_MODES = ("none", "attention", "all")
DEVICES = ("auto", "cpu", "cuda")


@dataclass
class TrainConfig:
    """Everything one training job needs; ``to_dict``/``from_dict`` round-trip through JSON."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    steps: int = 100
    """Optimizer steps to run (a resumed run continues up to this step)."""
    global_batch: int = 8
    """Samples per optimizer step over all dp ranks (the plan's batch_sizes may change it)."""
    grad_accum: int = 1
    """Micro-steps per optimizer step on each dp rank (pp > 1: use parallel.microbatches)."""
    seed: int = 0
    precision: str = "fp32"
    """fp32 or bf16 (autocast)."""
    bf16_after_step: int = 0
    """With precision bf16: run the first N steps in fp32, then switch to bf16 autocast."""
    activation_checkpointing: str = "none"
    """none, attention (recompute attention sub-blocks) or all (recompute whole blocks)."""
    compression: str = "none"
    """Gradient compression for DDP runs, passed to trainer.compression (none/powersgd/int8/int4)."""
    faults: list[str] = field(default_factory=list)
    """Fault-injection specs passed to trainer.faults (e.g. 'kill:rank=1:step=5')."""
    val_every: int = 0
    """Evaluate validation loss every N steps and at the end (0: only at the end)."""
    ckpt_dir: str = ""
    """Directory for checkpoints (step_XXXXXXXX subdirectories); empty disables checkpoints."""
    ckpt_every: int = 0
    """Save every N steps (0: only at the end and when the plan asks)."""
    resume: bool = True
    """Resume from the newest complete checkpoint in ckpt_dir when there is one."""
    device: str = "auto"
    """auto (cuda when available), cpu or cuda. cpu uses gloo, cuda uses NCCL."""
    threads: int = 1
    """torch intra-op threads per rank on CPU (1 keeps several ranks from oversubscribing cores)."""

    def __post_init__(self) -> None:
        for name in ("steps", "global_batch", "grad_accum", "threads"):
            _check(isinstance(getattr(self, name), int), name, "must be an integer")
            _positive(getattr(self, name), name)
        for name in ("seed", "bf16_after_step", "val_every", "ckpt_every"):
            _check(isinstance(getattr(self, name), int), name, "must be an integer")
            _nonneg(getattr(self, name), name)
        _check(self.precision in PRECISIONS, "precision", f"{self.precision!r} not in {PRECISIONS}")
        _check(self.activation_checkpointing in AC_MODES, "activation_checkpointing",
               f"{self.activation_checkpointing!r} not in {AC_MODES}")
        _check(self.device in DEVICES, "device", f"{self.device!r} not in {DEVICES}")
        _check(isinstance(self.compression, str) and bool(self.compression), "compression",
               "must be a non-empty string such as 'none'")
        _check(isinstance(self.faults, list) and all(isinstance(f, str) for f in self.faults), "faults",
               "must be a list of strings")
        p, m = self.parallel, self.model
        _check(m.heads % p.tp == 0, "parallel.tp", f"{p.tp} does not divide model.heads={m.heads}")
        _check(m.layers >= p.num_stages, "model.layers",
               f"{m.layers} < {p.num_stages} pipeline stages")
        # Shares may be uneven (a job shrunk to dp=3 keeps global_batch=8 as 3+3+2: the loss
        # normalisation keeps the gradient that of the whole global batch, train.py).
        quantum = p.microbatches if p.pp > 1 else 1
        _check(self.global_batch >= p.dp * quantum, "global_batch",
               f"{self.global_batch} gives some of the parallel.dp={p.dp} ranks no sample"
               + (f" (each needs a multiple of parallel.microbatches={quantum})" if quantum > 1 else ""))
        if p.pp > 1:
            _check(self.grad_accum == 1, "grad_accum",
                   "must be 1 with parallel.pp > 1 (pipeline microbatches accumulate gradients)")
            _check(self.global_batch % p.microbatches == 0, "parallel.microbatches",
                   f"{p.microbatches} does not divide global_batch={self.global_batch}")
        if self.compression != "none":
            _check(p.uses_ddp, "compression",
                   f"{self.compression!r} needs a DDP run (parallel.dp_mode=ddp, dp>1, tp=pp=1)")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, body: dict[str, Any]) -> TrainConfig:
        """Build from a (possibly partial) dict; unknown keys and wrong types raise ConfigError."""
        return _build(cls, body, "")

    @classmethod
    def from_json(cls, text: str) -> TrainConfig:
        try:
            body = json.loads(text)
        except ValueError as exc:
            raise ConfigError(f"spec: not JSON ({exc})") from None
        return cls.from_dict(body)


_NESTED: dict[str, type] = {"model": ModelConfig, "parallel": ParallelConfig, "optim": OptimConfig,
                            "data": DataConfig}


def _build(cls: type, body: object, prefix: str) -> Any:
    if not isinstance(body, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'spec'}: must be an object")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(body) - known)
    if unknown:
        raise ConfigError(f"{prefix}{unknown[0]}: unknown key")
    kwargs: dict[str, Any] = {}
    for name, value in body.items():
        key = f"{prefix}{name}"
        if name in _NESTED and cls is TrainConfig:
            kwargs[name] = _build(_NESTED[name], value, f"{key}.")
            continue
        kwargs[name] = _coerce(hints[name], value, key)
    try:
        return cls(**kwargs)
    except ConfigError as exc:
        # Nested __post_init__ messages already carry their own section prefix.
        raise exc from None


def _coerce(hint: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(hint)
    if origin in (list,):
        if not isinstance(value, list):
            raise ConfigError(f"{key}: must be a list")
        return list(value)
    if origin in (typing.Union, types.UnionType):
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: must be a number")
        return float(value)
    if hint is int or hint is bool or hint is str:
        if hint is int and (isinstance(value, bool) or not isinstance(value, int)):
            raise ConfigError(f"{key}: must be an integer")
        if hint is not int and not isinstance(value, hint):
            raise ConfigError(f"{key}: must be a {hint.__name__}")
        return value
    return value


def config_from_cli(*, nproc: int, dp: int | None = None, tp: int = 1, pp: int = 1, steps: int = 100,
                    faults: list[str] | None = None, overrides: list[str] | None = None) -> dict[str, Any]:
    """The validated job spec (``TrainConfig.to_dict()``) for ``trainguard train`` arguments.

    ``dp`` defaults to nproc / (tp * pp). ``overrides`` are ``key=value`` with dotted keys
    (``model.layers=4``); values parse as JSON when they can (numbers, true, lists), else stay strings.
    Raises ConfigError (a ValueError) naming the key.

    >>> config_from_cli(nproc=4, tp=2, overrides=["model.layers=2"])["parallel"]["dp"]
    2
    """
    if dp is None:
        _check(nproc % (tp * pp) == 0, "parallel.dp", f"nproc={nproc} is not divisible by tp*pp={tp * pp}")
        dp = nproc // (tp * pp)
    body: dict[str, Any] = {"parallel": {"dp": dp, "tp": tp, "pp": pp}, "steps": steps, "faults": list(faults or [])}
    for item in overrides or []:
        key, eq, raw = item.partition("=")
        key = key.strip()
        _check(bool(eq) and bool(key), key or item, "override must be KEY=VALUE")
        try:
            value: Any = json.loads(raw)
        except ValueError:
            value = raw
        node = body
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            _check(isinstance(node, dict), key, "is not a section")
        node[parts[-1]] = value
    cfg = TrainConfig.from_dict(body)
    cfg.parallel.check_world(nproc)
    return cfg.to_dict()
