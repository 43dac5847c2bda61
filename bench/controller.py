#!/usr/bin/env python3
"""Does turning the controller on make a run reach its target sooner? Time to a target validation
loss, every strategy against the untouched default, from a good and from two bad starting LRs.

Arms (all on the shipped defaults of ControllerConfig; the same model, corpus, evaluation and step
loop; tuning on the clock, as in AlgoPerf's self-tuning track):
  none          the default config at the starting LR, no controller;
  grid          3 runs at the starting LR x 0.1, x1, x10 over the schedule, the winner by its
                validation loss at the schedule's end; its time = the two losers' full runs + the
                winner's time to target (the grid must finish to know its winner);
  schedulefree  schedule-free AdamW (``schedulefree``) at the starting LR, no schedule to tune;
  optuna, rl, goodput
                the agent's controller (agent/controller, unchanged) on the default warmup+cosine
                schedule, driving LR scale and batch size through real plan files.
Starting points: the default LR (TrainConfig's 3e-3), 10x too low, 10x too high. Every run has
the same budget (2x the schedule's steps, the schedule's floor LR after it) and stops at the target.
The target is fixed before any controller run: the median over seeds of 'none' at the default LR's
validation loss at 75 % of its schedule. A run that never reaches it counts as not reached (inf).
Each figure is the median over seeds.

Goals (printed met or not): do no harm (at the default LR every strategy within 1.05x of none's
time), rescue (from 10x off at least 2x faster than none, or reaching what none never reaches),
beat the grid with its cost counted at every starting point.

Healing arm: a node loss halfway through a 2-node job (two emulated ranks of 8 samples each, one
gone at half the schedule; a user script's fixed per-rank batch, so the global batch halves), the
controller with strategy none and its LR rule (``lr_batch_rule`` sqrt, the default) against the
same loss without the rescale (rule none), against the unfaulted run: validation loss at the end.

Clock: the process's CPU time (torch runs one thread, so on an idle machine it is the wall time;
on this shared 2-core machine the wall time mostly measures other people's load). The controller's
telemetry carries the same clock, so its objective (loss progress per second) sees it too. Runs go
to ``--jobs`` worker processes (default 2, one per core).

The trainer's bundled GPT on the standard-library byte corpus, CPU. Two data-parallel ranks are
emulated in each process (each rank's share of the batch is a separate backward pass), so every
method pays the same compute and the controller sees what real ranks send: per-rank telemetry
(local gradient norm^2 before the "reduction", the reduced norm, timings) into a real RankTable,
plans through a real PlanStore file read by a PlanWatcher at a step boundary.

    python bench/controller.py [--quick] [--seeds N] [--steps N] [--jobs N]
Ends with `RESULT <arm>_<start>_ratio=...` (none's time to target / the arm's: above 1 is faster)
for every arm and starting point, and rescale_gap_ratio (unrescaled val-loss gap to the unfaulted
run / the rescaled one's).
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
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
from trainguard.alignment import UpdateAlignment  # noqa: E402
from trainguard.link import PlanWatcher  # noqa: E402
from trainguard.trainer.config import OptimConfig, TrainConfig  # noqa: E402
from trainguard.trainer.data import Corpus, Sampler, split_counts, val_index, windows  # noqa: E402
from trainguard.trainer.model import build_stage  # noqa: E402
from trainguard.trainer.train import lr_at  # noqa: E402

JOB = "bench"
DP = 2
GLOBAL_BATCH = 16
DEFAULT_LR = OptimConfig().lr
STARTS = {"default": 0, "low": -1, "high": 1}
"""Starting LRs as powers of ten of the default."""
GRID = (-1, 0, 1)
"""The grid around a starting LR: x0.1, x1, x10."""
STRATEGIES = ("optuna", "rl", "goodput")


@dataclass
class Run:
    method: str
    seed: int
    lr: float
    curve: list[tuple[float, int, float]] = field(default_factory=list)
    """(clock seconds, step, val loss) at every evaluation."""
    cpu: float = 0.0
    wall: float = 0.0
    decisions: int = 0
    final_lr_scale: float = 1.0
    final_batch: int = 0
    events: list[str] = field(default_factory=list)

    def to_target(self, target: float) -> float:
        return next((t for t, _, val in self.curve if val <= target), math.inf)

    def val_at(self, step: int) -> float:
        return next(v for _, s, v in self.curve if s >= step)

    def time_at(self, step: int) -> float:
        return next(t for t, s, _ in self.curve if s >= step)


def make_cfg(steps: int, lr: float, seed: int, cache: str) -> TrainConfig:
    return TrainConfig.from_dict({
        "model": {"layers": 2, "d_model": 64, "heads": 4, "context": 64},
        "data": {"cache_dir": cache, "max_bytes": 4_000_000, "val_samples": 48},
        "optim": {"lr": lr, "warmup": 10, "clip": 1.0},
        "parallel": {"dp": DP}, "steps": steps, "global_batch": GLOBAL_BATCH, "seed": seed})


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
            import schedulefree  # only this arm needs it (a dev extra)
            self.opt: Any = schedulefree.AdamWScheduleFree(self.model.parameters(), lr=o.lr, warmup_steps=o.warmup,
                                                           betas=(o.beta1, o.beta2), weight_decay=o.weight_decay)
        else:
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=o.lr, betas=(o.beta1, o.beta2),
                                         weight_decay=o.weight_decay)
        self.sizes = split_counts(cfg.global_batch, DP)
        self.alignment = UpdateAlignment(self.model.parameters())  # what the trainer reports, as update_cos
        self.update_cos: float | None = None
        self.lr_scale = 1.0
        self.version = 0
        self.agent: Any = None
        self.controller: Any = None
        if controller is not None:
            self.agent = SimpleNamespace(
                table=RankTable(), plans=PlanStore(os.path.join(workdir, "plans")),
                events=EventLog(os.path.join(workdir, "events"), "bench"), tick_hooks=[],
                supervisor=SimpleNamespace(jobs={JOB: SimpleNamespace(spec=SimpleNamespace(trainer=cfg.to_dict()),
                                                                      decides_here=True)}))
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
        lr = (cfg.optim.lr if self.sf else lr_at(cfg, step)) * self.lr_scale
        t0 = time.perf_counter()
        params = [p for p in self.model.parameters()]
        total = [torch.zeros_like(p) for p in params]
        local: list[tuple[int, float]] = []
        loss_sum = 0.0
        for r, n in enumerate(self.sizes):
            if n == 0:
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
            w = n / global_n
            for p, acc in zip(params, total, strict=True):
                if p.grad is not None:
                    sq += float(p.grad.double().pow(2).sum())
                    acc.add_(p.grad, alpha=w)
            local.append((n, sq))
            loss_sum += float(loss.detach()) * n
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
        self.update_cos = self.alignment.after_step()
        t2 = time.perf_counter()
        return loss_sum / global_n, grad_sq, local, lr, t1 - t0, t2 - t1

    def lose_rank(self) -> None:
        """Node loss: the job goes on with one rank and that rank's own batch (a script with a fixed
        per-rank batch); the agent forgets the dead attempt's ranks, as a restart does."""
        self.sizes = self.sizes[:1]
        if self.agent is not None:
            self.agent.table.forget_job(JOB)

    def run(self, method: str, max_steps: int, target: float | None, val_every: int,
            lose_rank_at: int | None = None) -> Run:
        out = Run(method, self.cfg.seed, self.cfg.optim.lr)
        if self.sf:
            self.opt.train()
        start, wall0 = time.process_time(), time.perf_counter()
        pending = None
        for step in range(max_steps):
            if step == lose_rank_at:
                self.lose_rank()
            if pending is not None:
                self.version, self.lr_scale = pending.version, pending.lr_scale
                if pending.batch_sizes and len(pending.batch_sizes) == len(self.sizes):
                    self.sizes = list(pending.batch_sizes)
                pending = None
            loss, grad_sq, local, lr, compute_s, opt_s = self.step(step)
            if self.controller is not None:
                now = time.process_time()
                dp, gn = len(self.sizes), sum(self.sizes)
                for r, (b, sq) in enumerate(local):
                    self.agent.table.add(Telemetry(
                        job=JOB, rank=r, local_rank=r, pid=os.getpid(), step=step + 1, wall_time=now,
                        step_s=compute_s + opt_s, data_s=0.0, fwd_bwd_s=compute_s * b / gn * dp, comm_s=0.0,
                        opt_s=opt_s, samples=b, tokens=b * self.cfg.model.context, loss=loss,
                        grad_norm=math.sqrt(grad_sq), local_grad_sq=sq, lr=lr, batch_size=b, mem_bytes=0,
                        plan_version=self.version, dp_rank=r, world_size=dp, update_cos=self.update_cos))
                self.controller.tick(self.agent, now)
                polled = self.watcher.poll()
                if polled.version != self.version:
                    pending = polled
            if (step + 1) % val_every == 0 or step + 1 == max_steps:
                val = self.evaluate()
                out.curve.append((time.process_time() - start, step + 1, val))
                if not math.isfinite(val) or (target is not None and val <= target):
                    break
        out.wall = time.perf_counter() - wall0
        out.cpu = time.process_time() - start
        out.final_lr_scale, out.final_batch = self.lr_scale, sum(self.sizes)
        if self.controller is not None:
            out.decisions = sum(jc.decisions for jc in self.controller.jobs.values())
            out.events = [e["message"] for e in self.agent.events.since(0, 10_000)
                          if e["kind"] in ("controller_lr_rescale", "controller_rollback")]
            self.controller.close()
        return out


# --- worker side: one task = one run -------------------------------------------------------------
_CORPUS: Corpus | None = None


def _corpus(cache: str) -> Corpus:
    global _CORPUS
    if _CORPUS is None:
        torch.set_num_threads(1)
        _CORPUS = Corpus.load(cache, 4_000_000)
    return _CORPUS


@dataclass(frozen=True)
class Task:
    arm: str
    seed: int
    lr: float
    schedule: int
    """Steps of the warmup+cosine schedule (the run may go on at its floor up to ``budget``)."""
    budget: int
    val_every: int
    cache: str
    work: str
    target: float | None = None
    strategy: str = ""
    controller: dict[str, Any] = field(default_factory=dict)
    lose_rank_at: int | None = None


def run_task(task: Task) -> Run:
    corpus = _corpus(task.cache)
    cfg = make_cfg(task.schedule, task.lr, task.seed, task.cache)
    kw: dict[str, Any] = {}
    if task.arm == "schedulefree":
        kw["optimizer"] = "schedulefree"
    if task.strategy:
        kw["controller"] = ControllerConfig(strategy=task.strategy, **task.controller)  # type: ignore[arg-type]
        kw["workdir"] = tempfile.mkdtemp(dir=task.work)
    return Loop(cfg, corpus, **kw).run(task.arm, task.budget, task.target, task.val_every, task.lose_rank_at)


# --- the report ----------------------------------------------------------------------------------
def median(values: list[float]) -> float:
    """Median where a miss (inf) counts as the largest value."""
    return statistics.median(values) if values else math.nan


def ratio(none_t: float, arm_t: float) -> float:
    if math.isinf(arm_t):
        return 0.0
    return none_t / arm_t if arm_t > 0 else math.nan


def fmt_t(t: float) -> str:
    return "   miss" if math.isinf(t) else f"{t:7.1f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="1 seed, a short schedule and a scaled-down controller window (< 2 min; not the shipped "
                         "defaults: a smoke run, not a measurement)")
    ap.add_argument("--seeds", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None, help="schedule length in steps (the budget is 2x)")
    ap.add_argument("--jobs", type=int, default=2, help="worker processes")
    args = ap.parse_args()
    seeds = args.seeds or (1 if args.quick else 5)
    schedule = args.steps or (60 if args.quick else 400)
    budget = 2 * schedule
    val_every = 5 if args.quick else 10
    shipped = ControllerConfig()
    settings: dict[str, Any] = {}
    if args.quick:
        # Shipped windows would not fit a 60-step schedule: the smoke run scales them down.
        settings = {"every_steps": 10, "warmup_steps": 10}
    window = settings.get("every_steps", shipped.every_steps)
    warmup = settings.get("warmup_steps", shipped.warmup_steps)
    work = tempfile.mkdtemp(prefix="tg-bench-ctl-")
    cache = os.path.join(work, "cache")
    Corpus.load(cache, 4_000_000)  # built once here, read by every worker
    print(f"bench/controller: {seeds} seed(s), schedule {schedule} steps, budget {budget}, eval every {val_every}; "
          f"controller window {window}, warm-up {warmup}, LR scale [{shipped.lr_scale_min:g}, "
          f"{shipped.lr_scale_max:g}], rule {shipped.lr_batch_rule}"
          f"{' (quick: scaled down)' if args.quick else ' (shipped defaults)'}; dp={DP} emulated, "
          f"{args.jobs} worker(s), torch threads 1", flush=True)
    t_all = time.perf_counter()

    def task(arm: str, seed: int, lr: float, steps: int, **kw: Any) -> Task:
        return Task(arm, seed, lr, schedule, steps, val_every, cache, work, **kw)

    def lr_of(power: int) -> float:
        return DEFAULT_LR * 10.0 ** power

    powers = sorted({s + g for s in STARTS.values() for g in GRID})
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=args.jobs, mp_context=ctx) as pool:
        # 1. Fixed-LR runs: the grids' members (to the schedule's end) and 'none' at each start
        #    (the whole budget: the target is not known yet). None of them sees a controller.
        fixed_tasks = [(seed, p, task("fixed", seed, lr_of(p), budget if p in STARTS.values() else schedule))
                       for seed in range(seeds) for p in powers]
        fixed = {(seed, p): run for (seed, p, _), run in
                 zip(fixed_tasks, pool.map(run_task, [t for _, _, t in fixed_tasks]), strict=True)}
        target = statistics.median(fixed[(seed, 0)].val_at(int(0.75 * schedule)) for seed in range(seeds))
        print(f"  target val loss {target:.4f} (median over seeds of none at lr {DEFAULT_LR:g}, at step "
              f"{int(0.75 * schedule)} of {schedule}); fixed runs done in {time.perf_counter() - t_all:.0f}s", flush=True)

        # 2. The arms that need the target: schedule-free, the strategies, and the healing arm.
        arm_tasks: list[tuple[str, str, int, Task]] = []
        for name, power in STARTS.items():
            lr = lr_of(power)
            for seed in range(seeds):
                arm_tasks.append(("schedulefree", name, seed, task("schedulefree", seed, lr, budget, target=target)))
                for strategy in STRATEGIES:
                    arm_tasks.append((strategy, name, seed, task(strategy, seed, lr, budget, target=target,
                                                                 strategy=strategy, controller=settings)))
        heal_tasks: list[tuple[str, int, Task]] = []
        for seed in range(seeds):
            heal_tasks.append(("unfaulted", seed, task("unfaulted", seed, DEFAULT_LR, schedule, strategy="none",
                                                       controller={"lr_batch_rule": "sqrt"})))
            for rule in ("sqrt", "none"):
                heal_tasks.append((f"node loss, rule {rule}", seed, task(
                    f"loss-{rule}", seed, DEFAULT_LR, schedule, strategy="none", controller={"lr_batch_rule": rule},
                    lose_rank_at=schedule // 2)))
        runs = list(pool.map(run_task, [t for *_, t in arm_tasks] + [t for *_, t in heal_tasks]))
    arm_runs = runs[:len(arm_tasks)]
    heal_runs = runs[len(arm_tasks):]

    # Times to target per (arm, start): lists over seeds.
    times: dict[tuple[str, str], list[float]] = {}
    for name, power in STARTS.items():
        for seed in range(seeds):
            times.setdefault(("none", name), []).append(fixed[(seed, power)].to_target(target))
            members = [fixed[(seed, power + g)] for g in GRID]
            winner = min(members, key=lambda r: r.val_at(schedule))
            cost = sum(r.time_at(schedule) for r in members if r is not winner)
            times.setdefault(("grid", name), []).append(cost + winner.to_target(target))
    for (arm, name, seed, _), run in zip(arm_tasks, arm_runs, strict=True):
        times.setdefault((arm, name), []).append(run.to_target(target))
        print(f"  {arm:12s} start {name:7s} seed {seed}: {'reached' if math.isfinite(run.to_target(target)) else 'missed'}"
              f" at {run.to_target(target):.1f}s cpu (wall {run.wall:.1f}s), {run.curve[-1][1]} steps, val "
              f"{run.curve[-1][2]:.4f}, decisions {run.decisions}, final lr x{run.final_lr_scale:.3g} batch "
              f"{run.final_batch}", flush=True)

    arms = ["none", "grid", "schedulefree", *STRATEGIES]
    print()
    print("CPU seconds to the target (median over seeds; miss: not reached in the budget); x: none's / the arm's")
    print(f"{'arm':14s}" + "".join(f"{name + ' (lr ' + format(lr_of(p), 'g') + ')':>26s}"
                                   for name, p in STARTS.items()))
    result: dict[str, float] = {}
    for arm in arms:
        cells = []
        for name in STARTS:
            t = median(times[(arm, name)])
            x = ratio(median(times[("none", name)]), t)
            if arm != "none":
                result[f"{arm}_{name}_ratio"] = x
            if math.isinf(x):
                cells.append(f"{fmt_t(t)} s  none missed")
            else:
                cells.append(f"{fmt_t(t)} s  x{x:5.2f}" if x > 0 else f"{fmt_t(t)} s  x  -  ")
        print(f"{arm:14s}" + "".join(f"{c:>26s}" for c in cells))

    print("\ngoals:")
    for strategy in STRATEGIES:
        harm = result[f"{strategy}_default_ratio"] >= 1 / 1.05
        rescue = []
        for name in ("low", "high"):
            none_t = median(times[("none", name)])
            mine = median(times[(strategy, name)])
            rescue.append(math.isfinite(mine) and (math.isinf(none_t) or none_t / mine >= 2.0))
        grid = all(median(times[(strategy, n)]) < median(times[("grid", n)]) for n in STARTS)
        print(f"  {strategy:8s} do no harm (default within 1.05x of none): {'met' if harm else 'NOT met'}; "
              f"rescue from 10x low / 10x high (>= 2x none): {'met' if rescue[0] else 'NOT met'} / "
              f"{'met' if rescue[1] else 'NOT met'}; better than the grid at every start: {'met' if grid else 'NOT met'}")

    finals: dict[str, list[float]] = {}
    for (label, _, _), run in zip(heal_tasks, heal_runs, strict=True):
        finals.setdefault(label, []).append(run.curve[-1][2])
        if run.events:
            print(f"  {label}: {run.events[0]}")
    base = median(finals["unfaulted"])
    with_rule, without = median(finals["node loss, rule sqrt"]), median(finals["node loss, rule none"])
    gap_ratio = (without - base) / (with_rule - base) if with_rule != base else math.nan
    print(f"\nnode loss at step {schedule // 2} of {schedule} (global batch {GLOBAL_BATCH} -> {GLOBAL_BATCH // DP}): "
          f"val loss at the end, unfaulted {base:.4f}; LR rescaled by sqrt {with_rule:.4f}; not rescaled {without:.4f} "
          f"(gap to unfaulted {with_rule - base:+.4f} vs {without - base:+.4f})")
    print(f"target {target:.4f}; total bench wall {time.perf_counter() - t_all:.0f}s")
    result["rescale_gap_ratio"] = gap_ratio
    print("RESULT " + " ".join(f"{k}={v:.3f}" for k, v in result.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
