#!/usr/bin/env python3
"""Online LR / batch retuning against tuned schedules: time to a target validation loss.

Protocol (all tuning on the clock, same model, data, evaluation and step loop for every method):
  (a) warmup+cosine AdamW, LR picked by a grid of 3 LRs per seed. Its time to target is the wall
      time of the grid runs that lost plus the winner's time to target (the grid must run to the
      end to know the winner). (a*) is the winner alone, an oracle that knew the LR beforehand.
  (b) schedule-free AdamW (``schedulefree`` package) at the default LR, untuned; skipped if absent.
  (c) optuna, (d) rl, (e) goodput: the agent's controller (agent/controller, unchanged) on the
      default warmup+cosine schedule, driving LR scale and batch size through real plan files.
The target is the median over seeds of the (a*) winner's validation loss at 75 % of its steps,
fixed before any controller run. A run stops at the target or at its step budget (2x the
baseline's steps); one that never reaches it counts as not reached (time = inf).

Clock: the process's CPU time (torch runs one thread, so on an idle machine it is the wall time;
on this shared 2-core machine the wall time mostly measures other people's load). The controller's
telemetry carries the same clock, so its objective (loss progress per second) sees it too; the
wall time of every run is printed beside it.

The trainer's bundled GPT on the standard-library byte corpus, CPU, one process. Two data-parallel
ranks are emulated in that process (each half of the batch is a separate backward pass), so
every method pays the same compute and the controller sees what real ranks send: per-rank
telemetry (local gradient norm^2 before the "reduction", the reduced norm, timings) into a real
RankTable, plans through a real PlanStore file read by a PlanWatcher at a step boundary. As the
emulated ranks run one after the other, each reports the whole step's compute (so the goodput
throughput model sees the real step time).

    python bench/controller.py [--quick] [--seeds N] [--steps N]
Ends with `RESULT optuna_speedup_ratio=... rl_speedup_ratio=... goodput_speedup_ratio=...`
(time to target of (a) / the method's; also *_vs_oracle_ratio against (a*)).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from trainguard.agent.controller import ControllerConfig, install  # noqa: E402
from trainguard.agent.eventlog import EventLog  # noqa: E402
from trainguard.agent.lifecycle.plans import PlanStore  # noqa: E402
from trainguard.agent.ranktable import RankTable  # noqa: E402
from trainguard.agent.wire import Telemetry  # noqa: E402
from trainguard.link import PlanWatcher  # noqa: E402
from trainguard.trainer.config import TrainConfig  # noqa: E402
from trainguard.trainer.data import Corpus, Sampler, split_counts, val_index, windows  # noqa: E402
from trainguard.trainer.model import build_stage  # noqa: E402
from trainguard.trainer.train import lr_at  # noqa: E402

JOB = "bench"
DP = 2
GRID = (1e-3, 3e-3, 1e-2)


@dataclass
class Run:
    method: str
    seed: int
    lr: float
    curve: list[tuple[float, int, int, float]] = field(default_factory=list)
    """(clock seconds, step, samples, val loss) at every evaluation."""
    cpu: float = 0.0
    wall: float = 0.0
    steps: int = 0
    samples: int = 0
    decisions: int = 0
    final_lr_scale: float = 1.0
    final_batch: int = 0

    def to_target(self, target: float) -> tuple[float, int, int]:
        for t, step, samples, val in self.curve:
            if val <= target:
                return t, step, samples
        return math.inf, -1, -1

    def val_at(self, frac: float) -> float:
        want = self.curve[-1][1] * frac
        return next(v for _, s, _, v in self.curve if s >= want)


def make_cfg(steps: int, lr: float, seed: int, cache: str) -> TrainConfig:
    return TrainConfig.from_dict({
        "model": {"layers": 2, "d_model": 64, "heads": 4, "context": 64},
        "data": {"cache_dir": cache, "max_bytes": 4_000_000, "val_samples": 48},
        "optim": {"lr": lr, "warmup": 10, "clip": 1.0},
        "parallel": {"dp": DP}, "steps": steps, "global_batch": 16, "seed": seed})


class Loop:
    """One training run: emulated dp ranks, plan-driven LR scale and batch, periodic validation."""

    def __init__(self, cfg: TrainConfig, corpus: Corpus, *, optimizer: str = "adamw",
                 controller: ControllerConfig | None = None, workdir: str = "") -> None:
        self.cfg = cfg
        self.corpus = corpus
        torch.manual_seed(cfg.seed)
        self.model = build_stage(cfg.model, cfg.seed)
        span = cfg.model.context + 1
        self.sampler = Sampler(len(corpus.train) // span, cfg.seed)
        vidx = val_index(len(corpus.val) // span, cfg.data.val_samples)
        self.val = torch.from_numpy(windows(corpus.val, cfg.model.context, vidx))
        o = cfg.optim
        self.sf = optimizer == "schedulefree"
        if self.sf:
            import schedulefree
            self.opt: Any = schedulefree.AdamWScheduleFree(self.model.parameters(), lr=o.lr, warmup_steps=o.warmup,
                                                           betas=(o.beta1, o.beta2), weight_decay=o.weight_decay)
        else:
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=o.lr, betas=(o.beta1, o.beta2),
                                         weight_decay=o.weight_decay)
        self.sizes = split_counts(cfg.global_batch, DP)
        self.lr_scale = 1.0
        self.agent: Any = None
        self.controller: Any = None
        if controller is not None:
            self.agent = SimpleNamespace(
                table=RankTable(), plans=PlanStore(os.path.join(workdir, "plans")),
                events=EventLog(os.path.join(workdir, "events"), "bench"), tick_hooks=[],
                supervisor=SimpleNamespace(jobs={JOB: SimpleNamespace(spec=SimpleNamespace(trainer=cfg.to_dict()), decides_here=True)}))
            self.agent.plans.reset(JOB)
            self.controller = install(self.agent, controller)
            self.watcher = PlanWatcher(self.agent.plans.path(JOB))
            self.version = self.watcher.poll().version

    @torch.no_grad()
    def evaluate(self) -> float:
        if self.sf:
            self.model.eval()
            self.opt.eval()
        x, y = self.val[:, :-1], self.val[:, 1:]
        logits = self.model(x)
        loss = float(F.cross_entropy(logits.reshape(-1, 256), y.reshape(-1)))
        if self.sf:
            self.model.train()
            self.opt.train()
        return loss

    def step(self, step: int) -> tuple[float, float, list[tuple[int, float]], float, float, float]:
        cfg = self.cfg
        idx = self.sampler.next_step(self.sizes)
        global_n = sum(self.sizes)
        lr = lr_at(cfg, step) * self.lr_scale
        t0 = time.perf_counter()
        params = [p for p in self.model.parameters()]
        total = [torch.zeros_like(p) for p in params]
        local: list[tuple[int, float]] = []
        loss_sum = 0.0
        for r in range(DP):
            if self.sizes[r] == 0:
                local.append((0, 0.0))
                continue
            batch = torch.from_numpy(windows(self.corpus.train, cfg.model.context, idx[r]))
            x, y = batch[:, :-1], batch[:, 1:]
            for p in params:
                p.grad = None
            logits = self.model(x)
            loss = F.cross_entropy(logits.reshape(-1, 256), y.reshape(-1))
            loss.backward()
            sq = 0.0
            w = self.sizes[r] / global_n
            for p, acc in zip(params, total, strict=True):
                if p.grad is not None:
                    sq += float(p.grad.double().pow(2).sum())
                    acc.add_(p.grad, alpha=w)
            local.append((self.sizes[r], sq))
            loss_sum += float(loss.detach()) * self.sizes[r]
        t1 = time.perf_counter()
        grad_sq = 0.0
        for p, acc in zip(params, total, strict=True):
            p.grad = acc
            grad_sq += float(acc.double().pow(2).sum())
        norm = math.sqrt(grad_sq)
        if cfg.optim.clip and norm > cfg.optim.clip:
            for p in params:
                p.grad.mul_(cfg.optim.clip / (norm + 1e-6))
        for g in self.opt.param_groups:
            g["lr"] = lr
        if math.isfinite(norm):
            self.opt.step()
        t2 = time.perf_counter()
        return loss_sum / global_n, grad_sq, local, lr, t1 - t0, t2 - t1

    def run(self, method: str, max_steps: int, target: float | None, val_every: int) -> Run:
        cfg = self.cfg
        out = Run(method, cfg.seed, cfg.optim.lr)
        if self.sf:
            self.opt.train()
        start, wall0 = time.process_time(), time.perf_counter()
        samples = 0
        pending = None
        for step in range(max_steps):
            if pending is not None:
                self.version, self.lr_scale = pending.version, pending.lr_scale
                if pending.batch_sizes and len(pending.batch_sizes) == DP:
                    self.sizes = list(pending.batch_sizes)
                pending = None
            loss, grad_sq, local, lr, compute_s, opt_s = self.step(step)
            samples += sum(self.sizes)
            if self.controller is not None:
                now = time.process_time()
                gn = sum(self.sizes)
                for r, (b, sq) in enumerate(local):
                    self.agent.table.add(Telemetry(
                        job=JOB, rank=r, local_rank=r, pid=os.getpid(), step=step + 1, wall_time=now,
                        step_s=compute_s + opt_s, data_s=0.0, fwd_bwd_s=compute_s * b / gn * DP, comm_s=0.0,
                        opt_s=opt_s, samples=b, tokens=b * cfg.model.context, loss=loss,
                        grad_norm=math.sqrt(grad_sq), local_grad_sq=sq, lr=lr, batch_size=b, mem_bytes=0,
                        plan_version=self.version, dp_rank=r, world_size=DP))
                self.controller.tick(self.agent, now)
                polled = self.watcher.poll()
                if polled.version != self.version:
                    pending = polled
            if (step + 1) % val_every == 0 or step + 1 == max_steps:
                val = self.evaluate()
                out.curve.append((time.process_time() - start, step + 1, samples, val))
                if not math.isfinite(val):
                    break
                if target is not None and val <= target:
                    break
        out.wall = time.perf_counter() - wall0
        out.cpu = time.process_time() - start
        out.steps, out.samples = out.curve[-1][1], out.curve[-1][2]
        out.final_lr_scale, out.final_batch = self.lr_scale, sum(self.sizes)
        if self.controller is not None:
            out.decisions = sum(jc.decisions for jc in self.controller.jobs.values())
            self.controller.close()
        return out


def spread(values: list[float]) -> str:
    """Median (a run that missed counts as inf) and the range of the runs that reached the target."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return "not reached"
    med = statistics.median(values)
    return f"{med:7.2f} [{min(finite):.2f}-{max(finite):.2f}]" + ("" if len(finite) == len(values) else f" {len(values) - len(finite)} miss")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps and seeds (< 2 min)")
    ap.add_argument("--seeds", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None, help="baseline steps (the controllers get 2x)")
    args = ap.parse_args()
    seeds = args.seeds or (2 if args.quick else 3)
    steps = args.steps or (60 if args.quick else 240)
    val_every = 5 if args.quick else 10
    torch.set_num_threads(1)
    work = tempfile.mkdtemp(prefix="tg-bench-ctl-")
    cache = os.path.join(work, "cache")
    corpus = Corpus.load(cache, 4_000_000)
    every = 10 if args.quick else 20
    print(f"bench/controller: {seeds} seeds, baseline {steps} steps (controllers <= {2 * steps}), "
          f"eval every {val_every}, control window {every} steps, dp={DP} emulated, torch threads 1", flush=True)

    t_all = time.perf_counter()
    # (a) the grid, full length, per seed.
    grid: dict[int, list[Run]] = {}
    for seed in range(seeds):
        grid[seed] = [Loop(make_cfg(steps, lr, seed, cache), corpus).run("grid", steps, None, val_every) for lr in GRID]
        print("  grid seed", seed, " ".join(f"lr {r.lr:g}: val {r.curve[-1][3]:.4f} in {r.cpu:.1f}s cpu ({r.wall:.1f}s wall)" for r in grid[seed]),
              flush=True)
    winners = {s: min(runs, key=lambda r: r.curve[-1][3]) for s, runs in grid.items()}
    target = statistics.median(w.val_at(0.75) for w in winners.values())
    print(f"  target val loss {target:.4f} (median of the grid winners' val at 75% of their steps)", flush=True)

    results: dict[str, list[tuple[float, int, int]]] = {"a": [], "a*": []}
    finals: dict[str, list[float]] = {}
    extra: dict[str, list[Run]] = {}
    for seed in range(seeds):
        w = winners[seed]
        t_w, s_w, n_w = w.to_target(target)
        lost = sum(r.cpu for r in grid[seed] if r is not w)
        lost_steps = sum(r.steps for r in grid[seed] if r is not w)
        lost_samples = sum(r.samples for r in grid[seed] if r is not w)
        results["a"].append((lost + t_w, lost_steps + s_w, lost_samples + n_w))
        results["a*"].append((t_w, s_w, n_w))
        finals.setdefault("a", []).append(w.curve[-1][3])

    methods: list[tuple[str, str, dict[str, Any]]] = []
    try:
        import schedulefree  # noqa: F401
        methods.append(("b", "schedule-free AdamW", {"optimizer": "schedulefree"}))
    except ImportError:
        print("  (b) skipped: the schedulefree package is not installed (pip install schedulefree)")
    for key, name in (("c", "optuna"), ("d", "rl"), ("e", "goodput")):
        methods.append((key, name, {"controller": ControllerConfig(
            strategy=name, every_steps=every, warmup_steps=every, seed=0, batch_min=4, batch_max=64,
            lr_scale_min=0.25, lr_scale_max=8.0)}))
    for key, name, kw in methods:
        for seed in range(seeds):
            cfg = make_cfg(2 * steps, 3e-3, seed, cache)
            # The controllers ride the default schedule over the baseline's length (then its floor).
            cfg.steps = steps
            run_dir = tempfile.mkdtemp(dir=work)
            run = Loop(cfg, corpus, workdir=run_dir, **kw).run(name, 2 * steps, target, val_every)
            results.setdefault(key, []).append(run.to_target(target))
            finals.setdefault(key, []).append(run.curve[-1][3])
            extra.setdefault(key, []).append(run)
            print(f"  {key} {name} seed {seed}: {'reached' if math.isfinite(run.to_target(target)[0]) else 'missed'} "
                  f"in {run.cpu:.1f}s cpu ({run.wall:.1f}s wall), {run.steps} steps, val {run.curve[-1][3]:.4f}, decisions {run.decisions}, "
                  f"final lr x{run.final_lr_scale:.3g} batch {run.final_batch}", flush=True)

    names = {"a": "(a) warmup+cosine, LR grid (cost counted)", "a*": "(a*) grid winner alone (oracle)",
             "b": "(b) schedule-free AdamW, untuned", "c": "(c) optuna", "d": "(d) rl", "e": "(e) goodput"}
    a_time = statistics.median(t for t, _, _ in results["a"])
    o_time = statistics.median(t for t, _, _ in results["a*"])
    print()
    print(f"{'method':44s} {'cpu s to target (median [range])':36s} {'steps*':>7s} {'samples*':>8s} {'speedup':>8s} "
          f"{'vs a*':>6s}  val at stop")
    ratios: dict[str, float] = {}
    for key in ("a", "a*", "b", "c", "d", "e"):
        if key not in results:
            continue
        times = [t for t, _, _ in results[key]]
        med = statistics.median(times)  # a miss counts as inf: 1 miss of 3 still has a median
        reached = [(s, n) for t, s, n in results[key] if math.isfinite(t)]
        steps_med = statistics.median(s for s, _ in reached) if reached else math.nan
        samples_med = statistics.median(n for _, n in reached) if reached else math.nan
        ratio = a_time / med if med > 0 else math.inf
        ratios[key] = ratio
        fin = finals.get(key, [w.curve[-1][3] for w in winners.values()])
        print(f"{names[key]:44s} {spread(times):36s} {steps_med:7.0f} {samples_med:8.0f} {ratio:8.2f} "
              f"{o_time / med if med > 0 else math.inf:6.2f}  {statistics.median(fin):.4f}")
    print("* steps and samples to target: median over the seeds that reached it; (a) counts the grid's "
          "losing runs too. val at stop: (a)/(a*) the winner's at its last step, others at the target or budget")
    print(f"target val loss {target:.4f}; total bench wall {time.perf_counter() - t_all:.0f}s; "
          f"grid LRs {', '.join(f'{lr:g}' for lr in GRID)}; winners: "
          + ", ".join(f"seed {s} lr {w.lr:g}" for s, w in winners.items()))

    def fmt(key: str) -> str:
        return f"{ratios.get(key, 0.0):.3f}" if math.isfinite(ratios.get(key, 0.0)) else "0"

    def vs_oracle(key: str) -> str:
        times = [t for t, _, _ in results.get(key, [])]
        med = statistics.median(times) if times else math.inf
        return f"{o_time / med:.3f}" if math.isfinite(med) else "0"

    print(f"RESULT optuna_speedup_ratio={fmt('c')} rl_speedup_ratio={fmt('d')} goodput_speedup_ratio={fmt('e')} "
          f"schedulefree_speedup_ratio={fmt('b')} optuna_vs_oracle_ratio={vs_oracle('c')} "
          f"rl_vs_oracle_ratio={vs_oracle('d')} goodput_vs_oracle_ratio={vs_oracle('e')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
