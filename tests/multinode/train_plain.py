"""A gloo job without trainguard's API: one all-reduce per step; it writes what torchrun's
environment told it (``start-r<RANK>-c<RESTART>``) and its newest step (``step-r<RANK>-c<RESTART>``)."""

import json
import os
import sys
import time

import torch
import torch.distributed as dist

out, steps = sys.argv[1], int(sys.argv[2])
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
restart = os.environ["TORCHELASTIC_RESTART_COUNT"]
keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
        "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID")
with open(os.path.join(out, f"start-r{rank}-c{restart}"), "w") as f:
    json.dump({**{k: os.environ.get(k) for k in keys}, "pid": os.getpid()}, f)
for step in range(steps):
    t = torch.ones(1)
    dist.all_reduce(t)
    assert int(t.item()) == world
    with open(os.path.join(out, f"step-r{rank}-c{restart}"), "w") as f:
        f.write(str(step))
    time.sleep(0.05)
dist.destroy_process_group()
