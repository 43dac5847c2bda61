"""The evidence strategy end to end: a real agent (in-process ``Agent``) and the embedded trainer
on 2 gloo ranks. From an LR 10x too high the controller lowers it, with events that give the
window's trajectory cosine; at the default LR it makes no move. Plus the plan translation
(evidence_plan.py) against a fake plan store.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from bench.trainjobs import run_job, tiny_config
from tests.conftest import in_process_agent_config
from tests.helpers.telemetry import make_msg
from trainguard.agent.controller import ControllerConfig, install
from trainguard.agent.controller.evidence import Action, EvidenceConfig
from trainguard.agent.controller.evidence_plan import EvidenceDriver
from trainguard.agent.daemon import Agent
from trainguard.agent.lifecycle.jobs import JobSpec
from trainguard.agent.wire import Plan, Telemetry, write_plan_file
from trainguard.trainer.config import config_from_cli
from trainguard.trainer.data import build_corpus
from trainguard.trainer.evidence import EvidenceProbe

JOB = "ctl-evidence"
GOOD_LR = 0.003


SHIPPED = EvidenceConfig()
PLUMBING = EvidenceConfig(high_threshold=-0.02)
"""Not a calibration: the GPT at 10x reads about -0.035 (below), past this threshold but not past
the shipped -0.12, so this config exercises the moves and snapshots on real ranks."""


def _run(tmp_path: Path, lr: float, steps: int, evidence: EvidenceConfig
         ) -> tuple[list[dict[str, Any]], list[Telemetry], list[Telemetry]]:
    agent = Agent(in_process_agent_config(tmp_path / "agent"))
    agent.start()
    try:
        install(agent, ControllerConfig(strategy="evidence"), evidence=evidence)
        trainer = config_from_cli(nproc=2, steps=steps, overrides=[
            "model.layers=1", "model.d_model=32", "model.heads=2", "model.context=32", "global_batch=8",
            f"data.cache_dir={tmp_path / 'cache'}", "data.max_bytes=2000000", "optim.warmup=2", f"optim.lr={lr}",
            "parallel.dp_mode=ddp"])
        build_corpus(str(tmp_path / "cache"), 2_000_000)  # once, before two ranks race to build it
        agent.supervisor.submit(JobSpec(JOB, 2, trainer))
        record = agent.supervisor.jobs[JOB]
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            agent.tick(time.time())
            if record.state.finished:
                agent.tick(time.time())
                break
            time.sleep(0.05)
        assert record.state.value == "succeeded", (record.state, record.reason)
        events = [{**e, **e.get("fields", {})} for e in agent.events.since(0, 10_000)]
        return events, list(agent.table.window(JOB, 0, None)), list(agent.table.window(JOB, 1, None))
    finally:
        agent.shutdown()


def _moves(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e.get("strategy") == "evidence" and e["kind"].startswith("controller_")]


def test_evidence_lowers_a_too_high_lr(tmp_path: Path) -> None:
    """From 10x the good LR the ranks' trajectory cosine is negative and a move lowers the LR: the
    event gives the window's mean, the ranks apply it at one step (their reported LR drops)."""
    events, r0, r1 = _run(tmp_path, 10 * GOOD_LR, 1500, PLUMBING)
    cos = [m.traj_cos for m in r0 if m.traj_cos is not None]
    assert cos and all(-1 <= c <= 1 for c in cos)
    assert all(m.traj_cos is None for m in r1)  # one rank reports it (it is the same on both)
    moves = _moves(events)
    down = [e for e in moves if e["action"] == "move" and e["lr_scale_to"] < e["lr_scale_from"]]
    assert down, "\n".join(e["message"] for e in events)
    first = down[0]
    assert first["inputs"]["traj_cos_mean"] < PLUMBING.high_threshold
    assert "trajectory cosine" in first["cause"] and first["changed"]
    # Both ranks ran the move's plan from the same step, at the lower LR.
    under = [[m for m in r if m.plan_version >= first["plan_version"]] for r in (r0, r1)]
    assert under[0] and under[1]
    assert under[0][0].step - under[0][0].steps == under[1][0].step - under[1][0].steps
    before = [m.lr for m in r0 if m.plan_version < first["plan_version"]][-1]
    assert under[0][0].lr < before
    # The ranks took the move's snapshot when they applied its plan (the trainer logs it).
    logs = "".join(f.read_text(errors="replace") for f in tmp_path.rglob("*.log") if f.is_file())
    assert "evidence controller: snapshot taken at step" in logs


def test_evidence_is_silent_at_the_default_lr(tmp_path: Path) -> None:
    """At the good LR the shipped tests do not fire over a short run: no plan changes the LR."""
    events, r0, _ = _run(tmp_path, GOOD_LR, 1000, SHIPPED)
    assert any(m.traj_cos is not None for m in r0)
    assert not _moves(events), "\n".join(e["message"] for e in _moves(events))


def test_evidence_at_10x_with_the_shipped_thresholds_is_recorded(tmp_path: Path) -> None:
    """The shipped too-high threshold (-0.12, chosen on the NQM) against the GPT at 10x: what the
    ranks measure stays above it, so nothing fires. This pins the gap docs/controller.md states;
    it fails (and should be rewritten) once a calibrated threshold lowers the LR here."""
    events, r0, _ = _run(tmp_path, 10 * GOOD_LR, 1000, SHIPPED)
    cos = [m.traj_cos for m in r0 if m.traj_cos is not None]
    assert cos and sum(cos) / len(cos) < 0  # the sign is right ...
    assert not _moves(events)  # ... the size is not past the NQM's threshold


class FakePlans:
    """The plan store's surface the driver's caller uses: versions and the ``extra`` it carries."""

    def __init__(self) -> None:
        self.version = 0
        self.extra: dict[str, Any] = {}

    def update(self, changes: dict[str, Any]) -> int:
        self.version += 1
        self.extra = changes.get("extra", self.extra)
        return self.version


def _feed(driver: EvidenceDriver, plans: FakePlans, steps: range, traj: float, lag: int,
          applied: dict[str, int]) -> list[Action]:
    """Steps one at a time, with each plan reaching the ranks ``lag`` steps after it went out."""
    out = []
    seen_at: dict[int, int] = {}
    for s in steps:
        version = max((v for v, at in seen_at.items() if s - at > lag), default=applied["version"])
        applied["version"] = version
        action = driver.ingest(s, 1, version, 1.0 / s ** 0.1, traj)
        if action is None:
            continue
        out.append(action)
        changes = driver.plan_changes(action, plans.extra)
        if changes is not None:
            version = plans.update(changes)
            driver.published(action, version)
            seen_at[version] = s
    return out


def test_plan_translation_with_fakes() -> None:
    """A move asks for a snapshot with the new LR; the steps before its plan arrives are not
    counted; a restore asks for the snapshot back at the old LR; a kept move publishes nothing."""
    driver = EvidenceDriver(1000, EvidenceConfig())
    plans = FakePlans()
    applied = {"version": 0}
    assert driver.request() == {"window": 20, "snapshot": 0, "restore": 0}
    actions = _feed(driver, plans, range(1, 161), -0.5, 7, applied)
    move = actions[0]
    assert move.kind == "move" and move.lr_scale < 1 and move.inputs["traj_cos_mean"] == -0.5
    assert move.step % driver.ctl.window == 0
    assert plans.extra["evidence"] == {"window": 20, "snapshot": 1, "restore": 0}
    # The 7 steps before the plan arrived are left out: the trajectory resumes at the move's step.
    assert driver.offset == 7 and driver.pending is None
    # A kept move publishes nothing; a restore asks for the snapshot back at the LR before the move.
    kept = Action("keep", move.lr_scale, move.step + 20, "kept", -1)
    assert driver.plan_changes(kept, plans.extra) is None
    restore = Action("restore", 1.0, move.step, "worse", -1)
    changes = driver.plan_changes(restore, plans.extra)
    assert changes == {"lr_scale": 1.0, "extra": {"evidence": {"window": 20, "snapshot": 1, "restore": 1}}}
    driver.published(restore, plans.update(changes))
    # Steps under the older plan are dropped; the first under the restore's is the move's step + 1.
    assert driver.ingest(400, 1, plans.version - 1, 1.0, -0.5) is None and driver.pending is not None
    driver.ingest(405, 1, plans.version, 1.0, None)
    assert driver.offset == 404 - move.step
    # A restarted attempt counts from its own step 0 with the LR scale in force.
    driver.restarted()
    assert driver.offset == 0 and driver.pending is None and driver.ctl.lr_scale == move.lr_scale


def test_rank_probe_restores_exactly_and_measures_the_cosine() -> None:
    """The rank side on a small model with AdamW: a snapshot request copies the state, a restore
    request brings parameters and optimizer state back exactly; the cosine's sums are read only on
    the steps the controller reads, against theta_ref from the window's start."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    params = list(model.parameters())
    probe = EvidenceProbe(params)

    def step() -> None:
        opt.zero_grad()
        model(torch.randn(8, 4)).pow(2).sum().backward()
        opt.step()

    assert probe.apply({"window": 8, "snapshot": 3, "restore": 1}, 0, [model, opt], first=True) == ""
    assert probe.seen == (3, 1) and probe.snapshot is None  # an earlier attempt's requests are only noted
    for _ in range(3):
        step()
    assert "snapshot taken" in probe.apply({"window": 8, "snapshot": 4, "restore": 1}, 3, [model, opt], first=False)
    saved = [p.detach().clone() for p in params]
    saved_avg = [opt.state[p]["exp_avg"].clone() for p in params]
    probe.before_step(3)  # the anchor: a window starts here
    assert probe.ref is not None and torch.equal(probe.ref, torch.cat([p.detach().reshape(-1) for p in saved]))
    for s in range(3, 8):
        opt.zero_grad()
        model(torch.randn(8, 4)).pow(2).sum().backward()
        terms = probe.terms(s + 1)
        assert (terms is not None) == probe.reads(s + 1) == ((s + 1 - 3) % 8 > 4)
        if terms is not None:
            g = torch.cat([p.grad.reshape(-1) for p in params if p.grad is not None])
            d = torch.cat([p.detach().reshape(-1) for p in params]) - probe.ref
            assert torch.allclose(terms, torch.stack([-(g @ d), g @ g, d @ d]))
        opt.step()
    assert any(not torch.equal(p, q) for p, q in zip(params, saved, strict=True))
    assert "restored the snapshot of step 3" in probe.apply({"window": 8, "snapshot": 4, "restore": 2}, 8,
                                                           [model, opt], first=False)
    assert all(torch.equal(p, q) for p, q in zip(params, saved, strict=True))
    assert all(torch.equal(opt.state[p]["exp_avg"], a) for p, a in zip(params, saved_avg, strict=True))
    assert probe.anchor == 8 and probe.ref is None
    # A DDP replica other than dp rank 0 adds nothing to the all-reduce.
    assert EvidenceProbe(params, measures=False, window=8, ref=probe.ref).terms(8) is None


def test_traj_cos_is_a_validated_wire_field() -> None:
    import json

    from trainguard.agent.wire import WireError, decode_telemetry
    base = make_msg("j", traj_cos=-0.25)
    assert decode_telemetry(base.encode()).traj_cos == -0.25
    body = json.loads(base.encode())
    body["traj_cos"] = 1.5
    with pytest.raises(WireError):
        decode_telemetry(json.dumps(body).encode())


def test_rank_cosine_is_the_same_sharded_or_replicated(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """The trajectory cosine from the step's all-reduce is the same whether FSDP shards the
    parameters (every rank adds its shard's sums) or DDP replicates them (dp rank 0 adds them);
    and an FSDP job takes a snapshot and restores it when the plan asks, mid-run."""
    cache = str(tmp_path / "cache")
    build_corpus(cache, 2_000_000)
    got: dict[str, dict[int, float]] = {}
    for mode in ("ddp", "fsdp"):
        plan_path = str(tmp_path / f"{mode}.plan")
        write_plan_file(plan_path, Plan(version=1, extra={"evidence": {"window": 4, "snapshot": 0, "restore": 0}}))
        asked: list[int] = []

        def on_message(m: Telemetry, plan_path: str = plan_path, asked: list[int] = asked) -> None:
            # Ask for a snapshot once the ranks are past step 8, then for the restore 40 steps later.
            if m.rank != 0 or m.step < 8 or len(asked) >= 2 or (asked and m.step < asked[0] + 40):
                return
            if asked and m.plan_version < 2:
                return  # the restore only once the ranks run the snapshot's plan (v2), never in its place
            asked.append(m.step)
            request = {"window": 4, "snapshot": 1, "restore": len(asked) - 1}
            write_plan_file(plan_path, Plan(version=1 + len(asked), extra={"evidence": request}))

        cfg = tiny_config(cache, parallel={"dp": 2, "dp_mode": mode}, steps=600)
        result = run_job(cfg, 2, tmp_path / mode, plan_path=plan_path, on_telemetry=on_message)
        assert result.rc == 0 and not result.telemetry_errors
        r0 = result.telemetry[0]
        assert all(m.traj_cos is None for m in result.telemetry[1])
        got[mode] = {m.step: m.traj_cos for m in r0 if m.steps == 1 and m.plan_version == 1 and m.traj_cos is not None}
        # Measured on the steps the controller reads only (window 4: the 3rd and 4th of each).
        assert got[mode] and all(s % 4 in (0, 3) for s in got[mode]), got[mode]
        err = capfd.readouterr().err
        assert len(asked) == 2 and "evidence controller: snapshot taken at step" in err, err[-2000:]
        assert "evidence controller: restored the snapshot of step" in err, err[-2000:]
    common = sorted(set(got["ddp"]) & set(got["fsdp"]))
    assert common
    for s in common:
        assert math.isclose(got["ddp"][s], got["fsdp"][s], rel_tol=1e-3, abs_tol=1e-4), (s, got)
