"""The training loop of one rank: data, forward/backward over any (pp, dp, tp) layout, the global
gradient norm and clipping, AdamW with a warmup+cosine schedule that the agent's plan can scale or
override, per-step telemetry, validation, checkpoints at step boundaries.

Loss normalisation (why uneven batches are exact): every rank's loss is the *sum* of its token
losses times ``dp / global_tokens``. DDP and FSDP2 average gradients over the dp ranks, so the
reduced gradient is the gradient of (sum over all tokens) / global_tokens, the same as one
process computing the mean loss over the whole global batch, whatever the per-rank split.

One small all-reduce per step carries the loss sum, the global gradient norm² and each dp rank's
local (pre-reduction) gradient norm².

The loop talks to the agent only through the public API (``trainguard.Run``), like any user
script: ``run.step`` reports each step's telemetry with its phases, ``run.plan`` is the agent's
plan (the same version on every rank at the same step), ``run.checkpoint``/``run.restore`` save
into and load from the memory tier the agent fans out to its other tiers.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel as DDP

from trainguard.agent.wire import Plan
from trainguard.run import rendezvous_clock
from trainguard.run.alignment import UpdateAlignment
from trainguard.run.run import Run, init
from trainguard.trainer.config import TrainConfig
from trainguard.trainer.data import Corpus, Sampler, split_counts, val_index, windows
from trainguard.trainer.evidence import EvidenceProbe
from trainguard.trainer.metrics import (
    LocalGradMeter,
    bubble_frac,
    comm_bytes_estimate,
    mem_bytes,
    mem_frag,
    peak_flops,
)
from trainguard.trainer.model import flops_per_token
from trainguard.trainer.parallel import (
    Layout,
    RankEnv,
    build_parallel_model,
    build_schedule,
    init_distributed,
    local_stage_ids,
    pick_device,
    sq_norm_share,
    unwrap,
)

StepSink = Callable[[dict[str, Any]], None]


def lr_at(cfg: TrainConfig, step: int) -> float:
    """The configured schedule at ``step`` (0-based): linear warmup, then cosine to min_lr_ratio."""
    o = cfg.optim
    if o.warmup and step < o.warmup:
        return o.lr * (step + 1) / o.warmup
    if not o.cosine:
        return o.lr
    progress = min(1.0, (step - o.warmup) / max(1, cfg.steps - o.warmup))
    return o.lr * (o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


@dataclass
class StepResult:
    step: int
    loss: float
    grad_norm: float
    lr: float
    samples: int
    step_s: float
    val_loss: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class Trainer:
    """One rank of a training job. ``run()`` trains to ``cfg.steps`` (or a plan's stop) and returns 0.

    ``sink`` receives one dict per step on global rank 0 (step, loss, lr, step_s, tokens_per_s, ...).
    ``run`` defaults to ``trainguard.init()`` for this rank's data-parallel position.
    """

    def __init__(self, cfg: TrainConfig, env: RankEnv, *, sink: StepSink | None = None, run: Run | None = None) -> None:
        self.cfg = cfg
        self.env = env
        self.sink = sink
        self.run_handle = run
        self.step = 0
        self._applied_version = -1
        self.history: list[StepResult] = []

    @property
    def plan(self) -> Plan:
        """The agent's plan in force (what ``run.plan`` says, at the wire level)."""
        return self.run_handle.raw_plan if self.run_handle is not None else Plan()

    # -- set-up ----------------------------------------------------------------------------------

    def setup(self) -> None:
        cfg = self.cfg
        self.device = pick_device(cfg, self.env.local_rank)
        if self.device.type == "cpu":
            torch.set_num_threads(cfg.threads)
        rendezvous_clock.watch()  # a recovery's timeline tells the rendezvous from the start-up by it
        self.layout: Layout = init_distributed(cfg, self.env, self.device)
        lay = self.layout
        if self.run_handle is None:
            # Every step: its steps are long next to one store round trip, and migrations settle faster.
            # It applies the whole plan: batch sizes, LR and stop.
            self.run_handle = init(job=self.env.job, dp_rank=lay.dp_rank, dp_size=lay.dp, plan_every=1,
                                   applies=("batch_sizes", "lr", "stop"))
        self.corpus = Corpus.load(cfg.data.cache_dir, cfg.data.max_bytes)
        span = cfg.model.context + 1
        self.sampler = Sampler(len(self.corpus.train) // span, cfg.seed)
        self.val_idx = val_index(len(self.corpus.val) // span, cfg.data.val_samples)
        self.chunks = build_parallel_model(cfg, lay)
        self.stage_ids = local_stage_ids(cfg.parallel, lay.pp_rank)
        self.has_first = 0 in self.stage_ids
        self.has_last = cfg.parallel.num_stages - 1 in self.stage_ids
        self.params = [p for c in self.chunks for p in c.parameters()]
        # The optimizer exists before the first forward (TP + DDP loses parameters after it) and uses no foreach:
        # its parameters are DTensors on different meshes (dp only, or dp x tp) and plain tensors.
        # One optimizer per local stage, so each chunk's state can be saved and resharded on its own.
        self.optimizers = [self._make_optimizer(list(c.parameters())) for c in self.chunks]
        self.grad_meter = LocalGradMeter(self.chunks, lay.tp)
        # update_cos for the controller's LR guard (this rank's shards under tp/fsdp: no collective).
        self.alignment = UpdateAlignment(self.params)
        self._update_cos: float | None = None
        # The evidence controller's trajectory cosine and branch snapshots; a DDP replica's values
        # are dp rank 0's, so only it adds them to the step's all-reduce.
        self.evidence = EvidenceProbe(self.params, measures=cfg.parallel.dp_mode != "ddp" or lay.dp_rank == 0)
        self._traj_cos: float | None = None
        quantum = cfg.parallel.microbatches if cfg.parallel.pp > 1 else 1
        self.even_sizes = [n * quantum for n in split_counts(cfg.global_batch // quantum, lay.dp)]
        self.batch_sizes = list(self.even_sizes)
        self._schedule: object | None = None
        self._schedule_batch = -1
        self._loss_scale = 1.0
        self._plain_compute_s = 0.0
        self.compression = self._setup_compression()
        self.faults = self._setup_faults()
        self._peak = peak_flops(self.device)
        # Compute judged up to the last gradient on the device's clock: on CUDA the DDP/FSDP wait for
        # the gradient all-reduce at the end of backward would otherwise count as compute.
        self.run_handle.watch_gradients(self.params)
        # The agent picked (and verified) the newest checkpoint across its tiers for this attempt.
        restored = self.run_handle.restore(self.checkpoint_state())
        if restored:
            self.step = restored
            handle = self.run_handle
            where = "a snapshot" if handle.restored_from == "snapshot" else (handle.env.restore_path or "the memory tier")
            self._log(f"restored step {self.step} from {where}")
        elif cfg.ckpt_dir and cfg.resume:
            from trainguard.trainer.checkpoint import latest_checkpoint, load_checkpoint
            latest = latest_checkpoint(cfg.ckpt_dir)
            if latest is not None:
                load_checkpoint(self, latest)

    def checkpoint_state(self) -> dict[str, Any]:
        """What a checkpoint of this rank holds: every local stage's parameters and optimizer state by
        layout-independent name (``model``, ``optim``), and the sampler's position."""
        from trainguard.trainer.checkpoint import checkpoint_state
        return checkpoint_state(self)

    def _make_optimizer(self, params: list[nn.Parameter]) -> torch.optim.Optimizer:
        o = self.cfg.optim
        decay = [p for p in params if p.ndim >= 2]
        no_decay = [p for p in params if p.ndim < 2]
        return torch.optim.AdamW(
            [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=o.lr, betas=(o.beta1, o.beta2), foreach=False)

    def _setup_compression(self) -> Any:
        if self.cfg.compression == "none":
            return None
        from trainguard.trainer.compression import register_compression
        ddp = self.chunks[0]
        assert isinstance(ddp, DDP)
        return register_compression(ddp, self.cfg.compression, self.layout.dp_group)

    def _setup_faults(self) -> Any:
        from trainguard.trainer.faults import FaultInjector
        injector = FaultInjector.from_specs(self.cfg.faults, self.env.rank)
        return injector if injector else None

    # -- plan ------------------------------------------------------------------------------------

    def _apply_plan(self, plan: Plan) -> None:
        """Take a plan (same version on every rank, at the same step boundary)."""
        first, self._applied_version = self._applied_version < 0, plan.version
        done = self.evidence.apply(plan.extra.get("evidence"), self.step, [*self.chunks, *self.optimizers],
                                   first=first)
        if done:
            self.alignment = UpdateAlignment(self.params)  # its last update does not span a restore
            self._log(f"plan v{plan.version}: evidence controller: {done}")
        sizes = plan.batch_sizes
        if sizes is None:
            self.batch_sizes = list(self.even_sizes)
        elif self._sizes_ok(sizes):
            self.batch_sizes = list(sizes)
        else:
            self._log(f"plan v{plan.version}: batch_sizes {sizes} do not fit dp={self.layout.dp} "
                      f"(pp needs multiples of {self.cfg.parallel.microbatches}); kept {self.batch_sizes}")

    def _sizes_ok(self, sizes: list[int]) -> bool:
        p = self.cfg.parallel
        if len(sizes) != self.layout.dp or sum(sizes) <= 0 or min(sizes) < 0:
            return False
        if p.pp > 1:
            return all(s > 0 and s % p.microbatches == 0 for s in sizes)
        return True

    def current_lr(self) -> float:
        if self.plan.lr is not None:
            return float(self.plan.lr)
        return lr_at(self.cfg, self.step) * self.plan.lr_scale

    # -- one step --------------------------------------------------------------------------------

    def _autocast(self) -> Any:
        cfg = self.cfg
        bf16 = cfg.precision == "bf16" and self.step >= cfg.bf16_after_step
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=bf16)

    def _loss_fn(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum")
        return loss * self._loss_scale

    def _set_sync(self, sync: bool) -> None:
        for c in self.chunks:
            if isinstance(c, FSDPModule):
                c.set_requires_gradient_sync(sync)
            elif isinstance(c, DDP):
                c.require_backward_grad_sync = sync

    def _forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """Forward and backward over this rank's share; returns the (unscaled) summed token loss."""
        cfg = self.cfg
        if cfg.parallel.pp > 1:
            return self._pipeline_step(x, y)
        model = self.chunks[0]
        total = 0.0
        pieces = np.array_split(np.arange(x.shape[0]), cfg.grad_accum)
        for i, rows in enumerate(pieces):
            # Every rank runs the same number of micro-steps (maybe on zero rows): FSDP2's
            # all-gathers and DDP's all-reduce are collectives that all ranks must join.
            self._set_sync(i == len(pieces) - 1)
            if len(rows):
                xb, yb, weight = x[rows[0]:rows[-1] + 1], y[rows[0]:rows[-1] + 1], 1.0
            else:
                # An idle rank still runs forward and backward (FSDP2's all-gathers and DDP's
                # all-reduce need every rank) on one placeholder row whose loss counts zero: an
                # empty batch would not do, DTensor's reshape rules loop forever on a 0-sized dim.
                xb, yb, weight = torch.zeros_like(x[:1]), torch.zeros_like(y[:1]), 0.0
                if x.shape[0] == 0:
                    xb = torch.zeros((1, x.shape[1]), dtype=x.dtype, device=x.device)
                    yb = torch.zeros_like(xb)
            with self._autocast():
                logits = model(xb)
            loss = self._loss_fn(logits, yb) * weight
            loss.backward()
            total += float(loss.detach()) / self._loss_scale
        return total

    def _pipeline_step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        if self._schedule is None or self._schedule_batch != x.shape[0]:
            self._schedule = build_schedule(self.cfg, self.layout, self.chunks, self._loss_fn)
            self._schedule_batch = x.shape[0]
        sched: Any = self._schedule
        losses: list[torch.Tensor] = []
        with self._autocast():
            if self.has_first:
                sched.step(x, target=y if self.has_last else None, losses=losses)
            elif self.has_last:
                sched.step(target=y, losses=losses)
            else:
                sched.step()
        return float(sum(float(v.detach()) for v in losses)) / self._loss_scale if losses else 0.0

    def train_step(self) -> StepResult:
        cfg, lay = self.cfg, self.layout
        run = self.run_handle
        assert run is not None
        if self.faults is not None:
            self.faults.before_step(self.step)
        with run.step(self.step) as s:
            # The plan in force was agreed at the end of the previous step (same version everywhere).
            if run.raw_plan.version != self._applied_version:
                self._apply_plan(run.raw_plan)
            self.evidence.before_step(self.step)
            t0 = time.perf_counter()
            with s.phase("data"):
                sizes = self.batch_sizes
                global_n = sum(sizes)
                idx = self.sampler.next_step(sizes)[lay.dp_rank]
                batch = torch.from_numpy(windows(self.corpus.train, cfg.model.context, idx)).to(self.device)
                x, y = batch[:, :-1], batch[:, 1:]
                self._loss_scale = lay.dp / (global_n * cfg.model.context)
                lr = self.current_lr()
            n_local = sizes[lay.dp_rank]
            s.samples, s.tokens = n_local, n_local * cfg.model.context
            with s.phase("compute"):
                t1, c1 = time.perf_counter(), time.thread_time()
                # A slow fault burns real CPU in proportion to this rank's own compute (faults.py), before
                # the forward pass: inside the compute the gradient sync waits on, as a slow device would
                # be, so moving samples off the rank really shortens the step. Sized from the previous step.
                slow_s = self.faults.after_compute(self.step, self._plain_compute_s) if self.faults is not None else 0.0
                self.grad_meter.reset()
                loss_sum = self._forward_backward(x, y)
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                t2, c2 = time.perf_counter(), time.thread_time()
            # On CPU the main thread does the compute (torch threads = 1 by default) and only sleeps
            # while gloo works, so its CPU time is the compute and the rest of the wall time is waiting.
            compute_s = (c2 - c1) if self.device.type == "cpu" else t2 - t1
            self._plain_compute_s = max(compute_s - slow_s, 0.0)
            if self.faults is not None and self.faults.loss_override(self.step):
                loss_sum = float("nan")

            # The one per-step collective of the loop itself: loss, norms, a NaN flag.
            dp = lay.dp
            vec = torch.zeros(7 + dp, dtype=torch.float64, device=self.device)  # NCCL needs device tensors
            if self.has_last and lay.tp_rank == 0:
                vec[0] = loss_sum
            vec[1] = sq_norm_share([p.grad for p in self.params if p.grad is not None], {"dp": dp, "tp": lay.tp})
            if math.isnan(loss_sum):
                vec[3] = 1.0
            vec[4 + lay.dp_rank] = self.grad_meter.share()
            traj = self.evidence.terms(self.step + 1)
            if traj is not None:
                vec[4 + dp:] = traj.to(vec)
            with s.phase("comm"):
                dist.all_reduce(vec)

            loss = float(vec[0]) / (global_n * cfg.model.context)
            if vec[3] > 0:
                loss = float("nan")
            grad_norm = math.sqrt(max(float(vec[1]), 0.0)) if math.isfinite(float(vec[1])) else float("nan")
            local_sq = float(vec[4 + lay.dp_rank])
            dot, gg, dd = vec[4 + dp:].tolist()
            self._traj_cos = max(-1.0, min(1.0, dot / math.sqrt(gg * dd))) if gg * dd > 0 else None
            # The local gradient above is of (sum of local token losses) * dp / global_tokens; report the
            # norm² of the local *mean* loss gradient, what a gradient-noise-scale estimate expects.
            local_sq = local_sq * (global_n / (dp * n_local)) ** 2 if n_local else 0.0

            with s.phase("optim"):
                for opt in self.optimizers:
                    for group in opt.param_groups:
                        group["lr"] = lr
                if math.isfinite(grad_norm) and math.isfinite(loss):
                    if cfg.optim.clip > 0 and grad_norm > cfg.optim.clip:
                        coef = cfg.optim.clip / (grad_norm + 1e-6)
                        for p in self.params:
                            if p.grad is not None:
                                p.grad.mul_(coef)
                    for opt in self.optimizers:
                        opt.step()
                    self._update_cos = self.alignment.after_step()
                else:
                    self._update_cos = None
                    self._log(f"step {self.step}: non-finite loss or gradient norm, update skipped")
                for opt in self.optimizers:
                    opt.zero_grad(set_to_none=True)
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)

            plan_version = run.raw_plan.version
            self.step += 1
            step_s = time.perf_counter() - t0
            val_loss = None
            if (cfg.val_every and self.step % cfg.val_every == 0) or self.step == cfg.steps:
                val_loss = self.evaluate()
            result = StepResult(self.step, loss, grad_norm, lr, global_n, step_s, val_loss)
            self._report(s, result, n_local, local_sq, plan_version)
        return result

    # -- validation ------------------------------------------------------------------------------

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean token loss on the fixed validation set; each dp rank takes every dp-th window and
        activations travel between pipeline stages by point-to-point sends."""
        cfg, lay = self.cfg, self.layout
        idx = self.val_idx[lay.dp_rank::lay.dp]
        data = torch.from_numpy(windows(self.corpus.val, cfg.model.context, idx)).to(self.device)
        x, y = data[:, :-1], data[:, 1:]
        total = torch.zeros(2, dtype=torch.float64, device=self.device)
        n_stages = cfg.parallel.num_stages
        act_shape = (x.shape[0], x.shape[1], cfg.model.d_model)
        act: torch.Tensor = x
        for sid in range(n_stages):
            owner = sid % lay.pp
            if owner != lay.pp_rank:
                continue
            chunk = self.chunks[self.stage_ids.index(sid)]
            if sid > 0:
                act = torch.empty(act_shape, device=self.device)
                dist.recv(act, group=lay.pp_group, group_src=(sid - 1) % lay.pp)
            with self._autocast():
                out = chunk(act)
            if sid < n_stages - 1:
                dist.send(out.float().contiguous(), group=lay.pp_group, group_dst=(sid + 1) % lay.pp)
            elif lay.tp_rank == 0:
                total[0] = F.cross_entropy(out.float().reshape(-1, out.shape[-1]), y.reshape(-1), reduction="sum")
                total[1] = y.numel()
        dist.all_reduce(total)
        return float(total[0] / total[1]) if total[1] > 0 else float("nan")

    # -- reporting -------------------------------------------------------------------------------

    def _report(self, s: Any, r: StepResult, n_local: int, local_sq: float, plan_version: int) -> None:
        cfg = self.cfg
        now = time.time()
        flops = flops_per_token(cfg.model) * r.samples * cfg.model.context / self.env.world_size / max(r.step_s, 1e-9)
        comm_b = comm_bytes_estimate(cfg, n_local)
        ratio = None
        if self.compression is not None:
            comm_b = int(self.compression.last_step_bytes_sent)
            ratio = float(self.compression.ratio)
        s.report(loss=r.loss, lr=r.lr, grad_norm=r.grad_norm, local_grad_sq=local_sq, mem_bytes=mem_bytes(self.device),
                 flops_per_s=flops, mfu=flops / self._peak if self._peak else None, comm_bytes=comm_b,
                 bubble_frac=bubble_frac(cfg), mem_frag=mem_frag(self.device), val_loss=r.val_loss,
                 compress_ratio=ratio, update_cos=self._update_cos,
                 traj_cos=self._traj_cos if self.env.rank == 0 else None)
        self.history.append(r)
        if self.sink is not None and self.env.rank == 0:
            row: dict[str, Any] = {
                "step": r.step, "loss": r.loss, "lr": r.lr, "step_s": round(r.step_s, 5),
                "tokens_per_s": round(r.samples * cfg.model.context / max(r.step_s, 1e-9), 1),
                "grad_norm": r.grad_norm, "batch": r.samples, "plan_version": plan_version,
                "time": round(now, 4)}
            if r.val_loss is not None:
                row["val_loss"] = r.val_loss
            handle = self.run_handle
            if handle is not None:
                row["attempt"] = handle.restart_count  # a restart that lost no step shows here only
            snap = handle.snapshot_stats if handle is not None else None
            if handle is not None and snap is not None:  # the previous step's (this step's comes after the row)
                row["snapshot_s"] = round(snap.last_stall_s, 6)
                row["snapshot_every"] = handle.snapshot_every
                row["snapshot_cost_s"] = round(snap.last_cost_s, 6)
            if ratio is not None:
                row["comm_bytes"] = comm_b
                row["compress_ratio"] = ratio
            self.sink(row)

    def _log(self, text: str) -> None:
        if self.env.rank == 0:
            print(f"trainguard trainer: {text}", file=sys.stderr, flush=True)

    # -- loop ------------------------------------------------------------------------------------

    def run(self) -> int:
        """Train until cfg.steps or a plan asks to stop; checkpoints at the configured points."""
        from trainguard.trainer.checkpoint import save_checkpoint, step_dir
        cfg = self.cfg
        run = self.run_handle
        assert run is not None
        while self.step < cfg.steps:
            result = self.train_step()
            plan = run.plan
            asked = plan.checkpoint_now
            want_ckpt = bool(cfg.ckpt_dir) and (
                (cfg.ckpt_every and self.step % cfg.ckpt_every == 0) or asked
                or plan.stop or self.step == cfg.steps)
            # A diverged step is never checkpointed: it is what a rollback must go back before.
            # Built only when due: the trainer's state view costs ~60 us a step on a loaded node.
            if math.isfinite(result.loss) and (run.snapshot_due(self.step - 1) or run.checkpoint_due(self.step - 1)):
                run.checkpoint(self.step - 1, self.checkpoint_state())
            if want_ckpt:
                save_checkpoint(self, step_dir(cfg.ckpt_dir, self.step))
            if plan.stop:
                self._log(f"plan v{plan.version} asked to stop at step {self.step}")
                break
        return 0

    def close(self) -> None:
        if self.run_handle is not None:
            self.run_handle.close()
        if dist.is_initialized():
            dist.barrier()
            # DDP's reducer holds the process group; dropped after the group, its destructor joins
            # gloo's threads while holding the GIL, which one of them may need (a rare hang at exit).
            self.chunks, self.optimizers, self.params = [], [], []
            self._schedule = self.compression = None
            dist.destroy_process_group()


def model_parts(trainer: Trainer) -> list[nn.Module]:
    return [unwrap(c) if isinstance(c, DDP) else c for c in trainer.chunks]
