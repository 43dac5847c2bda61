"""Saving into the agent's memory checkpoint tier and restoring what the agent picked.

The ranks write only the in-memory copy (a DCP save into ``/dev/shm``, into the files of a pruned
checkpoint so the pages are already there: FACTS.md measured fresh tmpfs pages ~7x slower); rank 0
commits it with a checksummed manifest. The agent replicates it to disk and object store in the
background, and on a restart hands the ranks the newest verified checkpoint in
``$TRAINGUARD_RESTORE``.

Environment (set by the agent's launcher): ``TRAINGUARD_CKPT_MEMORY_ROOT`` (tier root),
``TRAINGUARD_CKPT_MEMORY_EVERY`` (steps), ``TRAINGUARD_JOB``, ``TRAINGUARD_RESTORE``.

A job that spans nodes also gets ``TRAINGUARD_CKPT_PART`` (this node's name) and
``TRAINGUARD_CKPT_PARTS`` (every node of the attempt, comma-separated): each node's local rank 0
stages in its own node's memory tier, every rank writes its DCP file there, and each node commits
its part under ``<job>.part-<node>`` (``agent.cluster.gang.part_key``) with the list of parts in
the manifest; the union of the parts' files is one DCP checkpoint, which the agents assemble
before a restart.
"""

from __future__ import annotations

import io
import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystem

from agent.checkpoint.memory import MemoryTier, open_for_overwrite
from agent.wire import ENV_JOB

if TYPE_CHECKING:
    from trainer.train import Trainer

ENV_MEMORY_ROOT = "TRAINGUARD_CKPT_MEMORY_ROOT"
ENV_MEMORY_EVERY = "TRAINGUARD_CKPT_MEMORY_EVERY"
ENV_RESTORE = "TRAINGUARD_RESTORE"
ENV_PART = "TRAINGUARD_CKPT_PART"
ENV_PARTS = "TRAINGUARD_CKPT_PARTS"


class ReuseFileSystem(FileSystem):
    """DCP file system that overwrites the memory tier's recycled files instead of new ones."""

    @contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[io.IOBase]:
        if mode != "wb":
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with open_for_overwrite(path) as stream:
            yield stream  # type: ignore[misc]


@dataclass
class SaveStats:
    saves: int = 0
    last_step: int = -1
    last_stall_s: float = 0.0
    last_bytes: int = 0


class MemoryTierWriter:
    def __init__(self, job: str, root: str, every: int, part: str = "", parts: tuple[str, ...] = ()) -> None:
        self.job = job
        self.root = root
        self.every = every
        self.part = part
        self.parts = parts
        self.stats = SaveStats()
        self._tier: MemoryTier | None = None

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> MemoryTierWriter | None:
        env = os.environ if environ is None else environ
        root = env.get(ENV_MEMORY_ROOT, "")
        if not root:
            return None
        every = int(env.get(ENV_MEMORY_EVERY, "100") or 100)
        part = env.get(ENV_PART, "")
        parts = tuple(p for p in env.get(ENV_PARTS, "").split(",") if p)
        return cls(env.get(ENV_JOB, "standalone"), root, max(1, every), part, parts)

    @property
    def tier_job(self) -> str:
        """The memory tier's key for what this node writes (a part of a job spanning nodes)."""
        from agent.cluster.gang import part_key

        return part_key(self.job, self.part) if self.part else self.job

    def due(self, step: int, force: bool = False) -> bool:
        return force or step % self.every == 0

    def save(self, trainer: Trainer) -> str:
        """Collective: every rank writes its shards, rank 0 stages and commits."""
        from trainer.checkpoint import META, _state

        t0 = time.perf_counter()
        rank = dist.get_rank()
        # One committer per node (its local rank 0); a single-node job has exactly one.
        local_rank = int(os.environ.get("LOCAL_RANK", rank)) if self.part else rank
        committer = local_rank == 0
        staged: str | None = None
        if committer:
            if self._tier is None:
                self._tier = MemoryTier(self.root)
            staged_dir = self._tier.stage(self.tier_job, trainer.step)
            os.makedirs(staged_dir / "rng", exist_ok=True)
            staged = str(staged_dir)
        if self.part:
            paths: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(paths, staged)
            path = str(paths[rank - local_rank])
        else:
            box: list[Any] = [staged]
            dist.broadcast_object_list(box, src=0)
            path = str(box[0])
        state, _ = _state(trainer)
        writer = dcp.FileSystemWriter(path, single_file_per_rank=True)
        writer.fs = ReuseFileSystem()
        dcp.save(state, storage_writer=writer)
        torch.save({"torch": torch.get_rng_state()}, os.path.join(path, "rng", f"rank{rank}.pt"))
        dist.barrier()
        if rank == 0:
            meta = {
                "step": trainer.step,
                "sampler": trainer.sampler.state(),
                "plan": json.loads(trainer.plan.encode()),
                "ckpt_id_seen": trainer._ckpt_id_seen,
                "world_size": dist.get_world_size(),
                "config": trainer.cfg.to_dict(),
            }
            with open(os.path.join(path, META), "w") as fh:
                json.dump(meta, fh)
        if committer:
            extra: dict[str, Any] = {"world_size": dist.get_world_size()}
            if self.part:
                extra |= {"job": self.job, "part": self.part, "parts": list(self.parts)}
            assert self._tier is not None
            self._tier.commit(self.tier_job, trainer.step, extra, staged=path, prune=False)
        dist.barrier()
        self.stats.saves += 1
        self.stats.last_step = trainer.step
        self.stats.last_stall_s = time.perf_counter() - t0
        return path


def restore_path(environ: dict[str, str] | None = None) -> str | None:
    """The checkpoint the agent picked for this attempt (verified by the agent), if any."""
    env = os.environ if environ is None else environ
    path = env.get(ENV_RESTORE, "")
    return path if path and os.path.isdir(path) else None
