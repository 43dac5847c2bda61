"""Controller mechanics against a simulated job: the real RankTable, PlanStore, EventLog and
PlanWatcher, with ranks simulated in-process (fast, deterministic): warm-up, window bookkeeping,
divergence rollback + LR cut, world-size rescale, metrics, and no torch in the agent."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client.core import CollectorRegistry

from trainguard.agent.controller import (
    METRICS,
    ControllerConfig,
    Proposal,
    Setting,
    Space,
    WindowResult,
    install,
)
from trainguard.agent.eventlog import EventLog
from trainguard.agent.lifecycle.plans import PlanStore
from trainguard.agent.metricspec import index
from trainguard.agent.ranktable import RankTable
from trainguard.agent.wire import Telemetry
from trainguard.run.link import PlanWatcher

JOB = "sim"


class SimJob:
    """dp ranks that take the plan at a step boundary like trainer/train.py (rank 0 polls during
    step s, every rank applies it from step s+1) and report telemetry into the agent's table."""

    def __init__(self, plans: PlanStore, table: RankTable, dp: int = 2, batch: int = 8) -> None:
        self.watcher = PlanWatcher(plans.path(JOB))
        self.table = table
        self.dp = dp
        self.base = batch
        self.sizes = [batch // dp] * dp
        self.version = 0
        self.lr_scale = 1.0
        self.step = 0
        self.progress = 0.0
        self.loss = 3.0
        self.wall = 1000.0
        self.pending: Any = None
        self.applied: dict[int, tuple[int, float, list[int]]] = {}
        self.align: Any = None
        """lr_scale -> the update_cos the ranks report (None: they report none)."""

    def set_dp(self, dp: int) -> None:
        """A rank is gone: the restarted job keeps the per-rank batch (memory-bound)."""
        per_rank = self.sizes[0]
        self.dp = dp
        self.sizes = [per_rank] * dp

    def run(self, steps: int, agent: Any, controller: Any) -> None:
        for _ in range(steps):
            if self.pending is not None:
                plan, self.pending = self.pending, None
                self.version, self.lr_scale = plan.version, plan.lr_scale
                if plan.batch_sizes and len(plan.batch_sizes) == self.dp:
                    self.sizes = list(plan.batch_sizes)
            self.step += 1
            total = sum(self.sizes)
            if self.lr_scale > 4:
                self.loss *= 1.3  # too hot: diverges
            else:
                self.progress += 0.02 * self.lr_scale * math.sqrt(total / self.base)
                self.loss = 1.0 + 2.0 * math.exp(-self.progress)
            step_s = 0.01 + 0.001 * total / self.dp
            self.wall += step_s
            g2, s = 1.0, 32.0  # expected norms: |G|^2 + S / b
            for d in range(self.dp):
                b = self.sizes[d]
                self.table.add(Telemetry(
                    job=JOB, rank=d, local_rank=d, pid=100 + d, step=self.step, wall_time=self.wall, step_s=step_s,
                    data_s=0.0, fwd_bwd_s=0.001 * b, comm_s=0.005, opt_s=0.005, samples=b, tokens=b * 32,
                    loss=self.loss, grad_norm=math.sqrt(g2 + s / total), local_grad_sq=g2 + s / b,
                    lr=1e-3 * self.lr_scale, batch_size=b, mem_bytes=1, plan_version=self.version,
                    dp_rank=d, world_size=self.dp,
                    update_cos=self.align(self.lr_scale, self.step) if self.align else None))
            self.applied[self.step] = (self.version, self.lr_scale, list(self.sizes))
            polled = self.watcher.poll()
            if polled.version != self.version:
                self.pending = polled
            controller.tick(agent, self.wall)


class Scripted:
    """A strategy that proposes a fixed sequence of settings (then keeps the last)."""

    name = "scripted"

    def __init__(self, plan: list[Setting]) -> None:
        self.plan = plan
        self.observed: list[WindowResult] = []
        self.space: Space | None = None

    def propose(self, current: Setting, last: WindowResult | None) -> Proposal:
        target = self.plan.pop(0) if self.plan else current
        return Proposal(target, f"scripted {target.describe()}")

    def observe(self, result: WindowResult) -> None:
        self.observed.append(result)

    def close(self) -> None:
        return None


def make_agent(tmp_path: Path, **trainer: Any) -> SimpleNamespace:
    cfg = {"global_batch": 8, "parallel": {"dp": 2, "tp": 1, "pp": 1}, **trainer}
    record = SimpleNamespace(spec=SimpleNamespace(trainer=cfg), decides_here=True, attempt=0)
    return SimpleNamespace(
        table=RankTable(), plans=PlanStore(str(tmp_path / "plans")), events=EventLog(str(tmp_path / "events"), "n1"),
        supervisor=SimpleNamespace(jobs={JOB: record}), tick_hooks=[], rollback=None,
        exporter=SimpleNamespace(sources=[]))


def events(agent: SimpleNamespace, kind: str) -> list[dict[str, Any]]:
    """Events of one kind, their fields flattened beside kind/cause/severity."""
    return [{**e, **e.get("fields", {})} for e in agent.events.since(0, 10_000) if e["kind"] == kind]


def test_warmup_window_and_change_applied_from_the_plan_version_step(tmp_path: Path) -> None:
    agent = make_agent(tmp_path)
    strat = Scripted([Setting(1.0, 8), Setting(2.0, 16)])
    cfg = ControllerConfig(strategy="optuna", every_steps=10, warmup_steps=20)
    ctl = install(agent, cfg, strategy_factory=lambda c, s, j: strat)
    assert agent.tick_hooks == [ctl.tick] and agent.exporter.sources == [ctl]
    sim = SimJob(agent.plans, agent.table)
    sim.run(19, agent, ctl)
    assert events(agent, "controller_decision") == []  # warm-up: nothing decided
    sim.run(40, agent, ctl)
    decisions = events(agent, "controller_decision")
    assert [d["changed"] for d in decisions[:2]] == [False, True]
    change = decisions[1]
    assert change["lr_scale_to"] == 2.0 and change["batch_to"] == 16 and change["cause"].startswith("scripted")
    assert agent.plans.get(JOB).batch_sizes == [8, 8]
    # The first window was scored over exactly every_steps steps; the change's window starts at
    # the first step run under its plan version.
    first = strat.observed[0]
    assert first.end_step - first.start_step + 1 == 10 and first.objective > 0
    second = strat.observed[1]
    v = change["plan_version"]
    assert sim.applied[second.start_step][0] == v and sim.applied[second.start_step - 1][0] < v
    assert sim.applied[second.start_step][1:] == (2.0, [8, 8])
    assert second.setting == Setting(2.0, 16)


def test_divergence_rolls_back_and_cuts_lr(tmp_path: Path) -> None:
    agent = make_agent(tmp_path)
    calls: list[tuple[str, str]] = []
    agent.rollback = lambda job, reason, before_step=None: calls.append((job, reason))
    strat = Scripted([Setting(1.0, 8), Setting(8.0, 8)])
    cfg = ControllerConfig(strategy="rl", every_steps=10, warmup_steps=10, lr_scale_max=16.0)
    ctl = install(agent, cfg, strategy_factory=lambda c, s, j: strat)
    sim = SimJob(agent.plans, agent.table)
    sim.run(45, agent, ctl)
    rollbacks = events(agent, "controller_rollback")
    assert len(rollbacks) == 1, rollbacks
    rb = rollbacks[0]
    assert "diverged" in rb["cause"] and rb["severity"] == "warning" and rb["checkpoint_restored"] is True
    assert calls and calls[0][0] == JOB
    # Back to the last good setting (lr x1, batch 8) with the LR cut by lr_cut.
    assert agent.plans.get(JOB).lr_scale == 0.5 and ctl.jobs[JOB].current == Setting(0.5, 8)
    assert [o.setting.lr_scale for o in strat.observed if o.diverged] == [8.0]
    # The job's LR ceiling dropped below the diverged LR, so a strategy cannot go straight back.
    assert math.isclose(ctl.jobs[JOB].space.lr_high, 8.0 * math.sqrt(0.5))
    strat.plan = [Setting(16.0, 8)]
    sim.run(12, agent, ctl)
    assert math.isclose(ctl.jobs[JOB].current.lr_scale, 8.0 * math.sqrt(0.5))
    assert "clamped" in events(agent, "controller_decision")[-1]["cause"]


def test_recovery_rollback_superseded_by_a_migration_is_still_taken_in(tmp_path: Path) -> None:
    """The recovery service rolls back under the controller's setting and a shard migration
    publishes the next plan version before the controller's next tick: the controller must still
    treat it as its own divergence (it once saw only the newest version's reason)."""
    agent = make_agent(tmp_path)
    strat = Scripted([Setting(1.0, 8), Setting(3.0, 8)])
    cfg = ControllerConfig(strategy="rl", every_steps=10, warmup_steps=10, lr_scale_max=16.0)
    ctl = install(agent, cfg, strategy_factory=lambda c, s, j: strat)
    sim = SimJob(agent.plans, agent.table)
    sim.run(25, agent, ctl)
    assert ctl.jobs[JOB].current == Setting(3.0, 8) and not events(agent, "controller_rollback")
    agent.plans.update(JOB, {"lr_scale": 1.5, "reason": "rollback: loss 9.1 at step 25 is 3x the recent median"})
    agent.plans.update(JOB, {"batch_sizes": [5, 3], "reason": "migrate: away from straggler rank(s) [1]"})
    sim.run(2, agent, ctl)
    rollbacks = events(agent, "controller_rollback")
    assert len(rollbacks) == 1 and rollbacks[0]["cause"].startswith("recovery rolled the job back"), rollbacks
    assert [o.setting.lr_scale for o in strat.observed if o.diverged] == [3.0]


def test_world_size_change_rescales_lr_for_the_new_global_batch(tmp_path: Path) -> None:
    agent = make_agent(tmp_path)
    strat = Scripted([Setting(1.0, 16)])
    ctl = install(agent, ControllerConfig(strategy="rl", every_steps=10, warmup_steps=10),
                  strategy_factory=lambda c, s, j: strat)
    sim = SimJob(agent.plans, agent.table)
    sim.run(25, agent, ctl)
    assert sim.sizes == [8, 8]
    agent.table.forget_job(JOB)  # the job restarted without rank 1
    sim.set_dp(1)
    sim.run(5, agent, ctl)
    rescale = [e for e in events(agent, "controller_lr_rescale") if e.get("dp_to") == 1]
    assert len(rescale) == 1
    assert "world size changed: dp 2 -> 1, global batch 16 -> 8; sqrt: LR x sqrt(8/16)" in rescale[0]["cause"]
    assert rescale[0]["rule"] == "sqrt" and math.isclose(rescale[0]["factor"], math.sqrt(0.5))
    plan = agent.plans.get(JOB)
    # LR rescaled by sqrt(8/16); the per-rank split republished for one dp rank.
    assert math.isclose(plan.lr_scale, math.sqrt(0.5)) and plan.batch_sizes == [8]
    sim.run(3, agent, ctl)
    assert sim.applied[sim.step][1:] == (math.sqrt(0.5), [8])


@pytest.mark.parametrize(("rule", "factor"), [("sqrt", math.sqrt(0.5)), ("linear", 0.5), ("none", 1.0)])
def test_lr_follows_the_global_batch_with_no_strategy_on(tmp_path: Path, rule: str, factor: float) -> None:
    """strategy none still rescales the LR when a shrink changes the global batch (a script with a
    fixed per-rank batch), by the configured rule, and says so; the rejoin undoes it."""
    agent = make_agent(tmp_path, global_batch=16)
    ctl = install(agent, ControllerConfig(strategy="none", lr_batch_rule=rule))
    sim = SimJob(agent.plans, agent.table, batch=16)
    sim.run(150, agent, ctl)
    assert agent.plans.get(JOB).version == 0  # nothing else changes under strategy none
    agent.table.forget_job(JOB)
    sim.set_dp(1)
    sim.run(5, agent, ctl)
    rescale = events(agent, "controller_lr_rescale")
    assert len(rescale) == 1 and rescale[0]["rule"] == rule and math.isclose(rescale[0]["factor"], factor)
    assert "dp 2 -> 1, global batch 16 -> 8" in rescale[0]["cause"] and rescale[0]["changed"] is (rule != "none")
    assert math.isclose(agent.plans.get(JOB).lr_scale, factor)
    sim.run(3, agent, ctl)
    assert math.isclose(sim.lr_scale, factor)  # the ranks run it
    agent.table.forget_job(JOB)
    sim.set_dp(2)
    sim.run(5, agent, ctl)
    back = events(agent, "controller_lr_rescale")[-1]
    assert "dp 1 -> 2, global batch 8 -> 16" in back["cause"]
    assert math.isclose(agent.plans.get(JOB).lr_scale, 1.0)


@pytest.mark.parametrize("dp_ranks", [[0, 1], [0, 0, 1, 1]], ids=["dp2", "dp2-of-4-ranks"])
def test_ranks_reporting_one_after_another_at_start_are_no_world_change(tmp_path: Path, dp_ranks: list[int]) -> None:
    """A user's script (no trainer config) whose rank 0 reports before the others: the controller
    waits for the whole world instead of taking dp 1 -> 2 for a grown job and rescaling the user's
    LR; with two ranks per replica (``dp_size`` 2 of 4 ranks) it still takes the job in."""
    agent = make_agent(tmp_path)
    agent.supervisor.jobs[JOB].spec.trainer = None
    ctl = install(agent, ControllerConfig(strategy="none"))
    wall = 1000.0
    for step in range(1, 40):
        wall += 0.05
        for rank in range(len(dp_ranks)) if step > 10 else (0,):
            agent.table.add(Telemetry(
                job=JOB, rank=rank, local_rank=rank, pid=100 + rank, step=step, wall_time=wall, step_s=0.05,
                data_s=0.0, fwd_bwd_s=0.04, comm_s=0.005, opt_s=0.005, samples=4, tokens=128, loss=2.0,
                grad_norm=1.0, local_grad_sq=1.0, lr=1e-3, batch_size=4, mem_bytes=1, plan_version=0,
                dp_rank=dp_ranks[rank], world_size=len(dp_ranks)))
        ctl.tick(agent, wall)
    assert events(agent, "controller_lr_rescale") == []
    assert agent.plans.get(JOB).lr_scale == 1.0 and agent.plans.get(JOB).version == 0
    assert ctl.jobs[JOB].dp == 2 and ctl.jobs[JOB].current.batch == 8


def test_a_forgotten_job_leaves_the_controller_and_its_metrics(tmp_path: Path) -> None:
    agent = make_agent(tmp_path)
    ctl = install(agent, ControllerConfig(strategy="none"))
    SimJob(agent.plans, agent.table).run(5, agent, ctl)
    assert any(s.labels.get("job") == JOB for fam in ctl.metrics() for s in fam.samples)
    ctl.forget(JOB)
    assert JOB not in ctl.jobs
    assert not any(s.labels.get("job") == JOB for fam in ctl.metrics() for s in fam.samples)


def test_a_shrink_that_keeps_the_global_batch_keeps_the_lr(tmp_path: Path) -> None:
    """The embedded trainer keeps the global batch on a shrink (uneven shares): the event says so
    and the LR stays."""
    agent = make_agent(tmp_path, global_batch=8, parallel={"dp": 4, "tp": 1, "pp": 1})
    ctl = install(agent, ControllerConfig(strategy="none"))
    sim = SimJob(agent.plans, agent.table, dp=4, batch=8)
    sim.run(20, agent, ctl)
    agent.table.forget_job(JOB)
    sim.dp, sim.sizes = 3, [3, 3, 2]
    sim.run(5, agent, ctl)
    rescale = events(agent, "controller_lr_rescale")
    assert len(rescale) == 1 and rescale[0]["changed"] is False and "global batch unchanged (8)" in rescale[0]["cause"]
    assert agent.plans.get(JOB).lr_scale == 1.0


def test_adascale_rule_uses_the_measured_noise_scale(tmp_path: Path) -> None:
    agent = make_agent(tmp_path, global_batch=16)
    ctl = install(agent, ControllerConfig(strategy="none", lr_batch_rule="adascale"))
    sim = SimJob(agent.plans, agent.table, batch=16)
    sim.run(60, agent, ctl)
    noise = ctl.jobs[JOB].noise.value
    assert noise is not None and 20 < noise < 50  # the simulated ranks' S / |G|^2 is 32
    agent.table.forget_job(JOB)
    sim.set_dp(1)
    sim.run(5, agent, ctl)
    rescale = events(agent, "controller_lr_rescale")[-1]
    assert rescale["cause"].count("adascale:") == 1
    assert math.isclose(rescale["factor"], (1 + noise / 16) / (1 + noise / 8))


def test_lr_guard_raises_an_lr_whose_updates_keep_agreeing(tmp_path: Path) -> None:
    """Gradients that keep agreeing with the previous update (update_cos clearly > 0) mean the LR
    is too low: the guard raises it past lr_scale_max (up to lr_guard_max), whatever the strategy
    proposes, and the strategy does not learn from a window it did not choose."""
    agent = make_agent(tmp_path)
    strat = Scripted([])  # would keep the current setting forever
    cfg = ControllerConfig(strategy="rl", every_steps=10, warmup_steps=10, lr_scale_max=1.0, lr_guard_max=8.0)
    ctl = install(agent, cfg, strategy_factory=lambda c, s, j: strat)
    sim = SimJob(agent.plans, agent.table)
    # Too low below x3 (strongly so below x1.5), then the mean is 0; a little noise step by step.
    sim.align = lambda lr, step: (0.15 if lr < 1.5 else 0.07 if lr < 3 else 0.0) + 0.01 * ((step % 3) - 1)
    sim.run(60, agent, ctl)
    guarded = [e for e in events(agent, "controller_decision") if e["cause"].startswith("LR too low")]
    assert [e["lr_scale_to"] for e in guarded] == [4.0], guarded  # x4 at mean 0.15 (> 2x the threshold)
    assert guarded[0]["inputs"]["update_cos_mean"] > 0.1 and guarded[0]["changed"] is True
    assert agent.plans.get(JOB).lr_scale == 4.0 and ctl.jobs[JOB].space.lr_high == 4.0
    observed = [o.setting.lr_scale for o in strat.observed]
    assert observed and 4.0 not in observed[:1] and observed.count(1.0) == 1  # the guarded window: not the strategy's
    sim.run(40, agent, ctl)
    assert agent.plans.get(JOB).lr_scale == 4.0  # at x4 the updates no longer agree: it stays


def test_lr_guard_leaves_an_lr_whose_updates_do_not_agree(tmp_path: Path) -> None:
    agent = make_agent(tmp_path)
    ctl = install(agent, ControllerConfig(strategy="rl", every_steps=10, warmup_steps=10),
                  strategy_factory=lambda c, s, j: Scripted([]))
    sim = SimJob(agent.plans, agent.table)
    sim.align = lambda lr, step: 0.02 + 0.05 * ((step % 3) - 1)  # small and noisy: not evidence
    sim.run(80, agent, ctl)
    assert not [e for e in events(agent, "controller_decision") if e["cause"].startswith("LR too low")]
    assert agent.plans.get(JOB).lr_scale == 1.0
    # Switched off, even strong agreement changes nothing.
    agent = make_agent(tmp_path / "off")
    off = install(agent, ControllerConfig(strategy="rl", every_steps=10, warmup_steps=10, lr_guard=False),
                  strategy_factory=lambda c, s, j: Scripted([]))
    sim = SimJob(agent.plans, agent.table)
    sim.align = lambda lr, step: 0.3 + 0.01 * ((step % 3) - 1)
    sim.run(60, agent, off)
    assert agent.plans.get(JOB).lr_scale == 1.0


def test_metrics_families_match_spec(tmp_path: Path) -> None:
    agent = make_agent(tmp_path)
    ctl = install(agent, ControllerConfig(strategy="goodput", every_steps=5, warmup_steps=5))
    sim = SimJob(agent.plans, agent.table)
    sim.run(20, agent, ctl)
    spec = index(METRICS)
    class Source:
        def collect(self):  # noqa: ANN202
            return ctl.metrics()

    registry = CollectorRegistry()
    registry.register(Source())
    current = ctl.jobs[JOB].current
    assert registry.get_sample_value("trainguard_controller_lr_scale", {"job": JOB}) == current.lr_scale
    assert registry.get_sample_value("trainguard_controller_batch_size", {"job": JOB}) == current.batch
    assert sum(sim.sizes) == current.batch
    assert registry.get_sample_value("trainguard_controller_decisions_total", {"job": JOB, "strategy": "goodput"}) >= 2
    # The simulation reports exact expected norms |G|^2 + S/b with |G|^2 = 1, S = 32.
    assert 31 < registry.get_sample_value("trainguard_controller_noise_scale", {"job": JOB}) < 33  # type: ignore[operator]
    assert registry.get_sample_value("trainguard_controller_objective", {"job": JOB}) is not None
    for family in ctl.metrics():
        assert family.name in {s.removesuffix("_total") for s in spec}
        for sample in family.samples:
            assert set(sample.labels) == set(spec.get(family.name, spec.get(family.name + "_total")).labels)  # type: ignore[union-attr]


def test_agent_side_never_imports_torch() -> None:
    code = ("import sys; from agent.controller import install, ControllerConfig; "
            "from agent.controller.optuna_strategy import OptunaStrategy; import agent.controller.gp; "
            "import agent.controller.bandit, agent.controller.goodput; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.stdout.strip() == "False"
