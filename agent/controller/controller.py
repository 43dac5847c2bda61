"""The controller as a tick hook of the agent: reads the ranks' telemetry, runs control windows,
asks its strategy for the next (LR scale, global batch), publishes it through the job's plan and
keeps every change safe.

A window is the run of steps the ranks report under one plan version: a change is published as a
new plan version, rank 0 picks it up at a step boundary and every rank applies it at the same
step, so "steps with plan_version >= v" are exactly the steps run under the change. After
``every_steps`` such steps the window's objective goes to the strategy (strategy.py) and its next
proposal is published.

Safety, whatever the strategy:
* bounds: LR scale in [lr_scale_min, lr_scale_max], global batch in [batch_min, batch_max] and a
  multiple of dp (x pipeline microbatches); a rollback also lowers the LR ceiling of the job;
* warm-up: no change before ``warmup_steps``;
* divergence: a non-finite loss, or the median of the last 3 losses above divergence_factor x the
  loss before the window started, rolls back: the agent's ``rollback(job, reason)`` restores the
  last good checkpoint where the healing code provides it, and the controller returns to the last
  setting that completed a window, with the LR cut by ``lr_cut``;
* world size: when the data-parallel degree changes (a rank excluded, a node lost or back) and the
  global batch with it (a script with a fixed per-rank batch; the embedded trainer keeps the
  global batch), the LR scale follows the new global batch by ``lr_batch_rule`` (batch_rule.py)
  and a split of the old dp is republished for the new one. This runs with every strategy,
  ``none`` included (which otherwise only watches: it reads no per-step telemetry unless the rule
  is ``adascale``, which needs the noise scale).
Every decision (keep, change, rollback, rescale) is an event with its reason and inputs.
"""

from __future__ import annotations

import logging
import math
import statistics
import threading
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

from prometheus_client.metrics_core import Metric

from trainguard.agent.batch_rule import follow_batch
from trainguard.agent.controller.config import ControllerConfig
from trainguard.agent.controller.evidence import Action, EvidenceConfig
from trainguard.agent.controller.evidence_plan import EvidenceDriver, event_inputs
from trainguard.agent.controller.noise import NoiseScale
from trainguard.agent.controller.strategy import (
    KeepStrategy,
    Proposal,
    Setting,
    Space,
    Strategy,
    WindowResult,
    loglog_slope,
)
from trainguard.agent.controller.window import (
    JobControl,
    StepPoint,
    Window,
    by_part,
    decision_fields,
    split_batch,
    strategy_seed,
)
from trainguard.agent.metricspec import MetricSpec
from trainguard.agent.ranktable import RankView
from trainguard.agent.wire import Telemetry, WireError

log = logging.getLogger("trainguard.controller")

METRICS: tuple[MetricSpec, ...] = (
    MetricSpec("trainguard_controller_lr_scale", "gauge", "", ("job",),
               "LR multiplier the controller set on the trainer's schedule (plan lr_scale)."),
    MetricSpec("trainguard_controller_batch_size", "gauge", "", ("job",),
               "Global batch in samples per step the controller set (sum of the plan's batch_sizes)."),
    MetricSpec("trainguard_controller_decisions_total", "counter", "", ("job", "strategy"),
               "Controller decisions (keep, change, rollback, world-size rescale), each also an event."),
    MetricSpec("trainguard_controller_noise_scale", "gauge", "", ("job",),
               "Smoothed gradient noise scale B_simple in samples (absent until estimable: needs dp >= 2)."),
    MetricSpec("trainguard_controller_objective", "gauge", "", ("job",),
               "Objective of the last control window: -d log(loss)/d log(training time)."),
)

StrategyFactory = Callable[[ControllerConfig, Space, str], Strategy]


def make_strategy(config: ControllerConfig, space: Space, job: str) -> Strategy:
    if config.strategy == "optuna":
        from trainguard.agent.controller.optuna_strategy import OptunaStrategy

        return OptunaStrategy(config, space, job)
    if config.strategy == "rl":
        from trainguard.agent.controller.bandit import BanditStrategy

        return BanditStrategy(config, space)
    if config.strategy == "goodput":
        from trainguard.agent.controller.goodput import GoodputStrategy

        return GoodputStrategy(config, space)
    return KeepStrategy()



class Controller:
    def __init__(self, config: ControllerConfig, *, strategy_factory: StrategyFactory | None = None,
                 evidence: EvidenceConfig | None = None) -> None:
        self.config = config
        # The sgd preset's thresholds, though the embedded trainer runs AdamW: the adam preset's
        # too-high threshold would fire at the GPT's default LR (docs/controller.md).
        self.evidence_config = evidence or EvidenceConfig()
        """strategy evidence: its pre-registered tests (the shipped ones unless a caller passes others)."""
        self.strategy_factory = strategy_factory or make_strategy
        self.jobs: dict[str, JobControl] = {}
        self._unplanned: set[str] = set()
        """Jobs the evidence strategy cannot control (planned steps unknown), warned about once."""
        self._lock = threading.Lock()

    # --- the tick hook ---------------------------------------------------------------------------
    def tick(self, agent: Any, now: float) -> None:
        snapshot = agent.table.snapshot()
        with self._lock:
            for job in [j for j in self.jobs if j not in snapshot.jobs]:
                self.jobs.pop(job).strategy.close()
            records = agent.supervisor.jobs
            for job, ranks in snapshot.jobs.items():
                if not ranks or (job in records and not records[job].decides_here):
                    continue
                try:
                    self._tick_job(agent, job, ranks)
                except Exception:  # noqa: BLE001 - one job's trouble must not stop the others
                    log.exception("controller failed on job %s", job)

    @staticmethod
    def _attempt(agent: Any, job: str) -> int:
        record = agent.supervisor.jobs.get(job)
        return record.attempt if record is not None else 0

    def _trainer_cfg(self, agent: Any, job: str) -> dict[str, Any]:
        record = agent.supervisor.jobs.get(job)
        trainer = record.spec.trainer if record is not None else None
        return trainer if isinstance(trainer, dict) else {}

    def _live(self, ranks: Any) -> list[RankView]:
        views: list[RankView] = list(ranks.values())
        newest = max(v.last_seen for v in views)
        slack = max(5.0, 20 * max((v.median_step_s or 0.0) for v in views))
        return sorted((v for v in views if v.last_seen >= newest - slack), key=lambda v: v.rank)

    def _reps(self, live: list[RankView]) -> dict[int, RankView]:
        """One rank per dp rank (the lowest global rank): its local_grad_sq is that dp rank's."""
        reps: dict[int, RankView] = {}
        for v in live:
            d = v.dp_rank if v.dp_rank is not None else v.rank
            reps.setdefault(d, v)
        return reps

    def _dp_now(self, agent: Any, job: str, leader: RankView, reps: dict[int, RankView]) -> int:
        """The data-parallel degree the ranks run now: their world size over tp x pp (a rank that
        has not reported yet does not make the world look smaller)."""
        par = self._trainer_cfg(agent, job).get("parallel", {})
        model_parallel = int(par.get("tp", 1)) * int(par.get("pp", 1)) if isinstance(par, dict) else 1
        if leader.world_size:
            return max(1, leader.world_size // max(1, model_parallel))
        return len(reps)

    def _new_job(self, agent: Any, job: str, reps: dict[int, RankView]) -> JobControl:
        trainer = self._trainer_cfg(agent, job)
        par = trainer.get("parallel", {}) if isinstance(trainer.get("parallel"), dict) else {}
        dp = int(par.get("dp") or len(reps))
        unit = int(par.get("microbatches", 1)) if int(par.get("pp", 1)) > 1 else 1
        base = int(trainer.get("global_batch") or sum(v.batch_size for v in reps.values()) or dp)
        space = self._space(base, dp, unit)
        plan = agent.plans.get(job)
        batch = sum(plan.batch_sizes) if plan.batch_sizes and len(plan.batch_sizes) == dp else base
        current = Setting(float(plan.lr_scale), int(batch))
        strategy = self.strategy_factory(replace(self.config, seed=strategy_seed(self.config.seed, job, self._attempt(agent, job))),
                                         space, job)
        return JobControl(job, space, strategy, dp, current, current, NoiseScale(self.config.noise_ema),
                          known_version=plan.version)

    def _space(self, base: int, dp: int, unit: int, lr_high: float | None = None) -> Space:
        low, high = self.config.batch_bounds(base, dp * unit)
        # A ceiling passed in may be above lr_scale_max where the LR guard raised it (to lr_guard_max).
        return Space(base, dp * unit, low, high, self.config.lr_scale_min,
                     min(self.config.guard_ceiling, lr_high) if lr_high else self.config.lr_scale_max)

    def _tick_job(self, agent: Any, job: str, ranks: Any) -> None:
        live = self._live(ranks)
        reps = self._reps(live)
        leader = live[0]
        dp_now = self._dp_now(agent, job, leader, reps)
        jc = self.jobs.get(job)
        if jc is None:
            if leader.world_size and len(live) < leader.world_size:
                # Ranks report one after another at start: a job first seen with one of its two
                # ranks is not a world that grew from 1 to 2 (that would rescale the user's LR).
                return
            jc = self.jobs[job] = self._new_job(agent, job, reps)
        self._sync_external(agent, jc)
        watch_only = self.config.strategy == "none" and self.config.lr_batch_rule != "adascale"
        if watch_only:
            jc.last_step = leader.step  # no per-step reading: the step its events name
        if dp_now != jc.dp and len(reps) == dp_now:
            self._world_changed(agent, jc, reps, leader)
        if watch_only:
            return
        msgs = agent.table.window(job, leader.rank, None)
        if not msgs:
            return
        if msgs[-1].step < jc.last_step:
            self._restarted(jc, msgs[-1].step)
            return
        if self.config.strategy == "evidence":
            self._evidence_tick(agent, jc, msgs)
            return
        others = {d: {m.step: m for m in agent.table.window(job, v.rank, None) if m.step > jc.last_step}
                  for d, v in reps.items() if v.rank != leader.rank}
        horizon = min([leader.step, *(v.step for v in reps.values())])
        for m in msgs:
            if m.step <= jc.last_step or m.step > horizon:
                continue
            for part in by_part(m):
                self._ingest(agent, jc, part, others, leader)

    # --- per step --------------------------------------------------------------------------------
    def _ingest(self, agent: Any, jc: JobControl, m: Telemetry, others: dict[int, dict[int, Telemetry]],
                leader: RankView) -> None:
        jc.last_step = m.step
        if jc.origin is None:
            jc.origin = m.wall_time - m.step * m.step_s
        small = [(m.batch_size, m.local_grad_sq)]
        for by_step in others.values():
            o = by_step.get(m.step)
            if o is not None:
                small.append((o.batch_size, o.local_grad_sq))
        if len(small) == jc.dp and math.isfinite(m.grad_norm):
            jc.noise.update(m.grad_norm**2, small)
        samples = sum(b for b, _ in small) if len(small) == jc.dp else jc.current.batch
        point = StepPoint(m.step, max(1e-6, m.wall_time - jc.origin), m.loss, samples * m.steps, m.plan_version,
                          m.step_s, m.comm_s + m.opt_s, (m.fwd_bwd_s + m.data_s) / max(1, m.batch_size), m.steps)
        if self.config.strategy == "none":
            return
        w = jc.window
        if w is None:
            if math.isfinite(m.loss):
                jc.recent.append(m.loss)
            # The guard looks at the second half of the warm-up already (the first steps of any
            # run agree with each other whatever the LR), so a bad LR is raised at its end.
            if m.update_cos is not None and math.isfinite(m.update_cos) and m.step > self.config.warmup_steps // 2:
                jc.warmup_aligns.append(m.update_cos)
            if m.step >= self.config.warmup_steps:
                aligns, jc.warmup_aligns = jc.warmup_aligns, []  # looked at once
                if not self._guard(agent, jc, aligns, None):
                    self._decide(agent, jc, None)
            return
        if m.plan_version < w.version:
            # The change is not applied yet: the ranks still run the previous setting, whose loss
            # is the reference the next change is judged against (a plan takes up to ~0.6 s to
            # reach the ranks, hundreds of short steps: without these the reference would be the
            # losses of long ago, from before the loss fell).
            if math.isfinite(m.loss):
                jc.recent.append(m.loss)
            return
        w.points.append(point)
        if m.update_cos is not None and math.isfinite(m.update_cos):
            w.aligns.append(m.update_cos)
        if self._diverged(w):
            self._rollback(agent, jc, w)
            return
        if math.isfinite(m.loss):
            jc.recent.append(m.loss)
        # Counted in steps, not messages; three points at least for the loss fit (gathered steps).
        if sum(p.steps for p in w.points) >= self.config.every_steps and len(w.points) >= 3:
            result = self._result(jc, w, diverged=False)
            jc.window = None
            if result is not None:
                jc.objective = result.objective
                if not w.recovery and not w.guarded:
                    jc.strategy.observe(result)
                if not w.recovery:
                    jc.good = w.setting
            if w.recovery or not self._guard(agent, jc, w.aligns, result):
                self._decide(agent, jc, result)

    def _diverged(self, w: Window) -> bool:
        last = w.points[-1].loss
        if not math.isfinite(last):
            return True
        if w.ref_loss is None or len(w.points) < 3:
            return False
        return statistics.median(p.loss for p in w.points[-3:]) > self.config.divergence_factor * w.ref_loss

    def _result(self, jc: JobControl, w: Window, *, diverged: bool) -> WindowResult | None:
        pts = w.points
        if not pts:
            return None
        fit = loglog_slope([p.elapsed for p in pts], [p.loss for p in pts])
        objective, l0, l1 = fit if fit is not None else (float("nan"), float("nan"), float("nan"))
        return WindowResult(
            setting=w.setting, start_step=pts[0].step, end_step=pts[-1].step,
            seconds=pts[-1].elapsed - pts[0].elapsed + pts[0].step_s, samples=sum(p.samples for p in pts),
            loss_start=l0, loss_end=l1, objective=objective, elapsed=pts[-1].elapsed,
            step_s=statistics.median(p.step_s for p in pts), fixed_s=statistics.median(p.fixed_s for p in pts),
            per_sample_s=statistics.median(p.per_sample_s for p in pts), dp=jc.dp,
            noise_scale=jc.noise.value, diverged=diverged)

    # --- decisions -------------------------------------------------------------------------------
    def _decide(self, agent: Any, jc: JobControl, result: WindowResult | None) -> None:
        proposal = jc.strategy.propose(jc.current, result)
        target = jc.space.clamp(proposal.setting)
        reason = proposal.reason
        if target != proposal.setting:
            reason += f" (clamped to bounds: {target.describe()})"
        self._apply(agent, jc, target, reason, "controller_decision", decision_fields(result, proposal.inputs))

    def _guard(self, agent: Any, jc: JobControl, aligns: list[float], result: WindowResult | None) -> bool:
        """The LR guard: a window whose gradients kept agreeing with the previous update ran at an
        LR that is too low (the hypergradient's sign, trainguard.run.alignment); raise it, whatever the
        strategy would do, and move the strategy's LR range up with it, so that exploring does not
        undo what the evidence showed. True when it acted."""
        cfg = self.config
        if not cfg.lr_guard or len(aligns) < max(10, cfg.every_steps // 2):
            return False
        mean = statistics.fmean(aligns)
        se = statistics.stdev(aligns) / math.sqrt(len(aligns))
        if mean <= cfg.lr_guard_threshold or mean < 3 * se:
            return False
        factor = 4.0 if mean > 2 * cfg.lr_guard_threshold else 2.0
        lr = min(cfg.guard_ceiling, jc.current.lr_scale * factor)
        if lr <= jc.current.lr_scale * (1 + 1e-9):
            return False  # already at the guard's ceiling: the strategy goes on
        space = jc.space
        self._set_space(jc, replace(space, lr_low=min(lr, space.lr_low * factor),
                                    lr_high=min(cfg.guard_ceiling, max(lr, space.lr_high * factor))))
        reason = (f"LR too low: the window's gradients kept agreeing with the previous update (mean update_cos "
                  f"{mean:+.3f} +- {se:.3f} over {len(aligns)} steps, threshold {cfg.lr_guard_threshold:g}); "
                  f"LR x{factor:g}")
        inputs = {"update_cos_mean": mean, "update_cos_se": se, "steps": len(aligns)}
        self._apply(agent, jc, Setting(lr, jc.current.batch), reason, "controller_decision",
                    decision_fields(result, inputs), guarded=True)
        return True

    def _apply(self, agent: Any, jc: JobControl, target: Setting, reason: str, kind: str,
               fields: dict[str, Any], *, recovery: bool = False, guarded: bool = False,
               severity: str = "info") -> None:
        before = jc.current
        version = agent.plans.get(jc.job).version
        changes: dict[str, Any] = {}
        if not math.isclose(target.lr_scale, before.lr_scale, rel_tol=1e-9):
            changes["lr_scale"] = float(target.lr_scale)
        plan = agent.plans.get(jc.job)
        if target.batch != before.batch or (plan.batch_sizes is not None and len(plan.batch_sizes) != jc.dp):
            weights = plan.batch_sizes if plan.batch_sizes and len(plan.batch_sizes) == jc.dp else None
            changes["batch_sizes"] = split_batch(target.batch, jc.dp, jc.space.quantum // jc.dp, weights)
        if changes:
            try:
                version = agent.plans.update(jc.job, {**changes, "reason": f"controller: {reason}"[:500]}).version
            except WireError as exc:
                agent.events.emit("controller_error", f"controller could not publish a plan for {jc.job}: {exc}",
                                  severity="error", cause=str(exc), job=jc.job)
                return
            jc.current = target
        jc.known_version = max(jc.known_version, version)
        step = jc.last_step
        jc.decisions += 1
        noise = jc.noise.value
        verb = "keeps" if not changes else "sets"
        message = f"controller ({self.config.strategy}) {verb} {target.describe()} at step {step}: {reason}"
        agent.events.emit(kind, message, severity=severity, cause=reason, job=jc.job, strategy=self.config.strategy,
                          step=step, changed=bool(changes), plan_version=version,
                          lr_scale_from=before.lr_scale, lr_scale_to=target.lr_scale,
                          batch_from=before.batch, batch_to=target.batch, noise_scale=noise, **fields)
        jc.history.append({"step": step, "kind": kind, "lr_scale": target.lr_scale, "batch": target.batch,
                           "changed": bool(changes), "reason": reason, "plan_version": version})
        ref = statistics.median(jc.recent) if len(jc.recent) >= 3 else None
        jc.window = Window(target, version, ref, recovery=recovery, guarded=guarded)

    def _rollback(self, agent: Any, jc: JobControl, w: Window, external: str = "") -> None:
        bad = w.setting
        result = self._result(jc, w, diverged=True)
        if not w.recovery:
            jc.strategy.observe(result if result is not None else self._empty_result(jc, w))
        last = w.points[-1].loss if w.points else float("nan")
        if external:
            reason = f"recovery rolled the job back under {bad.describe()} ({external})"
        else:
            reason = (f"loss diverged under {bad.describe()}: {last:.4g} vs "
                      f"{w.ref_loss if w.ref_loss else float('nan'):.4g} before the change "
                      f"(factor {self.config.divergence_factor:g})")
        # The job's LR ceiling drops between the diverged LR and its cut, so no strategy goes back.
        ceiling = max(self.config.lr_scale_min, bad.lr_scale * math.sqrt(self.config.lr_cut))
        space = self._space(jc.space.base_batch, jc.dp, jc.space.quantum // jc.dp, min(jc.space.lr_high, ceiling))
        self._set_space(jc, space)
        good = jc.good
        target = space.clamp(Setting(min(good.lr_scale, bad.lr_scale) * self.config.lr_cut, good.batch))
        restored = False
        rollback = agent.rollback
        if external:
            restored = True  # the recovery service already restarted the job from a checkpoint
        elif rollback is not None:
            try:
                # Back to a checkpoint from before the change.
                rollback(jc.job, reason, before_step=w.points[0].step if w.points else None)
                restored = True
            except Exception as exc:  # noqa: BLE001 - the LR cut below still happens
                log.warning("agent rollback for %s failed: %s", jc.job, exc)
        jc.recent.clear()
        self._apply(agent, jc, target, reason, "controller_rollback",
                    {"window": [w.points[0].step, w.points[-1].step] if w.points else None,
                     "loss": last, "ref_loss": w.ref_loss,
                     "checkpoint_restored": restored, "lr_ceiling": space.lr_high},
                    recovery=True, severity="warning")
        jc.good = jc.current

    def _empty_result(self, jc: JobControl, w: Window) -> WindowResult:
        nan = float("nan")
        return WindowResult(w.setting, jc.last_step, jc.last_step, 0.0, 0, nan, nan, nan, 0.0, nan, nan, nan,
                            jc.dp, jc.noise.value, diverged=True)

    def _set_space(self, jc: JobControl, space: Space) -> None:
        jc.space = space
        if hasattr(jc.strategy, "space"):
            jc.strategy.space = space

    def _world_changed(self, agent: Any, jc: JobControl, reps: dict[int, RankView], leader: RankView) -> None:
        new_dp = len(reps)
        if any(v.step < leader.step - 2 for v in reps.values()):
            return  # not every new rank has reported yet
        old_dp, old_batch = jc.dp, jc.current.batch
        new_batch = sum(v.batch_size for v in reps.values())
        if new_batch <= 0:
            return
        jc.dp = new_dp
        space = self._space(jc.space.base_batch, new_dp, jc.space.quantum // old_dp, jc.space.lr_high)
        self._set_space(jc, space)
        factor, how = follow_batch(self.config.lr_batch_rule, old_batch, new_batch, jc.noise.value)
        jc.noise = NoiseScale(self.config.noise_ema)
        jc.current = Setting(jc.current.lr_scale, new_batch)
        # The rule's result stays inside the safety bounds, which a strategy could not leave either.
        lr = min(space.lr_high, max(space.lr_low, jc.current.lr_scale * factor))
        target = Setting(lr, new_batch)
        reason = f"world size changed: dp {old_dp} -> {new_dp}, global batch {old_batch} -> {new_batch}; {how}"
        # Re-split for the new dp as well: a plan's batch_sizes of the old length no longer fit.
        self._apply(agent, jc, target, reason, "controller_lr_rescale",
                    {"dp_from": old_dp, "dp_to": new_dp, "rule": self.config.lr_batch_rule, "factor": factor},
                    recovery=True)
        jc.good = jc.current

    def _sync_external(self, agent: Any, jc: JobControl) -> None:
        """Take in plan changes made by others (a healer's rollback LR cut, a rank exclusion that
        dropped batch_sizes, an operator through the API). A shard migration keeps the sum."""
        plan = agent.plans.get(jc.job)
        if plan.version <= jc.known_version:
            return
        changes = agent.plans.changes_since(jc.job, jc.known_version)
        rollback = next((p for p in changes if p.reason.startswith("rollback")), None)
        jc.known_version = plan.version
        sizes = plan.batch_sizes
        batch = sum(sizes) if sizes and len(sizes) == jc.dp else (jc.current.batch if sizes else jc.space.base_batch)
        now = Setting(float(plan.lr_scale), int(batch))
        w = jc.window
        if rollback is not None and w is not None and not w.recovery and w.setting != jc.good:
            # The recovery service saw the loss diverge first, under a setting of ours: that is our
            # divergence too (penalise it, return to the last good setting with the LR cut). It may
            # already be superseded by a later plan (a shard migration): look at every version since.
            self._rollback(agent, jc, w, external=rollback.reason)
            return
        if now == jc.current:
            return
        log.info("job %s: plan changed outside the controller: %s -> %s", jc.job, jc.current, now)
        jc.current = jc.good = now
        if jc.window is not None:
            jc.window = Window(now, plan.version, None, recovery=True)

    def _restarted(self, jc: JobControl, step: int) -> None:
        """The ranks went back to an earlier step (restored from a checkpoint): the window is void."""
        jc.last_step = step
        if jc.evidence is not None:
            jc.evidence.restarted()
        jc.recent.clear()
        if jc.window is not None:
            jc.window = Window(jc.window.setting, jc.window.version, None, recovery=True)

    # --- strategy evidence -----------------------------------------------------------------------
    def _evidence_tick(self, agent: Any, jc: JobControl, msgs: list[Telemetry]) -> None:
        """Feed the leader's steps to the job's evidence controller and publish what it decides.
        The leader's message carries the trajectory cosine (the same on every rank after the
        step's all-reduce); the loss is already the global one."""
        if jc.evidence is None and not self._evidence_start(agent, jc):
            jc.last_step = msgs[-1].step
            return
        driver = jc.evidence
        assert driver is not None
        for m in msgs:
            if m.step <= jc.last_step:
                continue
            jc.last_step = m.step
            for part in by_part(m):
                loss = part.loss if part.has_loss else None
                action = driver.ingest(part.step, part.steps, part.plan_version, loss, m.traj_cos)
                if action is not None:
                    self._evidence_act(agent, jc, driver, action)

    def _evidence_start(self, agent: Any, jc: JobControl) -> bool:
        steps = self.config.planned_steps or int(self._trainer_cfg(agent, jc.job).get("steps") or 0)
        if steps <= 0:
            if jc.job not in self._unplanned:
                self._unplanned.add(jc.job)  # said once
                agent.events.emit("controller_error", f"controller (evidence) watches {jc.job} only: its planned "
                                  "steps are unknown (set controller.planned_steps)", severity="warning", job=jc.job)
            return False
        driver = EvidenceDriver(steps, self.evidence_config, lr_scale=jc.current.lr_scale)
        plan = agent.plans.get(jc.job)
        try:
            version = agent.plans.update(jc.job, {"extra": {**plan.extra, "evidence": driver.request()},
                                                  "reason": "controller: evidence controller measures the "
                                                            "trajectory cosine"}).version
        except WireError as exc:
            agent.events.emit("controller_error", f"controller could not publish a plan for {jc.job}: {exc}",
                              severity="error", cause=str(exc), job=jc.job)
            return False
        jc.known_version = version
        jc.evidence = driver
        return True

    def _evidence_act(self, agent: Any, jc: JobControl, driver: EvidenceDriver, action: Action) -> None:
        before = jc.current
        plan = agent.plans.get(jc.job)
        changes = driver.plan_changes(action, plan.extra)
        version = plan.version
        if changes is not None:
            try:
                version = agent.plans.update(jc.job, {**changes, "reason": f"controller: {action.reason}"[:500]}).version
            except WireError as exc:
                agent.events.emit("controller_error", f"controller could not publish a plan for {jc.job}: {exc}",
                                  severity="error", cause=str(exc), job=jc.job)
                return
            driver.published(action, version)
            jc.known_version = version
            jc.current = Setting(action.lr_scale, before.batch)
        jc.decisions += 1
        kind = "controller_rollback" if action.kind == "restore" else "controller_decision"
        message = (f"controller (evidence) {action.kind}: lr x{before.lr_scale:.3g} -> x{jc.current.lr_scale:.3g} "
                   f"at step {jc.last_step}: {action.reason}")
        agent.events.emit(kind, message, severity="warning" if action.kind == "restore" else "info",
                          cause=action.reason, job=jc.job, strategy="evidence", step=jc.last_step,
                          changed=changes is not None, plan_version=version, action=action.kind,
                          trajectory_step=action.step, lr_scale_from=before.lr_scale,
                          lr_scale_to=jc.current.lr_scale, batch_from=before.batch, batch_to=before.batch,
                          inputs=event_inputs(action), snapshot=driver.snapshots, restore=driver.restores)
        jc.history.append({"step": jc.last_step, "kind": kind, "lr_scale": jc.current.lr_scale,
                           "batch": before.batch, "changed": changes is not None, "reason": action.reason,
                           "plan_version": version})

    # --- reporting -------------------------------------------------------------------------------
    def history(self, job: str) -> list[dict[str, Any]]:
        with self._lock:
            jc = self.jobs.get(job)
            return list(jc.history) if jc else []

    def metrics(self) -> Iterator[Metric]:
        spec = {s.name: s for s in METRICS}
        lr = spec["trainguard_controller_lr_scale"].gauge()
        batch = spec["trainguard_controller_batch_size"].gauge()
        decisions = spec["trainguard_controller_decisions_total"].counter()
        noise = spec["trainguard_controller_noise_scale"].gauge()
        objective = spec["trainguard_controller_objective"].gauge()
        with self._lock:
            for job, jc in self.jobs.items():
                lr.add_metric([job], jc.current.lr_scale)
                batch.add_metric([job], jc.current.batch)
                decisions.add_metric([job, self.config.strategy], jc.decisions)
                value = jc.noise.value
                if value is not None:
                    noise.add_metric([job], value)
                if jc.objective is not None and math.isfinite(jc.objective):
                    objective.add_metric([job], jc.objective)
        yield from (lr, batch, decisions, noise, objective)

    def forget(self, job: str) -> None:
        """A finished job leaves the controller's state and metrics with the rest of the agent's."""
        with self._lock:
            jc = self.jobs.pop(job, None)
        if jc is not None:
            jc.strategy.close()

    def close(self) -> None:
        with self._lock:
            for jc in self.jobs.values():
                jc.strategy.close()
            self.jobs.clear()


def install(agent: Any, config: ControllerConfig, *, strategy_factory: StrategyFactory | None = None,
            evidence: EvidenceConfig | None = None) -> Controller:
    """A controller for a started agent, as its tick hook and a metric source (the agent keeps it
    as its declared ``controller``)."""
    controller = Controller(config, strategy_factory=strategy_factory, evidence=evidence)
    agent.tick_hooks.append(controller.tick)
    agent.exporter.sources.append(controller)
    return controller


__all__ = ["Controller", "ControllerConfig", "METRICS", "Proposal", "install", "make_strategy"]
