"""A small DDP training script on gloo with trainguard's API, as a user would launch it under
Slurm (``srun trainguard run ... train_gloo.py DIR``).

Each rank appends JSON lines to ``DIR/<hostname>-rank<RANK>.log``: ``start`` (the step it resumed
at, its attempt, world size and pid) and ``done`` per step. Training ends, on every rank at the
same step, once the file ``DIR/finish`` exists (the ranks agree on it through an all-reduce), or
after ``--steps``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import trainguard

DIM = 16


def batch(step: int, rank: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The samples of one rank at one step: the same whatever happened before."""
    g = torch.Generator().manual_seed(1_000_003 * step + rank)
    x = torch.randn(size, DIM, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("dir")
    p.add_argument("--steps", type=int, default=100_000)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--step-sleep", type=float, default=0.05)
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(DIM, 32), nn.Tanh(), nn.Linear(32, 1)))
    optim = torch.optim.SGD(model.parameters(), lr=0.05)
    run = trainguard.init(batch_size=args.batch)
    state = {"model": model, "optim": optim}
    start = run.restore(state)
    log = open(os.path.join(args.dir, f"{socket.gethostname()}-rank{rank}.log"), "a", buffering=1)

    def note(**fields: object) -> None:
        log.write(json.dumps({"t": time.time(), **fields}) + "\n")

    # what ``srun --signal`` / ``scancel -s`` sends ahead of the end, passed on by trainguard run
    signal.signal(signal.SIGUSR1, lambda signum, _frame: note(event="signal", name=signal.Signals(signum).name))

    note(event="start", step=start, world=world, pid=os.getpid(),
         attempt=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), restored=run.restored_from,
         batch=run.plan.batch_size)
    finish = torch.zeros(1)
    step = start
    for step in range(start, args.steps):
        n = run.plan.batch_size or args.batch
        with run.step(step, samples=n) as s:
            x, y = batch(step, rank, n)
            loss = nn.functional.mse_loss(model(x), y)
            optim.zero_grad()
            s.weighted(loss).backward()
            optim.step()
            s.report(loss=loss.item())
        run.checkpoint(step, state)
        note(event="done", step=step, world=world)
        time.sleep(args.step_sleep)
        finish[0] = float(os.path.exists(os.path.join(args.dir, "finish")))
        dist.all_reduce(finish, op=dist.ReduceOp.MAX)
        if finish.item() or run.plan.stop:
            break
    note(event="end", step=step, world=world)
    run.close()
    del model, optim, state
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
