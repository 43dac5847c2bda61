"""Saving into the agent's memory checkpoint tier and restoring what the agent picked.

The ranks write only the in-memory copy (a DCP save into ``/dev/shm``, into the files of a pruned
checkpoint so the pages are already there: FACTS.md measured fresh tmpfs pages ~7x slower); rank 0
commits it with a checksummed manifest. The agent replicates it to disk and object store in the
background, and on a restart hands the ranks the newest verified checkpoint in
``$TRAINGUARD_RESTORE``.

Environment (set by the agent's launcher): ``TRAINGUARD_CKPT_MEMORY_ROOT`` (tier root),
``TRAINGUARD_CKPT_MEMORY_EVERY`` (steps), ``TRAINGUARD_JOB``, ``TRAINGUARD_RESTORE``.
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
    def __init__(self, job: str, root: str, every: int) -> None:
        self.job = job
        self.root = root
        self.every = every
        self.stats = SaveStats()
        self._tier: MemoryTier | None = None

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> MemoryTierWriter | None:
        env = os.environ if environ is None else environ
        root = env.get(ENV_MEMORY_ROOT, "")
        if not root:
            return None
        every = int(env.get(ENV_MEMORY_EVERY, "100") or 100)
        return cls(env.get(ENV_JOB, "standalone"), root, max(1, every))

    def due(self, step: int, force: bool = False) -> bool:
        return force or step % self.every == 0

    def save(self, trainer: Trainer) -> str:
        """Collective: every rank writes its shards, rank 0 stages and commits."""
        from trainer.checkpoint import META, _state

        t0 = time.perf_counter()
        rank = dist.get_rank()
        box: list[Any] = [None]
        if rank == 0:
            if self._tier is None:
                self._tier = MemoryTier(self.root)
            staged = self._tier.stage(self.job, trainer.step)
            os.makedirs(staged / "rng", exist_ok=True)
            box[0] = str(staged)
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
            assert self._tier is not None
            self._tier.commit(self.job, trainer.step, {"world_size": dist.get_world_size()}, staged=path, prune=False)
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
