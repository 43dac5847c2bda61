"""The controller bench's real-model tasks: a 2-hidden-layer MLP trained with SGD + Nesterov
momentum on labels sampled from a fixed random teacher network (its entropy is the loss floor).

Two instances: ``mlp_nesterov``, the bench's task, and ``mlp_cal``, another teacher, width and
batch on which the sgd preset's curvature threshold is chosen (its own seeds), so that the bench's
task stays a check. Parameters and gradients live in one flat buffer each, as DDP's buckets and
FSDP's flat parameters do, so the controller's reads are a few dot products on one tensor.
"""

from __future__ import annotations

import copy
import math
import multiprocessing
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from trainguard.agent.controller.calibrate import auc
from trainguard.agent.controller.evidence import Action, EvidenceConfig, EvidenceController, curvature_share
from trainguard.agent.controller.nqm import NESTEROV

MLP_IN, MLP_CLASSES, MLP_HELD = 32, 10, 2048


@dataclass(frozen=True)
class MLPTask:
    name: str
    teacher_seed: int
    hidden: int
    batch: int
    good_lr: float
    """The base LR with the lowest median val loss at the schedule's end (``--mlp-sweep``)."""


MLP_NESTEROV = MLPTask("mlp_nesterov", 12345, 256, 256, 0.1)
MLP_CAL = MLPTask("mlp_cal", 54321, 96, 64, 0.02)
MLP_TASKS = {t.name: t for t in (MLP_NESTEROV, MLP_CAL)}
MLP_CAL_SEEDS = range(100, 110)


@dataclass(kw_only=True)
class MLPRun:
    """What one run records (the bench's Run adds which run it was)."""

    curve: list[tuple[float, int, float, float]] = field(default_factory=list)
    decisions: list[str] = field(default_factory=list)
    executed: int = 0
    clock: float = 0.0
    final_val: float = math.nan
    final_test: float = math.nan
    final_lr_scale: float = 1.0

    def to_target(self, target: float) -> float:
        return next((t for t, _, val, _ in self.curve if val <= target), math.inf)


def time_ratio(num: float, den: float) -> float:
    """num / den for times: a miss (inf) in the denominator is 0, in both 1."""
    if math.isinf(den):
        return 1.0 if math.isinf(num) else 0.0
    return num / den if den > 0 else math.nan


def fit_run(job: tuple[MLPTask, float, int, EvidenceConfig | None, int]) -> MLPRun:
    """One calibration run (a worker's job): the task from ``mult`` x its good LR, controlled by
    the config or not, on the step clock, 1.5x its ``steps``-step schedule."""
    task, mult, seed, cfg, steps = job
    torch.set_num_threads(1)
    ev = EvidenceController(steps, cfg) if cfg is not None else None
    return MLPLoop(task, task.good_lr * mult, steps, seed, ev, True, step_clock=True).run(MLPRun(), int(1.5 * steps), 10)


def fit_mlp(configs: list[EvidenceConfig], starts: tuple[str, ...], seeds: range, mult: dict[str, float],
            jobs: int, steps: int = 1000) -> list[tuple[EvidenceConfig, int, float, float, dict[str, float]]]:
    """Per config on ``MLP_CAL``: seeds silent at the good LR, harm and final loss ratios there,
    and the median rescue ratio from each start (the bench's target and ratios, step clock)."""
    ctx = multiprocessing.get_context("spawn")
    work: list[tuple[MLPTask, float, int, EvidenceConfig | None, int]] = [(MLP_CAL, 1.0, s, None, steps) for s in seeds]
    for cfg in configs:
        work += [(MLP_CAL, mult[name], s, cfg, steps) for name in ("good", *starts) for s in seeds]
    with ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
        runs = list(pool.map(fit_run, work, chunksize=1))
    n = len(seeds)
    base, runs = runs[:n], runs[n:]
    target = statistics.median(next(v for _, st, v, _ in r.curve if st >= 0.75 * steps) for r in base)
    none_time = [r.to_target(target) for r in base]
    rows = []
    for cfg in configs:
        good, runs = runs[:n], runs[n:]
        rescue = {}
        for name in starts:
            these, runs = runs[:n], runs[n:]
            rescue[name] = statistics.median(time_ratio(t, r.to_target(target)) for t, r in zip(none_time, these, strict=True))
        rows.append((cfg, sum(not r.decisions for r in good),
                     statistics.median(time_ratio(t, r.to_target(target)) for t, r in zip(none_time, good, strict=True)),
                     statistics.median(r.final_test / b.final_test for r, b in zip(good, base, strict=True)), rescue))
    return rows


def describe(a: Action) -> str:
    return f"{a.kind}@{a.step}->x{a.lr_scale:.3g}"


def teacher(task: MLPTask) -> torch.nn.Module:
    torch.manual_seed(task.teacher_seed)
    net = torch.nn.Sequential(torch.nn.Linear(MLP_IN, 64), torch.nn.Tanh(), torch.nn.Linear(64, MLP_CLASSES))
    for p in net.parameters():
        p.requires_grad_(False)
    return net


def draw(net: torch.nn.Module, n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(n, MLP_IN, generator=gen)
    with torch.no_grad():
        probs = torch.softmax(10.0 * net(x), dim=1)
    return x, torch.multinomial(probs, 1, generator=gen).squeeze(1)


class MLPLoop:
    """One run with the NQM's schedule (2 % warm-up, cosine to a tenth): a fresh minibatch stream
    per seed, fixed val and test sets from their own stream."""

    def __init__(self, task: MLPTask, lr: float, steps: int, seed: int, evidence: EvidenceController | None,
                 act: bool, step_clock: bool = False) -> None:
        self.task, self.step_clock = task, step_clock
        """step_clock: the clock counts executed steps (a calibration's deterministic clock), not CPU seconds."""
        self.teacher = teacher(task)
        held = torch.Generator().manual_seed(777)
        self.val, self.test = draw(self.teacher, MLP_HELD, held), draw(self.teacher, MLP_HELD, held)
        self.gen = torch.Generator().manual_seed(seed)
        torch.manual_seed(seed)
        h = task.hidden
        self.model = torch.nn.Sequential(torch.nn.Linear(MLP_IN, h), torch.nn.ReLU(), torch.nn.Linear(h, h),
                                         torch.nn.ReLU(), torch.nn.Linear(h, MLP_CLASSES))
        params = list(self.model.parameters())
        n = sum(p.numel() for p in params)
        self.theta, self.grad = torch.zeros(n), torch.zeros(n)
        off = 0
        for p in params:  # every parameter and its gradient a view into one flat buffer
            k = p.numel()
            self.theta[off:off + k].copy_(p.detach().reshape(-1))
            p.data = self.theta[off:off + k].view_as(p)
            p.grad = self.grad[off:off + k].view_as(p)
            off += k
        self.opt = torch.optim.SGD(params, lr=lr, momentum=0.9, nesterov=True)
        self.lr, self.steps, self.evidence, self.act = lr, steps, evidence, act
        self.ref = self.theta.clone()
        self.d = torch.empty_like(self.theta)
        self.dots = torch.empty(3)
        """Preallocated: a read allocates nothing, so the arms that read share none's memory layout."""

    def flat_ok(self) -> bool:
        """Whether the parameters and gradients still live in the flat buffers."""
        return all(p.data_ptr() >= self.theta.data_ptr() and p.grad is not None
                   and p.grad.data_ptr() >= self.grad.data_ptr()
                   and p.data_ptr() < self.theta.data_ptr() + 4 * self.theta.numel()
                   and p.grad.data_ptr() < self.grad.data_ptr() + 4 * self.grad.numel()
                   for p in self.model.parameters())

    @torch.no_grad()
    def evaluate(self) -> tuple[float, float]:
        return tuple(float(F.cross_entropy(self.model(x), y)) for x, y in (self.val, self.test))  # type: ignore[return-value]

    def run(self, out: MLPRun, budget: int, val_every: int) -> MLPRun:
        clock, step, scale = 0.0, 0, 1.0
        snap: dict[str, Any] | None = None
        ev = self.evidence
        for executed in range(1, budget + 1):
            t0 = time.process_time()
            if ev is not None and ev.window_start(step):
                self.ref.copy_(self.theta)
            x, y = draw(self.teacher, self.task.batch, self.gen)
            self.opt.zero_grad(set_to_none=False)
            loss = F.cross_entropy(self.model(x), y)
            loss.backward()
            traj, gain = None, None
            curv = ev is not None and ev.reads_curvature(step + 1)
            if ev is not None and ev.reads(step + 1):
                d = torch.sub(self.theta, self.ref, out=self.d)
                torch.dot(self.grad, d, out=self.dots[0])
                torch.dot(self.grad, self.grad, out=self.dots[1])
                torch.dot(d, d, out=self.dots[2])
                gd, gg, dd = self.dots.tolist()
                traj = -gd / math.sqrt(gg * dd) if gg * dd > 0 else 0.0
            g_before = float(self.grad @ self.theta) if curv else 0.0
            for group in self.opt.param_groups:
                group["lr"] = self.lr * scale * NESTEROV.lr_at(step, self.steps)
            self.opt.step()
            step += 1
            if curv:
                with torch.no_grad():
                    after = float(F.cross_entropy(self.model(x), y))
                gain = (g_before - float(self.grad @ self.theta), float(loss.detach()) - after)
            if ev is not None:
                action = ev.observe(step, float(loss.detach()), traj, gain)
                if action is not None and self.act:
                    out.decisions.append(describe(action))
                    if action.kind == "move":
                        snap = {"model": copy.deepcopy(self.model.state_dict()),
                                "opt": copy.deepcopy(self.opt.state_dict()), "step": step}
                    elif action.kind == "restore" and snap is not None:
                        self.model.load_state_dict(snap["model"])
                        self.opt.load_state_dict(snap["opt"])
                        step = snap["step"]
                    if action.kind != "move":
                        snap = None
                    scale = action.lr_scale
            clock += 1.0 if self.step_clock else time.process_time() - t0  # evaluation below is off the clock
            if executed % val_every == 0 or step == self.steps or executed == budget:
                val, test = self.evaluate()
                out.curve.append((clock, step, val, test))
                if step == self.steps and math.isnan(out.final_val):
                    out.final_val, out.final_test = val, test
                if not math.isfinite(val):
                    break
        out.executed, out.clock, out.final_lr_scale = executed, clock, scale
        if math.isnan(out.final_val) and out.curve:
            out.final_val, out.final_test = out.curve[-1][2], out.curve[-1][3]
        return out


class WindowReader(EvidenceController):
    """Reads both signals in every window of the run and never acts: the ROC's data."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.windows: dict[int, tuple[float, float]] = {}
        """Window end step -> (mean trajectory cosine of its second half, curvature share of its last read)."""
        self._c: list[float] = []
        self._g: tuple[float, float] | None = None

    def reads(self, step: int) -> bool:
        offset = step % self.window
        return offset == 0 or offset > self.window // 2

    def reads_curvature(self, step: int) -> bool:
        offset = step % self.window
        return offset == 0 or offset > self.window - self.config.curvature_reads

    def observe(self, step: int, loss: float, traj_cos: float | None,
                gain: tuple[float, float] | None = None) -> Action | None:
        if traj_cos is not None:
            self._c.append(traj_cos)
        if gain is not None:
            self._g = gain
        if step % self.window == 0:
            share = curvature_share(*self._g) if self._g else None
            self.windows[step] = (statistics.fmean(self._c) if self._c else 0.0, math.inf if share is None else share)
            self._c, self._g = [], None
        return None


def window_job(job: tuple[MLPTask, float, int, int]) -> dict[int, tuple[float, float]]:
    task, mult, seed, steps = job
    torch.set_num_threads(1)
    reader = WindowReader(steps)
    MLPLoop(task, task.good_lr * mult, steps, seed, reader, False, step_clock=True).run(MLPRun(), int(0.45 * steps), 10 ** 9)
    return reader.windows


def mlp_roc(task: MLPTask, seeds: range, mult: dict[str, float], jobs: int, steps: int = 1000,
            at: tuple[float, ...] = (0.02, 0.1, 0.2, 0.4)) -> dict[str, dict[float, dict[str, float]]]:
    """Per signal (traj_cos, curvature) and window position: the AUC of each start against the
    good LR, oriented so that 1 separates in the direction the start needs."""
    work = [(task, m, s, steps) for m in mult.values() for s in seeds]
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
        rows = list(pool.map(window_job, work, chunksize=1))
    by = {name: rows[i * len(seeds):(i + 1) * len(seeds)] for i, name in enumerate(mult)}
    window = EvidenceController(steps).window
    out: dict[str, dict[float, dict[str, float]]] = {}
    for j, sig in enumerate(("traj_cos", "curvature")):
        out[sig] = {}
        for f in at:
            end = max(window, round(f * steps / window) * window)
            good = [r[end][j] for r in by["good"]]
            cell = {}
            for name, m in mult.items():
                if name == "good":
                    continue
                vals = [r[end][j] for r in by[name]]
                sign = (1 if m < 1 else -1) * (1 if sig == "traj_cos" else -1)
                cell[name] = auc([sign * v for v in vals], [sign * v for v in good])
            out[sig][f] = cell
    return out
