"""A gloo job with trainguard's API (snapshots after every step, restore on a restart). Each rank
writes what it started with (``start-r<RANK>-c<RESTART>``, and a line in ``starts-r<RANK>``:
torchrun's environment, the step it resumed at, what it restored from and a digest of its
parameters) and one line per finished step (``steps-r<RANK>``:
restart count, step, parameter digest after the step)."""

import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

import trainguard

out, steps = sys.argv[1], int(sys.argv[2])
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.set_num_threads(1)
torch.manual_seed(0)
model = nn.Linear(8, 1)
optim = torch.optim.SGD(model.parameters(), lr=0.01)
run = trainguard.init(batch_size=4)
state = {"model": model, "optim": optim}
start = run.restore(state)
restart = os.environ["TORCHELASTIC_RESTART_COUNT"]


def digest() -> str:
    return repr(float(sum(p.detach().double().sum() for p in model.parameters())))


keys = ("RANK", "WORLD_SIZE", "GROUP_RANK", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID", "TRAINGUARD_ATTEMPT")
started = {**{k: os.environ.get(k) for k in keys}, "pid": os.getpid(), "start": start, "digest": digest(),
           "restored": run.restored_from, "batch": run.plan.batch_size}
with open(os.path.join(out, f"start-r{rank}-c{restart}"), "w") as f:
    json.dump(started, f)
with open(os.path.join(out, f"starts-r{rank}"), "a") as f:  # every start, a round without a failure too
    f.write(json.dumps(started) + "\n")
log = open(os.path.join(out, f"steps-r{rank}"), "a")  # noqa: SIM115 - open for the whole run
for step in range(start, steps):
    with run.step(step, samples=4) as s:
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step * 100 + rank))
        loss = model(x).pow(2).mean()
        optim.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        optim.step()
        s.report(loss=loss.item())
    run.checkpoint(step, state)
    log.write(f"{restart} {step} {digest()}\n")
    log.flush()
    time.sleep(0.05)
run.close()
dist.destroy_process_group()
