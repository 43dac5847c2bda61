"""The evidence controller (agent/controller/evidence.py) on the noisy quadratic model at many
seeds: silent at the good LR, rescuing a 10x-off start in either direction, and its mechanics
(forecast, restore-and-close) on made-up series."""

from __future__ import annotations

import math
import statistics
from dataclasses import replace

import pytest

from trainguard.agent.controller.calibrate import auc, run_nqm, signal_roc
from trainguard.agent.controller.evidence import EvidenceConfig, EvidenceController, loglog_forecast, preset
from trainguard.agent.controller.nqm import ADAM, NQM, TASKS

STEPS = 1000


def target_and_time(task, seeds):  # type: ignore[no-untyped-def]
    """The bench's target (median true loss of none at the good LR at 75 % of the run) and
    none's median steps to it."""
    runs = [run_nqm(task, 1.0, s, STEPS, control=False) for s in seeds]
    target = statistics.median(r.losses[int(0.75 * STEPS) - 1] for r in runs)
    return target, runs


@pytest.mark.parametrize("name", ["adam", "nesterov"])
def test_nqm_good_lr_beats_half_and_double(name: str) -> None:
    """Each task's good_lr ends its schedule lower than half or twice it (median of 8 seeds)."""
    task = TASKS[name]

    def final(mult: float) -> float:
        return statistics.median(run_nqm(task, mult, s, STEPS, control=False).final_loss for s in range(8))

    good = final(1.0)
    assert good < final(0.5) and good < final(2.0), (name, good, final(0.5), final(2.0))


def test_nqm_snapshot_restores_the_state_but_not_the_data() -> None:
    model = NQM(ADAM, ADAM.good_lr, STEPS, 0)
    for _ in range(50):
        model.step()
    snap = model.snapshot()
    first = [model.step().true_loss for _ in range(5)]
    model.restore(snap)
    again = [model.step().true_loss for _ in range(5)]
    assert model.step_no == 55
    assert first != again  # new minibatches after a restore, as the trainer's memory snapshot gives


@pytest.mark.parametrize("name", ["nesterov", "adam"])
def test_silent_at_the_good_lr_and_does_no_harm(name: str) -> None:
    """20 seeds at the good LR with the task's preset: no move in at least 16, and the paired ratios
    (none / controller time to target; controller / none final loss) at no harm in the median. On
    adam this holds because the preset raises no earlier than 20 % of the run (the next test)."""
    seeds = range(20)
    task = TASKS[name]
    target, base = target_and_time(task, seeds)
    ctl = [run_nqm(task, 1.0, s, STEPS, control=True) for s in seeds]
    silent = sum(r.moves == 0 for r in ctl)
    assert silent >= 16, [r.moves for r in ctl]
    times = [b.to_target(target) / c.to_target(target) for b, c in zip(base, ctl, strict=True)]
    assert statistics.median(times) >= 0.98, times
    finals = [c.final_loss / b.final_loss for b, c in zip(base, ctl, strict=True)]
    assert statistics.median(finals) <= 1.02, finals


def test_adam_at_its_good_lr_without_the_late_first_raise_does_harm() -> None:
    """The failure the adam preset's low_start removes: with raises allowed from 10 % of the run
    (the sgd preset), the good LR's early, locally-too-low trajectory cosine moves the LR up in
    most seeds and the schedule ends worse (median of 10 seeds)."""
    seeds = range(10)
    base = [run_nqm(ADAM, 1.0, s, STEPS, control=False) for s in seeds]
    early = [run_nqm(ADAM, 1.0, s, STEPS, control=True, config=preset("sgd")) for s in seeds]
    assert sum(r.moves > 0 for r in early) >= 5, [r.actions for r in early]
    assert statistics.median(r.final_loss / b.final_loss for r, b in zip(early, base, strict=True)) > 1.1


@pytest.mark.parametrize("name", ["nesterov", "adam"])
@pytest.mark.parametrize("mult", [0.1, 10.0])
def test_rescues_a_10x_off_start(name: str, mult: float) -> None:
    """From 10x too low or too high the controller reaches the target that none reaches at the good
    LR, where none from that start does not, within the issue's 1.5x of none's time, and ends with
    the LR moved toward the good one in most seeds (median of 10 seeds)."""
    task = TASKS[name]
    seeds = range(10)
    target, base = target_and_time(task, seeds)
    none_time = statistics.median(r.to_target(target) for r in base)
    lost = [run_nqm(task, mult, s, STEPS, control=False) for s in seeds]
    assert statistics.median(r.to_target(target) for r in lost) == math.inf
    ctl = [run_nqm(task, mult, s, STEPS, control=True) for s in seeds]
    assert statistics.median(r.to_target(target) for r in ctl) < 1.5 * none_time, [r.actions for r in ctl]
    toward = [r for r in ctl if abs(math.log(mult * r.final_lr_scale)) < abs(math.log(mult)) - 0.5]
    assert len(toward) >= 8, [r.final_lr_scale for r in ctl]


@pytest.mark.parametrize("name", ["adam", "nesterov"])
def test_the_trajectory_cosine_separates_10x_off_starts_early(name: str) -> None:
    """The signal the controller reads tells a 10x-off start from the good LR in the right direction
    at the first decision (10 % of the run) and still at 40 % on both NQM tasks (the ROC
    docs/controller.md reports)."""
    roc = signal_roc(TASKS[name], seeds=10, at=(0.1, 0.4))["traj_cos"]
    for frac in (0.1, 0.4):
        assert roc[frac]["low10"] >= 0.9 and roc[frac]["high10"] >= 0.9, roc


def test_auc_counts_ties_half() -> None:
    assert auc([2, 3], [1]) == 1.0 and auc([1], [2, 3]) == 0.0 and auc([1], [1]) == 0.5


def test_forecast_of_an_exact_power_law() -> None:
    points = [(s, 3.0 * s ** -0.5) for s in range(100, 140)]
    mean, se = loglog_forecast(points, list(range(140, 160)))  # type: ignore[misc]
    expected = statistics.fmean(math.log(3.0 * s ** -0.5) for s in range(140, 160))
    assert mean == pytest.approx(expected, abs=1e-3)
    assert se < 1e-6


def feed(ctl: EvidenceController, steps: range, loss, cos: float):  # type: ignore[no-untyped-def]
    return [a for s in steps if (a := ctl.observe(s, loss(s), cos)) is not None]


def test_a_move_worse_than_its_forecast_is_restored_and_closes_its_direction() -> None:
    cfg = EvidenceConfig(window=0.02, start=0.1, confirm=2)
    ctl = EvidenceController(1000, cfg)
    actions = feed(ctl, range(1, 121), lambda s: 2.0 * s ** -0.3, 0.5)  # too-low evidence at 100 and 120
    assert [a.kind for a in actions] == ["move"] and actions[0].step == 120 and ctl.lr_scale > 1
    actions = feed(ctl, range(121, 141), lambda s: 5.0, 0.0)  # the move's window is far worse
    assert [a.kind for a in actions] == ["restore"]
    assert actions[0].step == 120 and ctl.lr_scale == 1.0 and ctl.closed == {1}
    # The restored run resumes at the snapshot's step; the same evidence no longer moves it up.
    assert feed(ctl, range(121, 301), lambda s: 2.0 * s ** -0.3, 0.5) == []


def test_a_move_that_diverges_is_restored_at_once() -> None:
    ctl = EvidenceController(1000)
    assert [a.kind for a in feed(ctl, range(1, 121), lambda s: 2.0 * s ** -0.3, -0.5)] == ["move"]
    assert ctl.lr_scale < 1
    assert [a.kind for a in feed(ctl, range(121, 126), lambda s: math.inf if s == 125 else 1.0, -0.5)] == ["restore"]
    assert ctl.lr_scale == 1.0 and ctl.closed == {-1}


def test_no_evidence_no_move_and_nothing_outside_the_decision_span() -> None:
    ctl = EvidenceController(1000)
    assert feed(ctl, range(1, 1001), lambda s: 2.0 * s ** -0.3, 0.05) == []
    late = EvidenceController(1000)
    assert feed(late, range(1, 100), lambda s: 2.0 * s ** -0.3, 0.9) == []  # before start
    ctl2 = EvidenceController(1000, replace(EvidenceConfig(), stop=0.2))
    actions = feed(ctl2, range(1, 1001), lambda s: 2.0 * s ** -0.3, -0.5)
    assert actions and all(a.step <= 200 + ctl2.window for a in actions)


def test_a_fading_too_low_signal_moves_nothing_when_persistence_is_required() -> None:
    """The same series, too-low evidence falling by half each window: a move without the rule,
    none with low_persist 1.0 (the early phase of a run at a good LR looks like this)."""
    def run(persist: float) -> list[str]:
        ctl = EvidenceController(1000, EvidenceConfig(low_persist=persist))
        return [a.kind for s in range(1, 200)
                if (a := ctl.observe(s, 2.0 * s ** -0.3, 0.9 * 0.5 ** (s // 20 - 4))) is not None]

    assert "move" in run(0.0)
    assert run(1.0) == []


def test_no_raise_before_low_start_but_lowering_is_not_held() -> None:
    """Too-low evidence from 10 % of the run moves nothing before ``low_start`` (20 %) and moves at
    the first confirmed look after it; too-high evidence still moves at 10 %."""
    cfg = EvidenceConfig(low_start=0.2)
    up = feed(EvidenceController(1000, cfg), range(1, 301), lambda s: 2.0 * s ** -0.3, 0.5)
    assert [(a.kind, a.step) for a in up][:1] == [("move", 220)]
    down = feed(EvidenceController(1000, cfg), range(1, 301), lambda s: 2.0 * s ** -0.3, -0.5)
    assert [(a.kind, a.step) for a in down][:1] == [("move", 120)]


def test_presets_by_optimizer_family() -> None:
    assert preset("adam").low_start > preset("sgd").low_start == 0
    assert preset("adam").high_threshold > preset("sgd").high_threshold
    with pytest.raises(ValueError, match="evidence: unknown optimizer family 'rmsprop'"):
        preset("rmsprop")


def test_bad_config_is_a_one_line_error() -> None:
    with pytest.raises(ValueError, match="evidence.factor: must be > 1"):
        EvidenceConfig(factor=1.0)
    with pytest.raises(ValueError, match="evidence.low_start: must be in"):
        EvidenceConfig(low_start=0.6)


def feed_gain(ctl: EvidenceController, steps: range, share: float):  # type: ignore[no-untyped-def]
    """A falling loss, a neutral cosine and, on the curvature reads, steps that lose ``share`` of
    their predicted decrease to curvature."""
    return [a for s in steps if (a := ctl.observe(s, 2.0 * s ** -0.3, 0.0,
                                                  (1.0, 1.0 - share) if ctl.reads_curvature(s) else None)) is not None]


def test_a_high_curvature_share_lowers_the_lr_before_start() -> None:
    """Above its threshold for two windows the curvature share lowers the LR at the second window,
    before ``start`` (it is not confounded by the warm-up); twice past it, one window is enough
    and the first move is a double one. Below it nothing moves in the whole run."""
    cfg = EvidenceConfig(high_curvature=0.1)
    ctl = EvidenceController(1000, cfg)
    moves = feed_gain(ctl, range(1, 41), 1.5 * cfg.high_curvature)
    assert [(a.kind, a.step) for a in moves] == [("move", 40)] and math.isclose(ctl.lr_scale, 1 / cfg.factor)
    assert moves[0].inputs["curvature_share"] == pytest.approx(1.5 * cfg.high_curvature)
    assert "curvature share" in moves[0].reason
    strong = EvidenceController(1000, cfg)
    moves = feed_gain(strong, range(1, 21), 2.5 * cfg.high_curvature)
    assert [(a.kind, a.step) for a in moves] == [("move", 20)] and math.isclose(strong.lr_scale, cfg.factor ** -2)
    assert feed_gain(EvidenceController(1000, cfg), range(1, 1001), 0.5 * cfg.high_curvature) == []
    off = EvidenceController(1000)  # the default: the test is off and nothing is read
    assert not any(off.reads_curvature(s) for s in range(1, 1001))
    assert feed_gain(off, range(1, 1001), 0.9) == []


def test_curvature_reads_outside_their_steps_or_not_finite_count_for_nothing() -> None:
    ctl = EvidenceController(1000, EvidenceConfig(high_curvature=0.1))
    assert not ctl.reads_curvature(5) and ctl.reads_curvature(20) and not ctl.reads_curvature(1000)
    bad = [a for s in range(1, 101)
           if (a := ctl.observe(s, 1.0, 0.0, (1.0, -5.0) if not ctl.reads_curvature(s) else (math.nan, 0.0)))]
    assert bad == []


def test_the_nqm_reports_its_own_minibatch_gain_exactly() -> None:
    """On a quadratic the actual decrease is the predicted one less 1/2 u'Hu, so the curvature
    share of a plain step grows with the LR."""
    model = NQM(TASKS["nesterov"], 0.02, 1000, 0)
    before = model.theta.copy()
    st = model.step()
    u = model.theta - before
    assert st.gain[1] == pytest.approx(st.gain[0] - 0.5 * float(u @ (model.h * u)))
    shares = []
    for lr in (0.02, 0.2):
        m = NQM(TASKS["nesterov"], lr, 1000, 0)
        gains = [m.step().gain for _ in range(50)]
        shares.append(1 - sum(a for _, a in gains) / sum(p for p, _ in gains))
    assert 0 < shares[0] < shares[1]
