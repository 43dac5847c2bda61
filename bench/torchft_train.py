"""The recovery bench's job, trained the torchft way (run by bench/recovery.py in the peers' venv).

One process per replica group (``REPLICA_GROUP_ID`` of ``NUM_REPLICA_GROUPS``), each under its own
``torchrun --max-restarts`` as torchft's examples launch them, all joined by one lighthouse
(``TORCHFT_LIGHTHOUSE``). The model, data order, optimizer, LR schedule and clipping are the
embedded trainer's (trainguard.trainer's model and sampler, the same config), so only the fault
tolerance differs: torchft's Manager (quorum per step, commit or discard, a recovering replica
fetches the live state of a healthy one over HTTP) with ProcessGroupGloo.

``--ddp shipped`` wraps the model in torchft's DistributedDataParallel as shipped;
``--ddp allreduce`` averages each gradient with ``manager.allreduce`` after backward (torchft's own
call, without its DDP comm hook: the smallest change that keeps a surviving group alive on gloo
when a kill lands inside an all-reduce). Faults: ``kill:rank=R,step=K`` specs in the job
spec, each fired once (a marker file records the kill's time for the bench). Group 0 prints one
JSON row per committed step, like the trainer's ``TRAINGUARD_JSON`` rows.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.nn.functional as F
from torchft import DistributedDataParallel, Manager, ProcessGroupGloo
from torchft.optim import OptimizerWrapper

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from trainguard.trainer.config import TrainConfig  # noqa: E402
from trainguard.trainer.data import Corpus, Sampler, split_counts, windows  # noqa: E402
from trainguard.trainer.model import build_stage  # noqa: E402
from trainguard.trainer.train import lr_at  # noqa: E402


def kill_steps(faults: list[str], group: int) -> list[int]:
    steps = []
    for spec in faults:
        kind, _, args = spec.partition(":")
        fields = dict(kv.split("=", 1) for kv in args.split(",") if "=" in kv)
        if kind == "kill" and int(fields.get("rank", -1)) == group:
            steps.append(int(fields["step"]))
    return steps


def maybe_kill(step: int, kills: list[int], markers: Path, group: int) -> None:
    """The trainer's ``kill`` fault: SIGKILL at the top of the step after K, once per spec."""
    for k in kills:
        marker = markers / f"torchft-kill-g{group}-s{k}"
        if step == k and not marker.exists():
            marker.write_text(json.dumps({"step": k, "time": time.time()}))
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ddp", choices=("shipped", "allreduce"), default="shipped")
    args = ap.parse_args()
    cfg = TrainConfig.from_dict(json.loads(os.environ["TRAINGUARD_JOB_SPEC"]))
    group, groups = int(os.environ["REPLICA_GROUP_ID"]), int(os.environ["NUM_REPLICA_GROUPS"])
    markers = Path(os.environ["TRAINGUARD_FAULT_MARKER_DIR"])
    markers.mkdir(parents=True, exist_ok=True)
    kills = kill_steps(cfg.faults, group)
    torch.set_num_threads(cfg.threads)

    corpus = Corpus.load(cfg.data.cache_dir, cfg.data.max_bytes)
    sampler = Sampler(len(corpus.train) // (cfg.model.context + 1), cfg.seed)
    sizes = split_counts(cfg.global_batch, groups)
    model = build_stage(cfg.model, cfg.seed)
    o = cfg.optim
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    inner = torch.optim.AdamW([{"params": decay, "weight_decay": o.weight_decay},
                               {"params": no_decay, "weight_decay": 0.0}], lr=o.lr, betas=(o.beta1, o.beta2))

    def state_dict() -> dict[str, object]:
        return {"model": model.state_dict(), "optim": inner.state_dict(), "sampler": sampler.state()}

    def load_state_dict(state: dict[str, object]) -> None:
        model.load_state_dict(state["model"])  # type: ignore[arg-type]
        inner.load_state_dict(state["optim"])  # type: ignore[arg-type]
        sampler.load_state(state["sampler"])  # type: ignore[arg-type]

    manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=10)), min_replica_size=groups,
                      load_state_dict=load_state_dict, state_dict=state_dict, replica_id=f"bench_{group}",
                      hostname="127.0.0.1", timeout=timedelta(seconds=30))
    net = DistributedDataParallel(manager, model) if args.ddp == "shipped" else model
    optimizer = OptimizerWrapper(manager, inner)
    while manager.current_step() < cfg.steps:
        step = manager.current_step()
        maybe_kill(step, kills, markers, group)
        t0 = time.perf_counter()
        optimizer.zero_grad()  # starts the quorum (a recovering group loads a peer's state here)
        for g in inner.param_groups:
            g["lr"] = lr_at(cfg, step)
        idx = sampler.next_step(sizes)[group]
        batch = torch.from_numpy(windows(corpus.train, cfg.model.context, idx))
        x, y = batch[:, :-1], batch[:, 1:]
        logits = net(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        loss.backward()
        if args.ddp == "allreduce":
            for p in model.parameters():
                if p.grad is not None:
                    manager.allreduce(p.grad).wait()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), o.clip)) if o.clip else 0.0
        optimizer.step()  # commits only when every replica's step succeeded
        step_s = time.perf_counter() - t0
        if manager.current_step() > step and group == 0:
            print(json.dumps({"step": manager.current_step(), "loss": float(loss), "step_s": round(step_s, 5),
                              "grad_norm": grad_norm, "batch": int(sum(sizes)), "time": round(time.time(), 4),
                              "replicas": manager.num_participants()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
