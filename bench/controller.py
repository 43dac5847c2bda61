#!/usr/bin/env python3
"""Does turning the evidence controller on cost anything at a good LR, and does it rescue a bad
one in either direction? Paired, interleaved runs on several tasks, with bootstrap intervals.

Tasks:
  nqm_adam, nqm_nesterov  the noisy quadratic model (agent/controller/nqm.py) with Adam and with
                SGD + Nesterov momentum: known good LR, milliseconds a run, so 20 seeds are cheap.
                Clock: steps executed (restored ones count); evaluation: the true loss L(theta).
  mlp_nesterov  a real model with SGD + Nesterov momentum: a 2-hidden-layer MLP (32-256-256-10) on
                a fixed random teacher's sampled labels, batch 256, a fresh minibatch stream per
                seed, fixed val and test sets; clock: process CPU seconds with evaluation off it;
                good LR 0.1 (--mlp-sweep); the controller runs the sgd preset (--curvature X turns
                its opt-in curvature test on; X = 0.1 is --fit-sgd's pick on bench/mlptask.py's MLP_CAL).
  gpt           the trainer's bundled GPT with AdamW on the standard-library byte corpus, CPU,
                one torch thread; clock: process CPU seconds with evaluation taken off it;
                evaluation: a held-out val split (target, time to target) and a separate test
                split (the reported final loss). Good LR: TrainConfig's default.
Arms, every one from every start (x1/30 .. x30 of the good LR), each seed's runs shuffled
together so the arms interleave in time (machine drift hits them alike):
  none          the planned warmup+cosine schedule at the starting LR, untouched;
  evidence      the evidence controller (agent/controller/evidence.py): on the NQM tasks the preset
                of the optimizer family (sgd for nqm_nesterov, adam for nqm_adam), on gpt the
                agent's default (EvidenceConfig())
                on the same run: moves only when its pre-registered test fires, each move
                snapshot-protected (a state copy) and checked against a forecast;
  null          (good LR only) reads what the controller reads and never acts: overhead;
  grid          3 runs at the start x0.1, x1, x10 to the schedule's end, the winner by its val
                loss there; its time = the losers' full runs + the winner's time to target.
Every run executes 1.5x its planned steps at most (the schedule's floor after its end); nothing
stops at the target, so harm after it shows in the final loss. The target is the median over seeds
of none at the good LR's val loss at 75 % of the schedule.

Ratios are paired per seed and summarised by their median with a 95 % bootstrap interval:
  T_harm_ratio, T_harm_ci_lo   none / evidence time to target at the good LR (above 1: faster);
  T_final_loss_ratio           evidence / none loss at the schedule's end at the good LR (below 1: better);
  T_rescue_<x>_ratio           none at the good LR / evidence from start x (0: never reached);
  T_grid_<x>_ratio             the grid's time with its cost / evidence's, from start x;
  T_null_step_ratio            none's / null's clock per step at the good LR (overhead, mlp and gpt).
Goals printed met / not met: do no harm (harm ratio >= 0.98, its lower bound >= 0.96, final loss
ratio <= 1), rescue (every 3x-30x start at ratio >= 1/1.5), better than the grid at every start.
Per-seed lines with each run's decisions and the commit go to stdout and to --out (JSON).
--quick is a smoke run (3 seeds of 600-step NQM runs, a 100-step mlp and a 40-step gpt on three
starts, the gpt with 4-step windows), not a measurement.

Healing arm (gpt): a node loss halfway through a 2-rank job (a user script's fixed per-rank batch,
so the global batch halves), the agent's controller with strategy none and its LR rule
(``lr_batch_rule`` sqrt) against the same loss without the rescale: val loss at the end
(rescale_gap_ratio: unrescaled gap to the unfaulted run / the rescaled one's).

    python bench/controller.py [--quick] [--seeds N] [--mlp-seeds N] [--gpt-seeds N] [--steps N] [--jobs N]
                               [--tasks nqm_adam,nqm_nesterov,mlp_nesterov,gpt] [--mlp-sweep] [--out results.json] [--signals] [--fit] [--probes]
                               [--fit-sgd] [--curvature X]
--signals prints the NQM ROC of the candidate LR signals (docs/controller.md) and exits; --fit
prints the too-low test's grid on the Adam calibration task (nqm.ADAM_CAL, seeds 100-111), where
the adam preset's low_start was chosen, and exits; --probes prints how often a budgeted branch
probe (agent/controller/probe.py) picks LR/4 from each start on the NQM tasks, and exits.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import multiprocessing
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.mlptask import (  # noqa: E402
    MLP_CAL,
    MLP_CAL_SEEDS,
    MLP_NESTEROV,
    MLPLoop,
    MLPRun,
    describe,
    fit_mlp,
    mlp_roc,
    time_ratio,
)
from trainguard.agent.controller import ControllerConfig, install  # noqa: E402
from trainguard.agent.controller.calibrate import (  # noqa: E402
    MULTIPLIERS,
    SIGNALS,
    fit_grid,
    probe_table,
    run_nqm,
    signal_roc,
)
from trainguard.agent.controller.evidence import EvidenceConfig, EvidenceController, preset  # noqa: E402
from trainguard.agent.controller.nqm import ADAM_CAL, CAL_SEEDS, TASKS  # noqa: E402
from trainguard.agent.controller.probe import ProbeConfig  # noqa: E402
from trainguard.agent.eventlog import EventLog  # noqa: E402
from trainguard.agent.lifecycle.plans import PlanStore  # noqa: E402
from trainguard.agent.ranktable import RankTable  # noqa: E402
from trainguard.agent.wire import Telemetry  # noqa: E402
from trainguard.run.alignment import UpdateAlignment  # noqa: E402
from trainguard.run.link import PlanWatcher  # noqa: E402
from trainguard.trainer.config import OptimConfig, TrainConfig  # noqa: E402
from trainguard.trainer.data import Corpus, Sampler, split_counts, val_index, windows  # noqa: E402
from trainguard.trainer.model import build_stage  # noqa: E402
from trainguard.trainer.train import lr_at  # noqa: E402

JOB = "bench"
DP = 2
GLOBAL_BATCH = 16
DEFAULT_LR = OptimConfig().lr
GRID = (0.1, 1.0, 10.0)
"""The grid around a starting LR."""
OFF = [k for k in MULTIPLIERS if k != "good"]
BUDGET = 1.5
"""Steps a run may execute, as a multiple of its planned schedule."""


@dataclass
class Run(MLPRun):
    task: str
    arm: str
    start: str
    seed: int
    mult: float

    def clock_at(self, step: int) -> float:
        return next((t for t, s, _, _ in self.curve if s >= step), self.clock)


def make_cfg(steps: int, lr: float, seed: int, cache: str) -> TrainConfig:
    return TrainConfig.from_dict({
        "model": {"layers": 2, "d_model": 64, "heads": 4, "context": 64},
        "data": {"cache_dir": cache, "max_bytes": 4_000_000, "val_samples": 96},
        "optim": {"lr": lr, "warmup": max(1, steps // 40), "clip": 1.0},
        "parallel": {"dp": DP}, "steps": steps, "global_batch": GLOBAL_BATCH, "seed": seed})


class Loop:
    """One GPT run: emulated dp ranks, an LR scale set by the evidence controller (with in-memory
    snapshots) or by plans of the agent's controller (the healing arm), periodic evaluation."""

    def __init__(self, cfg: TrainConfig, corpus: Corpus, *, controller: ControllerConfig | None = None,
                 evidence: EvidenceController | None = None, act: bool = True, workdir: str = "") -> None:
        self.cfg = cfg
        self.corpus = corpus
        torch.manual_seed(cfg.seed)
        self.model = build_stage(cfg.model, cfg.seed)
        span = cfg.model.context + 1
        self.sampler = Sampler(len(corpus.train) // span, cfg.seed)
        held = torch.from_numpy(windows(corpus.val, cfg.model.context,
                                        val_index(len(corpus.val) // span, cfg.data.val_samples)))
        self.val, self.test = held[0::2], held[1::2]  # two disjoint held-out sets
        o = cfg.optim
        self.opt: Any = torch.optim.AdamW(self.model.parameters(), lr=o.lr, betas=(o.beta1, o.beta2),
                                          weight_decay=o.weight_decay)
        self.params = list(self.model.parameters())
        self.sizes = split_counts(cfg.global_batch, DP)
        self.alignment = UpdateAlignment(self.params)
        self.update_cos: float | None = None
        self.traj_cos = 0.0
        self.ref: torch.Tensor | None = None
        self.lr_scale = 1.0
        self.version = 0
        self.evidence, self.act = evidence, act
        self.agent: Any = None
        self.controller: Any = None
        if controller is not None:
            self.agent = SimpleNamespace(
                table=RankTable(), plans=PlanStore(os.path.join(workdir, "plans")),
                events=EventLog(os.path.join(workdir, "events"), "bench"), tick_hooks=[], rollback=None,
                exporter=SimpleNamespace(sources=[]),
                supervisor=SimpleNamespace(jobs={JOB: SimpleNamespace(spec=SimpleNamespace(trainer=cfg.to_dict()),
                                                                      decides_here=True, attempt=0)}))
            self.agent.plans.reset(JOB)
            self.controller = install(self.agent, controller)
            self.watcher = PlanWatcher(self.agent.plans.path(JOB))
            self.version = self.watcher.poll().version

    def flat(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self.params])

    @torch.no_grad()
    def evaluate(self) -> tuple[float, float]:
        out = []
        for held in (self.val, self.test):
            logits = self.model(held[:, :-1])
            out.append(float(F.cross_entropy(logits.reshape(-1, 256), held[:, 1:].reshape(-1))))
        return out[0], out[1]

    def snapshot(self, step: int) -> dict[str, Any]:
        return {"model": copy.deepcopy(self.model.state_dict()), "opt": copy.deepcopy(self.opt.state_dict()),
                "step": step}

    def restore(self, snap: dict[str, Any]) -> int:
        self.model.load_state_dict(snap["model"])
        self.opt.load_state_dict(snap["opt"])
        return int(snap["step"])

    def step(self, step: int, traj: bool = False) -> tuple[float, float, list[tuple[int, float]], float, float, float]:
        cfg = self.cfg
        idx = self.sampler.next_step(self.sizes)
        global_n = sum(self.sizes)
        lr = lr_at(cfg, step) * self.lr_scale
        t0 = time.perf_counter()
        total = [torch.zeros_like(p) for p in self.params]
        local: list[tuple[int, float]] = []
        loss_sum = 0.0
        for r, n in enumerate(self.sizes):
            if n == 0:
                local.append((0, 0.0))
                continue
            batch = torch.from_numpy(windows(self.corpus.train, cfg.model.context, idx[r]))
            x, y = batch[:, :-1], batch[:, 1:]
            for p in self.params:
                p.grad = None
            logits = self.model(x)
            loss = F.cross_entropy(logits.reshape(-1, 256), y.reshape(-1))
            loss.backward()
            sq = 0.0
            w = n / global_n
            for p, acc in zip(self.params, total, strict=True):
                if p.grad is not None:
                    sq += float(p.grad.double().pow(2).sum())
                    acc.add_(p.grad, alpha=w)
            local.append((n, sq))
            loss_sum += float(loss.detach()) * n
        t1 = time.perf_counter()
        grad_sq = 0.0
        for p, acc in zip(self.params, total, strict=True):
            p.grad = acc
            grad_sq += float(acc.double().pow(2).sum())
        if traj and self.ref is not None:
            # cos(g, -(theta - theta_ref)): what the evidence controller reads each step.
            g = torch.cat([a.reshape(-1) for a in total])
            d = self.flat() - self.ref
            denom = float(g.norm() * d.norm())
            self.traj_cos = float(-(g @ d)) / denom if denom > 0 else 0.0
        norm = math.sqrt(grad_sq)
        if cfg.optim.clip and norm > cfg.optim.clip:
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(cfg.optim.clip / (norm + 1e-6))
        for g_ in self.opt.param_groups:
            g_["lr"] = lr
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

    def run(self, out: Run, budget: int, val_every: int, lose_rank_at: int | None = None) -> Run:
        """Execute up to ``budget`` steps; the trajectory's step goes back when a snapshot is restored."""
        schedule = self.cfg.steps
        clock = 0.0
        pending = None
        snap: dict[str, Any] | None = None
        step = 0
        ev = self.evidence
        for executed in range(1, budget + 1):
            t0 = time.process_time()
            if step == lose_rank_at:
                self.lose_rank()
            if pending is not None:
                self.version, self.lr_scale = pending.version, pending.lr_scale
                if pending.batch_sizes and len(pending.batch_sizes) == len(self.sizes):
                    self.sizes = list(pending.batch_sizes)
                pending = None
            if ev is not None and ev.window_start(step):
                self.ref = self.flat().clone()
            loss, grad_sq, local, lr, compute_s, opt_s = self.step(step, ev is not None and ev.reads(step + 1))
            step += 1
            if ev is not None:
                action = ev.observe(step, loss, self.traj_cos)
                if action is not None and self.act:
                    out.decisions.append(describe(action))
                    if action.kind == "move":
                        snap = self.snapshot(step)
                    elif action.kind == "restore" and snap is not None:
                        step = self.restore(snap)
                    if action.kind != "move":
                        snap = None
                    self.lr_scale = action.lr_scale
            if self.controller is not None:
                now = time.process_time()
                dp, gn = len(self.sizes), sum(self.sizes)
                for r, (b, sq) in enumerate(local):
                    self.agent.table.add(Telemetry(
                        job=JOB, rank=r, local_rank=r, pid=os.getpid(), step=step, wall_time=now,
                        step_s=compute_s + opt_s, data_s=0.0, fwd_bwd_s=compute_s * b / gn * dp, comm_s=0.0,
                        opt_s=opt_s, samples=b, tokens=b * self.cfg.model.context, loss=loss,
                        grad_norm=math.sqrt(grad_sq), local_grad_sq=sq, lr=lr, batch_size=b, mem_bytes=0,
                        plan_version=self.version, dp_rank=r, world_size=dp, update_cos=self.update_cos))
                self.controller.tick(self.agent, now)
                polled = self.watcher.poll()
                if polled.version != self.version:
                    pending = polled
            clock += time.process_time() - t0  # evaluation below is off the clock
            if executed % val_every == 0 or step == schedule or executed == budget:
                val, test = self.evaluate()
                out.curve.append((clock, step, val, test))
                if step == schedule and math.isnan(out.final_val):
                    out.final_val, out.final_test = val, test
                if not math.isfinite(val):
                    break
        out.executed, out.clock = executed, clock
        if math.isnan(out.final_val) and out.curve:
            out.final_val, out.final_test = out.curve[-1][2], out.curve[-1][3]
        out.final_lr_scale = self.lr_scale
        if self.controller is not None:
            out.decisions += [e["message"] for e in self.agent.events.since(0, 10_000)
                              if e["kind"] in ("controller_lr_rescale", "controller_rollback")]
            self.controller.close()
        return out


def restore_check(cache: str) -> str:
    """The GPT loop's snapshot and restore bring back parameters and optimizer state exactly ("" if
    so, else what differs): the evidence arm's moves lean on it, and a short run may never move."""
    corpus = Corpus.load(cache, 4_000_000)
    loop = Loop(make_cfg(20, DEFAULT_LR, 0, cache), corpus)
    for step in range(3):
        loop.step(step)
    snap = loop.snapshot(3)
    params, exp_avg = loop.flat().clone(), [s["exp_avg"].clone() for s in loop.opt.state.values()]
    for step in range(3, 6):
        loop.step(step)
    if torch.equal(loop.flat(), params):
        return "the parameters did not move between snapshot and restore"
    if loop.restore(snap) != 3:
        return "restore returned the wrong step"
    if not torch.equal(loop.flat(), params):
        return "parameters differ after restore"
    if not all(torch.equal(a["exp_avg"], b) for a, b in zip(loop.opt.state.values(), exp_avg, strict=True)):
        return "optimizer state differs after restore"
    return ""


# --- worker side: one spec = one run -------------------------------------------------------------
_CORPUS: Corpus | None = None


def _corpus(cache: str) -> Corpus:
    global _CORPUS
    if _CORPUS is None:
        torch.set_num_threads(1)
        _CORPUS = Corpus.load(cache, 4_000_000)
    return _CORPUS


@dataclass(frozen=True)
class Spec:
    task: str
    arm: str
    """none, evidence, null, grid (a grid member without its own start), or a healing arm."""
    start: str
    mult: float
    seed: int
    schedule: int
    budget: int
    val_every: int = 1
    cache: str = ""
    work: str = ""
    rule: str = ""
    """Healing arm: the agent controller's lr_batch_rule."""
    lose_rank_at: int | None = None
    min_window: int = EvidenceConfig().min_window
    """Shortest window in steps (quick: 4, so a 40-step run gets looks at all)."""
    curvature: float = 0.0
    """mlp_nesterov: the sgd preset's high_curvature (0: off, as the preset ships)."""


def run_spec(spec: Spec) -> Run:
    out = Run(spec.task, spec.arm, spec.start, spec.seed, spec.mult)
    if spec.task.startswith("nqm_"):
        r = run_nqm(TASKS[spec.task[4:]], spec.mult, spec.seed, spec.schedule, control=spec.arm == "evidence",
                    budget=spec.budget)
        out.curve = [(i + 1.0, i + 1, v, v) for i, v in enumerate(r.losses)]
        out.executed, out.clock = len(r.losses), float(len(r.losses))
        out.final_val = out.final_test = r.final_loss
        out.final_lr_scale = r.final_lr_scale
        out.decisions = [describe(a) for a in r.actions]
        return out
    if spec.task == "mlp_nesterov":
        torch.set_num_threads(1)
        cfg = replace(preset("sgd"), high_curvature=spec.curvature)
        ev = EvidenceController(spec.schedule, cfg) if spec.arm in ("evidence", "null") else None
        return MLPLoop(MLP_NESTEROV, MLP_NESTEROV.good_lr * spec.mult, spec.schedule, spec.seed, ev,
                       spec.arm == "evidence").run(out, spec.budget, spec.val_every)
    corpus = _corpus(spec.cache)
    cfg = make_cfg(spec.schedule, DEFAULT_LR * spec.mult, spec.seed, spec.cache)
    kw: dict[str, Any] = {}
    if spec.arm in ("evidence", "null"):
        # What the agent ships (EvidenceConfig()), not the NQM-fitted adam preset: docs/controller.md.
        kw["evidence"] = EvidenceController(spec.schedule, EvidenceConfig(min_window=spec.min_window))
        kw["act"] = spec.arm == "evidence"
    if spec.rule:
        kw["controller"] = ControllerConfig(strategy="none", lr_batch_rule=spec.rule)  # type: ignore[arg-type]
        kw["workdir"] = tempfile.mkdtemp(dir=spec.work)
    return Loop(cfg, corpus, **kw).run(out, spec.budget, spec.val_every, spec.lose_rank_at)


# --- statistics ----------------------------------------------------------------------------------
def bootstrap(values: list[float], reps: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """Median of ``values`` and the 2.5 / 97.5 percentiles of the medians of resamples."""
    if not values:
        return math.nan, math.nan, math.nan
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(reps))
    return statistics.median(values), meds[int(0.025 * reps)], meds[int(0.975 * reps) - 1]


def commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True,
                               timeout=10).stdout.strip()
        return head + ("+dirty" if dirty else "") if head else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


# --- the bench -----------------------------------------------------------------------------------
@dataclass
class Plan:
    task: str
    seeds: int
    schedule: int
    starts: list[str]
    val_every: int
    min_window: int = EvidenceConfig().min_window
    curvature: float = 0.0


def specs_for(p: Plan, cache: str, work: str) -> list[Spec]:
    """Every run of a task, each seed's runs shuffled together (arms interleaved in time)."""
    budget = int(BUDGET * p.schedule)
    out: list[Spec] = []
    for seed in range(p.seeds):
        runs: list[Spec] = []
        base = {"seed": seed, "schedule": p.schedule, "val_every": p.val_every, "cache": cache, "work": work,
                "min_window": p.min_window, "curvature": p.curvature}
        grid_mults = {MULTIPLIERS[s] * g for s in p.starts for g in GRID} - {MULTIPLIERS[s] for s in p.starts}
        for s in p.starts:
            runs.append(Spec(p.task, "none", s, MULTIPLIERS[s], budget=budget, **base))  # type: ignore[arg-type]
            runs.append(Spec(p.task, "evidence", s, MULTIPLIERS[s], budget=budget, **base))  # type: ignore[arg-type]
        runs.append(Spec(p.task, "null", "good", 1.0, budget=budget, **base))  # type: ignore[arg-type]
        for m in sorted(grid_mults):
            runs.append(Spec(p.task, "grid", "", m, budget=p.schedule, **base))  # type: ignore[arg-type]
        random.Random(f"{p.task}:{seed}").shuffle(runs)
        out += runs
    return out


def report(p: Plan, runs: list[Run], result: dict[str, float], goals: list[str]) -> None:
    t = p.task
    by = {(r.arm, r.start, r.seed): r for r in runs if r.arm != "grid"}
    fixed = {(round(r.mult, 9), r.seed): r for r in runs if r.arm in ("grid", "none")}
    seeds = range(p.seeds)
    half = int(0.75 * p.schedule)
    target = statistics.median(next(v for _, s, v, _ in by[("none", "good", i)].curve if s >= half) for i in seeds)
    good_none = [by[("none", "good", i)].to_target(target) for i in seeds]
    print(f"\n== {t}: {p.seeds} seed(s), schedule {p.schedule}, budget {int(BUDGET * p.schedule)} steps; target "
          f"{target:.5g} (none at the good LR, step {half}); none at the good LR reaches it at median "
          f"{statistics.median(good_none):.4g}")
    for r in sorted(runs, key=lambda r: (r.start, r.arm, r.seed)):
        if r.arm == "grid":
            continue
        print(f"  {t} {r.arm:8s} {r.start:6s} seed {r.seed:2d}: to target {r.to_target(target):8.4g}, final val "
              f"{r.final_val:.5g} test {r.final_test:.5g}, executed {r.executed}, lr x{r.final_lr_scale:.3g}; "
              f"decisions [{' '.join(r.decisions)}]")

    def member(start: str, g: float, seed: int) -> Run:
        """A grid member: the fixed-LR run at start x g (another start's none run where they coincide)."""
        return fixed[(round(MULTIPLIERS[start] * g, 9), seed)]

    harm = [time_ratio(good_none[i], by[("evidence", "good", i)].to_target(target)) for i in seeds]
    h, lo, hi = bootstrap(harm)
    finals = [by[("evidence", "good", i)].final_test / by[("none", "good", i)].final_test for i in seeds]
    f, flo, fhi = bootstrap(finals)
    silent = sum(not by[("evidence", "good", i)].decisions for i in seeds)
    result[f"{t}_harm_ratio"], result[f"{t}_harm_ci_lo"], result[f"{t}_final_loss_ratio"] = h, lo, f
    print(f"  {t} harm ratio (none / evidence time at the good LR) {h:.3f} [{lo:.3f}, {hi:.3f}]; final loss ratio "
          f"{f:.3f} [{flo:.3f}, {fhi:.3f}]; silent in {silent}/{p.seeds} seeds")
    null_steps = [by[("none", "good", i)].clock / by[("none", "good", i)].executed
                  / (by[("null", "good", i)].clock / by[("null", "good", i)].executed) for i in seeds
                  if by[("null", "good", i)].clock > 0]
    if not t.startswith("nqm_") and null_steps:
        result[f"{t}_null_step_ratio"] = statistics.median(null_steps)
        print(f"  {t} null arm: none's / null's clock per step {result[f'{t}_null_step_ratio']:.3f}")
    rescue_ok, grid_ok = True, True
    for s in [x for x in p.starts if x != "good"]:
        rescue = [time_ratio(good_none[i], by[("evidence", s, i)].to_target(target)) for i in seeds]
        grid_ratio = []
        for i in seeds:
            members = [member(s, g, i) for g in GRID]
            winner = min(members, key=lambda r: r.final_val if math.isfinite(r.final_val) else math.inf)
            cost = sum(r.clock_at(p.schedule) for r in members if r is not winner)
            grid_ratio.append(time_ratio(cost + winner.to_target(target), by[("evidence", s, i)].to_target(target)))
        r_med, r_lo, r_hi = bootstrap(rescue)
        g_med, g_lo, g_hi = bootstrap(grid_ratio)
        result[f"{t}_rescue_{s}_ratio"], result[f"{t}_grid_{s}_ratio"] = r_med, g_med
        none_from = statistics.median(time_ratio(good_none[i], by[("none", s, i)].to_target(target)) for i in seeds)
        print(f"  {t} from {s:6s}: rescue ratio {r_med:.3f} [{r_lo:.3f}, {r_hi:.3f}] (none from there {none_from:.3f}); "
              f"grid / evidence {g_med:.3f} [{g_lo:.3f}, {g_hi:.3f}]")
        rescue_ok &= r_med >= 1 / 1.5
        grid_ok &= g_med > 1
    full = set(p.starts) == set(MULTIPLIERS)
    harm_ok = h >= 0.98 and lo >= 0.96 and f <= 1.0
    goals.append(f"  {t}: do no harm {'met' if harm_ok else 'NOT met'}; rescue from every start "
                 f"{'met' if rescue_ok else 'NOT met'}; better than the grid at every start "
                 f"{'met' if grid_ok else 'NOT met'}{'' if full else ' (not every start was run)'}")


def heal_specs(seeds: int, schedule: int, val_every: int, cache: str, work: str) -> list[Spec]:
    out = []
    for seed in range(seeds):
        base = {"task": "gpt", "start": "good", "mult": 1.0, "seed": seed, "schedule": schedule, "budget": schedule,
                "val_every": val_every, "cache": cache, "work": work}
        out.append(Spec(arm="unfaulted", rule="sqrt", **base))  # type: ignore[arg-type]
        for rule in ("sqrt", "none"):
            out.append(Spec(arm=f"node loss, rule {rule}", rule=rule, lose_rank_at=schedule // 2,
                            **base))  # type: ignore[arg-type]
    return out


def print_signals(seeds: int, jobs: int) -> None:
    print(f"MLP_CAL (hidden {MLP_CAL.hidden}, batch {MLP_CAL.batch}), seeds {MLP_CAL_SEEDS.start}-{MLP_CAL_SEEDS.stop - 1}: "
          f"AUC against the good LR (1: separates in the needed direction), by window position")
    roc = mlp_roc(MLP_CAL, MLP_CAL_SEEDS, MULTIPLIERS, jobs)
    print(f"{'signal':12s}{'at':>5s}" + "".join(f"{k:>8s}" for k in OFF))
    for sig, rows in roc.items():
        for frac, cell in rows.items():
            print(f"{sig:12s}{frac:>5.0%}" + "".join(f"{cell[k]:8.2f}" for k in OFF), flush=True)
    for name, task in TASKS.items():
        roc = signal_roc(task, seeds=seeds)
        print(f"\nNQM {name}: AUC against the good LR (1: separates in the needed direction), by window position")
        print(f"{'signal':12s}{'at':>5s}" + "".join(f"{k:>8s}" for k in OFF))
        for sig in SIGNALS:
            for frac, cell in roc[sig].items():
                print(f"{sig:12s}{frac:>5.0%}" + "".join(f"{cell[k]:8.2f}" for k in OFF))
        print("traj_cos at the shipped thresholds: fraction of windows flagged (+ too low, - too high)")
        print(f"{'':12s}{'at':>5s}" + "".join(f"{k:>8s}" for k in MULTIPLIERS))
        for frac, cell in roc["traj_cos"].items():
            print(f"{'':12s}{frac:>5.0%}" + "".join(f"{cell['fires_' + k]:+8.2f}" for k in MULTIPLIERS))


def print_fit() -> None:
    """The two grids the adam preset was chosen from, in order: the too-low test (threshold, first
    raise), then the too-high threshold at the chosen too-low test."""
    low = [EvidenceConfig(low_threshold=th, low_start=st) for th in (0.2, 0.3, 0.35, 0.4) for st in (0.0, 0.15, 0.2, 0.25)]
    high = [replace(preset("adam"), high_threshold=th) for th in (-0.12, -0.1, -0.08, -0.06, -0.04)]
    print(f"Adam calibration NQM (dims {ADAM_CAL.dims}, noise {ADAM_CAL.noise}), seeds {CAL_SEEDS.start}-"
          f"{CAL_SEEDS.stop - 1}: silence, harm and final loss at the good LR, rescue ratios")
    for configs, starts in ((low, ("low30", "low10", "low3")), (high, ("high3", "high10", "high30"))):
        print(f"{'low_threshold':>14s}{'low_start':>10s}{'high_thr':>9s}{'silent':>8s}{'harm':>7s}{'final':>7s}  "
              f"rescue {' / '.join(starts)}", flush=True)
        for r in fit_grid(ADAM_CAL, CAL_SEEDS, configs, starts):
            c = r.config
            print(f"{c.low_threshold:14.2f}{c.low_start:10.2f}{c.high_threshold:9.2f}{r.silent:5d}/{len(CAL_SEEDS)}"
                  f"{r.harm:7.3f}{r.final:7.3f}  " + " / ".join(f"{v:.3f}" for v in r.rescue.values()), flush=True)


def print_fit_sgd(jobs: int) -> None:
    """The grid the sgd preset's curvature threshold was chosen from: on MLP_CAL (its own teacher,
    width, batch and seeds) and on the NQM nesterov task, where the preset's cosine thresholds were."""
    configs = [replace(preset("sgd"), high_curvature=th) for th in (0.1, 0.15, 0.2, 0.3, 0.45, 0.6)]
    starts = ("high3", "high10", "high30")
    print(f"sgd preset, high_curvature: silence, harm and final loss at the good LR, rescue "
          f"{' / '.join(starts)}; MLP_CAL (hidden {MLP_CAL.hidden}, batch {MLP_CAL.batch}, good LR "
          f"{MLP_CAL.good_lr:g}) seeds {MLP_CAL_SEEDS.start}-{MLP_CAL_SEEDS.stop - 1}, NQM nesterov seeds "
          f"{CAL_SEEDS.start}-{CAL_SEEDS.stop - 1}", flush=True)
    mlp = fit_mlp(configs, starts, MLP_CAL_SEEDS, MULTIPLIERS, jobs)
    nqm = fit_grid(TASKS["nesterov"], CAL_SEEDS, configs, starts)
    print(f"{'threshold':>10s} {'task':9s}{'silent':>8s}{'harm':>7s}{'final':>7s}  rescue")
    for (cfg, silent, harm, final, rescue), row in zip(mlp, nqm, strict=True):
        for name, s, h, f, r, n in (("mlp_cal", silent, harm, final, rescue, len(MLP_CAL_SEEDS)),
                                    ("nqm", row.silent, row.harm, row.final, row.rescue, len(CAL_SEEDS))):
            print(f"{cfg.high_curvature:10.2f} {name:9s}{s:5d}/{n}{h:7.3f}{f:7.3f}  "
                  + " / ".join(f"{v:.3f}" for v in r.values()), flush=True)


def print_probes(seeds: int) -> None:
    cfg = ProbeConfig()
    print(f"Branch probes (budget {cfg.budget:.0%} of the run, LR/{cfg.factor:g} against the LR, paired on a fixed "
          f"evaluation batch, keep LR/{cfg.factor:g} when better by > {cfg.z:g} SE): fraction of {seeds} seeds that lower")
    print(f"{'steps':>6s}{'at':>5s} {'task':9s}" + "".join(f"{k:>8s}" for k in MULTIPLIERS))
    for steps in (1000, 2000, 5000):
        for at in (0.1, 0.2, 0.4):
            for name, task in TASKS.items():
                row = probe_table(task, seeds, steps, at, cfg)
                cells = "  off: the budget does not cover a branch" if row is None else "".join(
                    f"{row[k]:8.2f}" for k in MULTIPLIERS)
                print(f"{steps:6d}{at:5.0%} {name:9s}{cells}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a smoke run (< 2 min): few seeds, a short gpt")
    ap.add_argument("--seeds", type=int, default=None, help="NQM seeds (default 20; quick 3, 600-step runs)")
    ap.add_argument("--gpt-seeds", type=int, default=None, help="gpt seeds (default 10; quick 1)")
    ap.add_argument("--mlp-seeds", type=int, default=None, help="mlp_nesterov seeds (default 10; quick 1)")
    ap.add_argument("--mlp-sweep", action="store_true", help="print mlp_nesterov's final val loss by base LR and exit")
    ap.add_argument("--steps", type=int, default=None, help="gpt schedule length in steps (default 1000; quick 40)")
    ap.add_argument("--jobs", type=int, default=2, help="worker processes")
    ap.add_argument("--tasks", default="nqm_adam,nqm_nesterov,mlp_nesterov,gpt")
    ap.add_argument("--out", default="", help="JSON file for the per-seed results (default: a temp file)")
    ap.add_argument("--signals", action="store_true", help="print the NQM signal ROC and exit")
    ap.add_argument("--fit", action="store_true", help="print the adam preset's calibration grid and exit")
    ap.add_argument("--probes", action="store_true", help="print the NQM branch probes' decisions and exit")
    ap.add_argument("--fit-sgd", action="store_true", help="print the sgd preset's curvature grid and exit")
    ap.add_argument("--curvature", type=float, default=0.0,
                    help="mlp_nesterov: turn the curvature test on at this threshold (default 0: off, as shipped)")
    args = ap.parse_args()
    if args.signals:
        print_signals(args.seeds or 20, args.jobs)
        return 0
    if args.fit:
        print_fit()
        return 0
    if args.probes:
        print_probes(args.seeds or 20)
        return 0
    if args.fit_sgd:
        print_fit_sgd(args.jobs)
        return 0
    if args.mlp_sweep:
        for task, seeds in ((MLP_NESTEROV, range(args.mlp_seeds or 3)), (MLP_CAL, MLP_CAL_SEEDS[:args.mlp_seeds or 3])):
            for lr in (0.01, 0.02, 0.03, 0.05, 0.1, 0.3, 1.0):
                ends = [MLPLoop(task, lr, 1000, s, None, False).run(Run(task.name, "none", "", s, 1.0), 1000, 1000).final_val
                        for s in seeds]
                print(f"{task.name} base LR {lr:g}: final val loss, median of {len(ends)} seeds, "
                      f"{statistics.median(ends):.4f}", flush=True)
        return 0
    tasks = [t for t in args.tasks.split(",") if t]
    plans = []
    for t in tasks:
        if t.startswith("nqm_"):
            plans.append(Plan(t, args.seeds or (3 if args.quick else 20), 600 if args.quick else 1000,
                              list(MULTIPLIERS), 1))
        elif t == "mlp_nesterov":
            starts = ["low10", "good", "high10"] if args.quick else list(MULTIPLIERS)
            plans.append(Plan(t, args.mlp_seeds or (1 if args.quick else 10), 100 if args.quick else 1000, starts, 10,
                              curvature=args.curvature))
        elif t == "gpt":
            steps = args.steps or (40 if args.quick else 1000)
            starts = ["low10", "good", "high10"] if args.quick else list(MULTIPLIERS)
            plans.append(Plan(t, args.gpt_seeds or (1 if args.quick else 10), steps, starts, 10,
                              4 if args.quick else EvidenceConfig().min_window))
        else:
            print(f"bench/controller: unknown task {t!r}", file=sys.stderr)
            return 2
    work = tempfile.mkdtemp(prefix="tg-bench-ctl-")
    cache = os.path.join(work, "cache")
    rev = commit()
    print(f"bench/controller: commit {rev}; tasks {', '.join(f'{p.task} ({p.seeds} seeds, {p.schedule} steps)' for p in plans)}"
          f"{'; quick: a smoke run, not a measurement' if args.quick else ''}; {args.jobs} worker(s)", flush=True)
    t_all = time.perf_counter()
    specs: list[Spec] = []
    for p in plans:
        specs += specs_for(p, cache, work)
    gpt = next((p for p in plans if p.task == "gpt"), None)
    heal = heal_specs(gpt.seeds, gpt.schedule, gpt.val_every, cache, work) if gpt else []
    if gpt:
        Corpus.load(cache, 4_000_000)  # built once here, read by every worker
        torch.set_num_threads(1)
        problem = restore_check(cache)
        if problem:
            print(f"bench/controller: GPT snapshot/restore check failed: {problem}", file=sys.stderr)
            return 1
        print("  gpt snapshot/restore check: parameters and optimizer state restored exactly", flush=True)
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=args.jobs, mp_context=ctx) as pool:
        runs = list(pool.map(run_spec, specs + heal, chunksize=1))
    main_runs, heal_runs = runs[:len(specs)], runs[len(specs):]
    result: dict[str, float] = {}
    goals: list[str] = []
    for p in plans:
        report(p, [r for r in main_runs if r.task == p.task], result, goals)
    if heal_runs:
        finals: dict[str, list[float]] = {}
        for r in heal_runs:
            finals.setdefault(r.arm, []).append(r.final_val)
        base = statistics.median(finals["unfaulted"])
        with_rule, without = statistics.median(finals["node loss, rule sqrt"]), statistics.median(finals["node loss, rule none"])
        result["rescale_gap_ratio"] = (without - base) / (with_rule - base) if with_rule != base else math.nan
        print(f"\nnode loss at step {gpt.schedule // 2} of {gpt.schedule} (global batch {GLOBAL_BATCH} -> "  # type: ignore[union-attr]
              f"{GLOBAL_BATCH // DP}): val at the end, unfaulted {base:.4f}; LR rescaled by sqrt {with_rule:.4f}; "
              f"not rescaled {without:.4f}")
    print("\ngoals (do no harm: harm ratio >= 0.98, CI low >= 0.96, final loss ratio <= 1; rescue: >= 1/1.5 from "
          "every start; grid: its time / evidence's > 1 at every start):")
    print("\n".join(goals))
    out = args.out or os.path.join(work, "results.json")
    with open(out, "w") as fh:
        json.dump({"commit": rev, "argv": sys.argv[1:], "result": result,
                   "runs": [asdict(r) for r in runs]}, fh, default=str)
    print(f"per-seed results: {out}; total bench wall {time.perf_counter() - t_all:.0f}s")
    print("RESULT " + " ".join(f"{k}={v:.3f}" for k, v in result.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
