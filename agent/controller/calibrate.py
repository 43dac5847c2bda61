"""Runs on the noisy quadratic model (nqm.py) with and without the evidence controller, and the
ROC of the candidate LR signals: the calibration that tests and bench/controller.py share.

A run's clock is the steps it executed, restored ones included (a restore costs the steps since
the snapshot); its reported figure is the true loss L(theta), the NQM's held-out loss.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

from trainguard.agent.controller.evidence import (
    Action,
    EvidenceConfig,
    EvidenceController,
    curvature_share,
    preset,
)
from trainguard.agent.controller.nqm import NQM, NQMTask
from trainguard.agent.controller.probe import ProbeConfig, ProbeResult, compare

MULTIPLIERS: dict[str, float] = {"low30": 1 / 30, "low10": 1 / 10, "low3": 1 / 3, "good": 1.0,
                                 "high3": 3.0, "high10": 10.0, "high30": 30.0}
"""Starting LRs as multiples of the task's good LR, by the names the bench's RESULT keys use."""


@dataclass
class NQMRun:
    losses: list[float] = field(default_factory=list)
    """True loss after every executed step (the clock is the index + 1)."""
    actions: list[Action] = field(default_factory=list)
    final_lr_scale: float = 1.0
    final_loss: float = math.nan
    """True loss when the planned schedule ends (the trajectory's step ``steps``)."""

    def to_target(self, target: float) -> float:
        return next((i + 1.0 for i, v in enumerate(self.losses) if v <= target), math.inf)

    @property
    def moves(self) -> int:
        return sum(a.kind == "move" for a in self.actions)


def run_nqm(task: NQMTask, mult: float, seed: int, steps: int, *, control: bool,
            config: EvidenceConfig | None = None, budget: int | None = None) -> NQMRun:
    """One run from ``mult`` x the task's good LR: ``steps`` planned, ``budget`` executed at most
    (default 1.5 x steps, the schedule's floor LR after its end), controlled (by default with the
    preset of the task's optimizer family) or not."""
    model = NQM(task, task.good_lr * mult, steps, seed)
    ctl = EvidenceController(steps, config or preset(task.family)) if control else None
    out = NQMRun()
    snap = None
    for _ in range(budget or int(1.5 * steps)):
        if ctl is not None and ctl.window_start(model.step_no):
            model.set_ref()
        st = model.step()
        out.losses.append(st.true_loss)
        if model.step_no == steps:
            out.final_loss = st.true_loss
        if ctl is None:
            continue
        action = ctl.observe(st.step, st.loss, st.traj_cos, st.gain)
        if action is None:
            continue
        out.actions.append(action)
        if action.kind == "move":
            snap = model.snapshot()
        elif action.kind == "restore" and snap is not None:
            model.restore(snap)
        if action.kind != "move":
            snap = None
        model.lr_scale = action.lr_scale
    out.final_lr_scale = model.lr_scale
    if math.isnan(out.final_loss):
        out.final_loss = out.losses[-1]
    return out


SIGNALS = ("traj_cos", "update_cos", "grad_cos", "loss_z", "grad_norm_z", "curvature")
LOW_SIGN = {"traj_cos": 1, "update_cos": 1, "grad_cos": 1, "loss_z": -1, "grad_norm_z": -1, "curvature": -1}
"""+1: a larger value says "LR too low" (the cosines); -1: a larger value says "too high" (spikes,
the curvature share). The candidates are window statistics: the trajectory cosine (second half
of the window, reference at its start), the update alignment and Pflug's successive-gradient
cosine (window means), robust spike z-scores of the loss and of the gradient norm (the window's
largest (x - median) / (1.4826 MAD) against the 100 steps before it), and the curvature share over
the window's last ``curvature_reads`` steps."""


def _robust_max_z(history: list[float], window: list[float]) -> float:
    med = statistics.median(history)
    mad = statistics.median(abs(x - med) for x in history) * 1.4826
    return max((x - med) / mad for x in window) if mad > 0 else 0.0


def _share(gains: list[tuple[float, float]]) -> float:
    share = curvature_share(sum(p for p, _ in gains), sum(a for _, a in gains))
    return math.inf if share is None else share


def window_signals(task: NQMTask, mult: float, seed: int, steps: int, at: list[int],
                   window: int, reads: int = EvidenceConfig().curvature_reads) -> list[dict[str, float]]:
    """The candidate signals of the windows ending at the steps ``at`` of an uncontrolled run."""
    model = NQM(task, task.good_lr * mult, steps, seed)
    stats = []
    for i in range(max(at)):
        if i % window == 0:
            model.set_ref()
        stats.append(model.step())
    out = []
    for end in at:
        ws = stats[end - window:end]
        before = stats[max(0, end - window - 100):end - window]
        out.append({
            "traj_cos": statistics.fmean(s.traj_cos for s in ws[window // 2:]),
            "update_cos": statistics.fmean(s.update_cos for s in ws),
            "grad_cos": statistics.fmean(s.grad_cos for s in ws),
            "loss_z": _robust_max_z([s.loss for s in before], [s.loss for s in ws]),
            "grad_norm_z": _robust_max_z([s.grad_norm for s in before], [s.grad_norm for s in ws]),
            "curvature": _share([s.gain for s in ws[-reads:]]),
        })
    return out


def auc(positive: list[float], negative: list[float]) -> float:
    """P(a positive's value > a negative's), ties half: the area under the ROC curve."""
    wins = sum((p > n) + 0.5 * (p == n) for p in positive for n in negative)
    return wins / (len(positive) * len(negative))


def signal_roc(task: NQMTask, seeds: int = 20, steps: int = 1000, at: tuple[float, ...] = (0.1, 0.2, 0.4),
               config: EvidenceConfig | None = None) -> dict[str, dict[float, dict[str, float]]]:
    """Per signal and window position (fraction of the run): the AUC of each start against the good
    LR, oriented so that 1 is perfect separation in the direction that start needs (``LOW_SIGN``),
    0.5 none, and for traj_cos the fraction of
    windows its pre-registered thresholds flag at each start (``fires_<start>``)."""
    cfg = config or EvidenceConfig()
    window = max(cfg.min_window, round(cfg.window * steps))
    ends = [max(window * 2, round(f * steps / window) * window) for f in at]
    rows = {name: [window_signals(task, m, s, steps, ends, window) for s in range(seeds)]
            for name, m in MULTIPLIERS.items()}
    out: dict[str, dict[float, dict[str, float]]] = {}
    for sig in SIGNALS:
        out[sig] = {}
        for j, f in enumerate(at):
            good = [r[j][sig] for r in rows["good"]]
            cell: dict[str, float] = {}
            for name, mult in MULTIPLIERS.items():
                vals = [r[j][sig] for r in rows[name]]
                cell[f"mean_{name}"] = statistics.fmean(vals)
                if name != "good":
                    sign = LOW_SIGN[sig] if mult < 1 else -LOW_SIGN[sig]
                    cell[name] = auc([sign * v for v in vals], [sign * v for v in good])
                if sig == "traj_cos":
                    cell[f"fires_{name}"] = statistics.fmean(
                        (v > cfg.low_threshold) - (v < cfg.high_threshold) for v in vals)
            out[sig][f] = cell
    return out


def _ratio(num: float, den: float) -> float:
    """Time ratio none / controller: 0 when the controller never reaches the target."""
    return 0.0 if math.isinf(den) else num / den


@dataclass(frozen=True)
class FitRow:
    config: EvidenceConfig
    silent: int
    """Seeds without a move at the good LR."""
    harm: float
    final: float
    rescue: dict[str, float]
    """Median none-at-good / controller time to target, per too-low start."""


def fit_grid(task: NQMTask, seeds: range, configs: list[EvidenceConfig], starts: tuple[str, ...],
             steps: int = 1000) -> list[FitRow]:
    """Candidate configs on a calibration task: silence and harm at the good LR and rescue from
    ``starts`` (the bench's target, 75 % of none's schedule at the good LR, and its ratios)."""
    base = [run_nqm(task, 1.0, s, steps, control=False) for s in seeds]
    target = statistics.median(r.losses[int(0.75 * steps) - 1] for r in base)
    none_time = [r.to_target(target) for r in base]
    rows = []
    for cfg in configs:
        good = [run_nqm(task, 1.0, s, steps, control=True, config=cfg) for s in seeds]
        rescue = {}
        for name in starts:
            runs = [run_nqm(task, MULTIPLIERS[name], s, steps, control=True, config=cfg) for s in seeds]
            rescue[name] = statistics.median(_ratio(t, r.to_target(target)) for t, r in zip(none_time, runs, strict=True))
        rows.append(FitRow(
            cfg, sum(r.moves == 0 for r in good),
            statistics.median(_ratio(t, r.to_target(target)) for t, r in zip(none_time, good, strict=True)),
            statistics.median(r.final_loss / b.final_loss for r, b in zip(good, base, strict=True)), rescue))
    return rows


PROBE_EVAL = 64
"""Samples in the fixed evaluation batch a probe compares its branches' end points on."""


def probe_nqm(task: NQMTask, mult: float, seed: int, steps: int, at: float,
              config: ProbeConfig | None = None, evaluate: bool = True) -> ProbeResult | None:
    """One branch probe on an uncontrolled run from ``mult`` x the good LR, at fraction ``at`` of
    its ``steps``, compared on a fixed evaluation batch (``evaluate``) or on the cooldown's
    minibatch losses (None: the probe's budget does not cover a branch at this length)."""
    cfg = config or ProbeConfig()
    scales = cfg.scales(steps)
    if not scales:
        return None
    model = NQM(task, task.good_lr * mult, steps, seed)
    for _ in range(round(at * steps)):
        model.step()
    snap = model.snapshot(data=True)
    held = model.eval_batch(PROBE_EVAL, seed + 1_000_000)
    tail = max(2, (len(scales) - int(len(scales) * (1 - cfg.cooldown))) // 2)
    branches = []
    for scale in (1.0, 1 / cfg.factor):
        model.restore(snap)
        losses = []
        for s in scales:
            model.lr_scale = scale * s
            losses.append(model.step().loss)
        branches.append(model.eval_losses(held) if evaluate else losses[-tail:])
    return compare(cfg, branches[0], branches[1])


def probe_table(task: NQMTask, seeds: int, steps: int, at: float = 0.2,
                config: ProbeConfig | None = None, evaluate: bool = True) -> dict[str, float] | None:
    """Per start: the fraction of seeds in which a probe at ``at`` of the run picks LR / factor
    (None: probes are off at this length)."""
    out = {}
    for name, mult in MULTIPLIERS.items():
        results = [probe_nqm(task, mult, s, steps, at, config, evaluate) for s in range(seeds)]
        if results[0] is None:
            return None
        out[name] = statistics.fmean(r.lower for r in results if r is not None)
    return out
