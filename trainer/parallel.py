"""Process groups, the (pp, dp, tp) device mesh, and applying TP / FSDP2 / DDP / pipelining to the model.

Rank layout: ``rank = (pp_idx * dp + dp_idx) * tp + tp_idx`` (tp fastest, as ``init_device_mesh``
lays out a ("pp", "dp", "tp") mesh), so the ranks of one TP group are neighbours.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.nn.parallel import DistributedDataParallel as DDP

from trainguard.trainer.config import ParallelConfig, TrainConfig
from trainguard.trainer.model import GPT, build_stage

TP_PLAN = {"attn.q": "col", "attn.k": "col", "attn.v": "col", "attn.o": "row", "mlp.up": "col", "mlp.down": "row"}


@dataclass(frozen=True)
class RankEnv:
    """This process's place in the job, from the launcher's environment (torchrun conventions)."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    job: str

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> RankEnv:
        env = dict(os.environ if environ is None else environ)
        return cls(rank=int(env.get("RANK", "0")), world_size=int(env.get("WORLD_SIZE", "1")),
                   local_rank=int(env.get("LOCAL_RANK", env.get("RANK", "0"))),
                   master_addr=env.get("MASTER_ADDR", "127.0.0.1"), master_port=int(env.get("MASTER_PORT", "29500")),
                   job=env.get("TRAINGUARD_JOB", "standalone"))


@dataclass
class Layout:
    """Coordinates of this rank on the mesh and the groups it talks through."""

    mesh: DeviceMesh
    pp: int
    dp: int
    tp: int
    pp_rank: int
    dp_rank: int
    tp_rank: int
    device: torch.device

    @property
    def pp_group(self) -> dist.ProcessGroup:
        return self.mesh["pp"].get_group()

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self.mesh["dp"].get_group()


def pick_device(cfg: TrainConfig, local_rank: int) -> torch.device:
    if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()):
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_distributed(cfg: TrainConfig, env: RankEnv, device: torch.device) -> Layout:
    """Check the layout against the world size, then create the process group and the mesh."""
    cfg.parallel.check_world(env.world_size)
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://{env.master_addr}:{env.master_port}",
                                rank=env.rank, world_size=env.world_size)
    p = cfg.parallel
    if p.pp == 1 and p.tp == 1:
        # Data parallel alone: a 1-D mesh over the world's own group. The 3-D one makes a process
        # group for each rank's size-1 pp and tp dimension, 8 gloo groups on 4 ranks (~30 ms of
        # every rank's start, which a restart waits for).
        mesh = init_device_mesh(device.type, (p.dp,), mesh_dim_names=("dp",))
        coords = mesh.get_coordinate()
        assert coords is not None
        return Layout(mesh, 1, p.dp, 1, 0, coords[0], 0, device)
    mesh = init_device_mesh(device.type, (p.pp, p.dp, p.tp), mesh_dim_names=("pp", "dp", "tp"))
    coords = mesh.get_coordinate()
    assert coords is not None
    return Layout(mesh, p.pp, p.dp, p.tp, coords[0], coords[1], coords[2], device)


def local_stage_ids(p: ParallelConfig, pp_rank: int) -> list[int]:
    """Pipeline stages on this rank: one, or two (pp_rank and pp_rank + pp) when interleaved."""
    return [pp_rank + k * p.pp for k in range(p.stages_per_rank)]


def apply_tp(module: GPT, mesh: DeviceMesh) -> None:
    styles = {"col": ColwiseParallel, "row": RowwiseParallel}
    for block in module.layers.values():
        parallelize_module(block, mesh, {name: styles[kind]() for name, kind in TP_PLAN.items()})


def build_parallel_model(cfg: TrainConfig, layout: Layout) -> list[nn.Module]:
    """This rank's model chunks (one per local pipeline stage), with TP, FSDP2 or DDP applied.

    Order matters: TP first (it turns weights into DTensors on the tp mesh), then FSDP2 per block
    and on the stage root (2-D DTensors on (dp, tp)), as torchtitan does. DDP wraps the whole model
    only for dp-only runs (parallel.uses_ddp), where comm hooks such as compression apply.
    """
    p = cfg.parallel
    chunks: list[nn.Module] = []
    for stage in local_stage_ids(p, layout.pp_rank):
        model = build_stage(cfg.model, cfg.seed, stage, p.num_stages, cfg.activation_checkpointing)
        model.to(layout.device)
        if p.tp > 1:
            apply_tp(model, layout.mesh["tp"])
        if p.uses_ddp:
            # PowerSGD issues its second all-reduce (Q) from a callback of the first (P): with
            # several buckets, ranks can interleave one bucket's Q with the next bucket's P
            # differently, which gloo reports as a size mismatch. One bucket keeps the order fixed
            # (an explicit cap also sets the first bucket's size, otherwise 1 MiB).
            one_bucket = cfg.compression == "powersgd" and layout.device.type == "cpu"
            # No init sync: every rank has just built the same weights from cfg.seed (init_params)
            # and a restore overwrites them alike; DDP's shape check and broadcast of them were
            # ~12 ms of every start and restart at 4 ranks on this machine kind.
            ddp = DDP(model, process_group=layout.dp_group,
                      device_ids=[layout.device.index] if layout.device.type == "cuda" else None,
                      bucket_cap_mb=1024 if one_bucket else None, init_sync=False)
            chunks.append(ddp)
            continue
        if p.dp > 1:
            # In a pipeline each block runs once per microbatch: keep it gathered between them.
            reshard = p.pp == 1
            for block in model.layers.values():
                fully_shard(block, mesh=layout.mesh["dp"], reshard_after_forward=reshard)
            fully_shard(model, mesh=layout.mesh["dp"], reshard_after_forward=reshard)
        chunks.append(model)
    return chunks


def unwrap(module: nn.Module) -> GPT:
    inner = module.module if isinstance(module, DDP) else module
    assert isinstance(inner, GPT)
    return inner


def build_schedule(cfg: TrainConfig, layout: Layout, chunks: list[nn.Module],
                   loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> object:
    """A pipeline schedule over this rank's stages. Built again when the microbatch shape changes:
    stages infer their send/receive buffer shapes on first use."""
    p = cfg.parallel
    stages = [PipelineStage(chunk, sid, p.num_stages, layout.device, group=layout.pp_group)
              for chunk, sid in zip(chunks, local_stage_ids(p, layout.pp_rank), strict=True)]
    # scale_grads=False: the loss is already normalised by the global token count (exact under
    # uneven batches), so the schedule must not divide by the microbatch count again.
    if p.pp_schedule == "interleaved":
        return ScheduleInterleaved1F1B(list[Any](stages), p.microbatches, loss_fn=loss_fn, scale_grads=False)
    cls = ScheduleGPipe if p.pp_schedule == "gpipe" else Schedule1F1B
    return cls(stages[0], p.microbatches, loss_fn=loss_fn, scale_grads=False)


def replicas(t: torch.Tensor, group: dict[str, int]) -> int:
    """How many ranks of ``group`` (mesh dimension name -> size; every rank in it holds this
    parameter) hold the same values as this rank's local piece of ``t``. Squared norms summed
    over the group are divided by it so that duplicates count once."""
    dup = 1
    names = t.device_mesh.mesh_dim_names or () if isinstance(t, DTensor) else ()
    for dim_name, size in group.items():
        if dim_name not in names:
            dup *= size  # the tensor is not split along this dimension: every rank has it all
            continue
        assert isinstance(t, DTensor)
        if isinstance(t.placements[names.index(dim_name)], Replicate):
            dup *= size
    return dup


def local_piece(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def sq_norm_share(tensors: list[torch.Tensor], group: dict[str, int]) -> torch.Tensor:
    """This rank's share of the squared norm of ``tensors`` over a group (sum the shares: the norm²)."""
    total = torch.zeros((), dtype=torch.float64)
    for t in tensors:
        piece = local_piece(t).detach()
        total += piece.double().pow(2).sum().cpu() / replicas(t, group)
    return total
