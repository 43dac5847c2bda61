"""A plain DistributedDataParallel training script, written the way the PyTorch DDP tutorials write
it: no trainguard import. It runs unchanged under torchrun and under ``trainguard run``:

    torchrun --nproc-per-node 2 examples/ddp_plain.py --steps 200
    trainguard run --nproc 2 -- python examples/ddp_plain.py --steps 200

It checkpoints itself with ``torch.save`` every ``--ckpt-every`` steps (rank 0) and resumes from
its newest checkpoint when restarted, as such scripts do. Data is a fixed regression task whose
batches depend only on (step, rank), so a resumed run sees the same data as an uninterrupted one.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

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
    p.add_argument("--ckpt-dir", default="")
    p.add_argument("--ckpt-every", type=int, default=20)
    p.add_argument("--out", default="", help="rank 0 saves the final parameters here")
    p.add_argument("--progress", default="", help="a directory: rank pids and rank 0's step count (benchmarks)")
    p.add_argument("--exit-code", type=int, default=0, help="rank 1 exits with this code at step 2 (tests)")
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    model = DDP(make_model(args.width))
    optim = torch.optim.SGD(model.parameters(), lr=args.lr)

    start = 0
    path = os.path.join(args.ckpt_dir, "ckpt.pt") if args.ckpt_dir else ""
    if path and os.path.exists(path):
        ckpt = torch.load(path, weights_only=True)
        model.module.load_state_dict(ckpt["model"])
        optim.load_state_dict(ckpt["optim"])
        start = int(ckpt["step"]) + 1
        if rank == 0:
            print(f"resumed from step {start}", flush=True)

    progress = Progress(args.progress, rank, start)
    for step in range(start, args.steps):
        if args.exit_code and rank == 1 and step == 2:
            # Exactly this code, as a crashing process has it: an interpreter teardown with the
            # process group still up can abort in gloo's destructor instead (CI saw 134, not 3).
            sys.stdout.flush()
            os._exit(args.exit_code)
        x, y = batch(step, rank, args.batch)
        loss = nn.functional.mse_loss(model(x), y)
        optim.zero_grad()
        loss.backward()
        optim.step()
        if rank == 0 and step % 20 == 0:
            print(f"step {step} loss {loss.item():.5f}", flush=True)
        if path and (step + 1) % args.ckpt_every == 0:
            if rank == 0:
                tmp = path + ".tmp"
                torch.save({"model": model.module.state_dict(), "optim": optim.state_dict(), "step": step}, tmp)
                os.replace(tmp, path)
            dist.barrier()  # nobody runs ahead of a checkpoint being written
        progress.done(step)

    if rank == 0 and args.out:
        torch.save(model.module.state_dict(), args.out)
    # DDP's reducer holds the process group; dropped after the group, its destructor joins gloo's
    # threads while holding the GIL, which one of them may need: a rare hang at exit (torch).
    del model, optim
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
