"""Local multi-process launch for ``trainguard train --standalone``, tests and benchmarks.

Ranks are forked (not spawned) after the torch modules they need are imported here, so a 4-rank
job starts in about a second instead of 5-9 s per spawned worker. The parent must not
have run multi-threaded torch ops before forking; it does none itself.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Callable
from typing import Any

from trainguard.trainer.config import TrainConfig


def preimport() -> None:
    """Import what every rank needs, once, in the parent (children inherit it through fork)."""
    import torch._dynamo  # noqa: F401  # DDP() imports it on first use: 3-5 s in every rank otherwise
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.checkpoint.state_dict  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.pipelining  # noqa: F401
    import torch.distributed.tensor.parallel  # noqa: F401
    import torch.multiprocessing  # noqa: F401
    import torch.nn.parallel  # noqa: F401

    import trainguard.trainer.checkpoint  # noqa: F401
    import trainguard.trainer.compression  # noqa: F401
    import trainguard.trainer.faults  # noqa: F401
    import trainguard.trainer.train  # noqa: F401


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(local_rank: int, cfg: TrainConfig, nproc: int, port: int, json_out: bool,
               env: dict[str, str], entry: Callable[[TrainConfig, bool], int] | None) -> None:
    os.environ.update(env)
    os.environ.update({"RANK": str(local_rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(nproc),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    from trainguard.trainer.worker import run_rank
    rc = (entry or run_rank)(cfg, json_out)
    if rc:
        sys.exit(rc)


def run_standalone(cfg: TrainConfig, nproc: int, json_out: bool = False, *, env: dict[str, str] | None = None,
                   entry: Callable[[TrainConfig, bool], int] | None = None) -> int:
    """Train ``cfg`` on ``nproc`` local processes (loopback, free port); return an exit code.

    With ``json_out`` rank 0 prints one JSON object per step on stdout (step, loss, lr, step_s,
    tokens_per_s, grad_norm, batch, plan_version, val_loss when evaluated), otherwise a
    human-readable line. ``env`` adds environment variables for the ranks (e.g. TRAINGUARD_SOCKET).
    ``entry`` replaces the per-rank function (tests). Returns 0 when every rank finished, 2 for a
    layout that does not fit ``nproc``, else the first failing rank's exit code (or 1).
    """
    from trainguard.trainer.config import ConfigError
    try:
        cfg.parallel.check_world(nproc)
    except ConfigError as exc:
        print(f"trainguard: {exc}", file=sys.stderr)
        return 2
    from trainguard.trainer.data import build_corpus
    build_corpus(cfg.data.cache_dir, cfg.data.max_bytes)  # once, before the ranks race to build it
    preimport()
    import torch.multiprocessing as mp
    port = free_port()
    args: tuple[Any, ...] = (cfg, nproc, port, json_out, dict(env or {}), entry)
    try:
        mp.start_processes(_rank_main, args=args, nprocs=nproc, start_method="fork", join=True)
    except mp.ProcessExitedException as exc:
        print(f"trainguard: rank {exc.error_index} exited with code {exc.exit_code}", file=sys.stderr)
        return exc.exit_code if exc.exit_code and exc.exit_code > 0 else 1
    except mp.ProcessRaisedException as exc:
        print(f"trainguard: {exc}", file=sys.stderr)
        return 1
    return 0
