"""The same DDP script as ``ddp_plain.py`` with trainguard's Python API: a few lines more, and the
agent gets step telemetry (stragglers, hangs, loss divergence), keeps in-memory checkpoints that a
restart resumes from, and may move samples between ranks (``plan.batch_size``, with
``s.weighted(loss)``, times ``s.loss_weight``, keeping the averaged gradient exact).

    trainguard run --nproc 2 -- python examples/ddp_api.py --steps 200

Without an agent (plain ``torchrun`` or ``python``) it trains the same: every trainguard call is a
no-op then.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import trainguard

DIM = 32


def make_model(width: int = 64) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(DIM, width), nn.Tanh(), nn.Linear(width, 1))


def batch(step: int, rank: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The samples of one rank at one step: the same whatever happened before."""
    g = torch.Generator().manual_seed(1_000_003 * step + rank)
    x = torch.randn(size, DIM, generator=g)
    teacher = torch.Generator().manual_seed(7)
    w = torch.randn(DIM, 1, generator=teacher)
    return x, torch.sin(x @ w)


class Progress:
    """For benchmarks that kill ranks from outside: each rank's pid, rank 0's steps done and the step
    this process started at (a resume that lost no step leaves the step count unchanged)."""

    def __init__(self, directory: str, rank: int, start: int) -> None:
        self.fd = -1
        if directory:
            if rank == 0:
                with open(os.path.join(directory, "started.tmp"), "w") as fh:
                    fh.write(f"{start} {os.getpid()}")
                os.replace(os.path.join(directory, "started.tmp"), os.path.join(directory, "started"))
            with open(os.path.join(directory, f"rank{rank}.pid"), "w") as fh:
                fh.write(str(os.getpid()))
            if rank == 0:
                self.fd = os.open(os.path.join(directory, "step"), os.O_WRONLY | os.O_CREAT, 0o644)

    def done(self, step: int) -> None:
        if self.fd >= 0:
            os.pwrite(self.fd, f"{step + 1:>12}".encode(), 0)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch", type=int, default=16, help="samples per rank per step")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--width", type=int, default=64, help="hidden units (more: more compute per step)")
    p.add_argument("--step-sleep", type=float, default=0.0, help="extra seconds per step (tests)")
    p.add_argument("--out", default="", help="rank 0 saves the final parameters here")
    p.add_argument("--progress", default="", help="a directory: rank pids and rank 0's step count (benchmarks)")
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    model = DDP(make_model(args.width))
    optim = torch.optim.SGD(model.parameters(), lr=args.lr)

    run = trainguard.init(batch_size=args.batch)
    state = {"model": model, "optim": optim}
    start = run.restore(state)  # the step to resume at (0 on a first start)
    run.watch_gradients(model.parameters())  # compute timed to the last gradient (on CUDA: without the all-reduce wait)
    progress = Progress(args.progress, rank, start)
    if rank == 0 and start:
        print(f"resumed at step {start}", flush=True)

    for step in range(start, args.steps):
        n = run.plan.batch_size or args.batch
        with run.step(step, samples=n) as s:
            with s.phase("data"):
                x, y = batch(step, rank, n)
            with s.phase("compute"):
                loss = nn.functional.mse_loss(model(x), y)
                optim.zero_grad()
                s.weighted(loss).backward()  # loss * s.loss_weight, without the multiply at 1
            with s.phase("optim"):
                for group in optim.param_groups:
                    group["lr"] = run.plan.lr_for(args.lr)
                optim.step()
            if args.step_sleep:
                time.sleep(args.step_sleep)
            s.report(loss=loss.item(), lr=optim.param_groups[0]["lr"])
        if rank == 0 and step % 20 == 0:
            print(f"step {step} loss {loss.item():.5f} batch {n}", flush=True)
        run.checkpoint(step, state)  # into the memory tier when due; the agent fans it out
        progress.done(step)
        if run.plan.stop:
            break

    if rank == 0 and args.out:
        torch.save(model.module.state_dict(), args.out)
    run.close()
    # DDP's reducer holds the process group; dropped after the group, its destructor joins gloo's
    # threads while holding the GIL, which one of them may need: a rare hang at exit (torch).
    del model, optim, state
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
