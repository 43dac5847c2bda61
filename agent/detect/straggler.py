"""Straggler scoring: robust per-rank statistics, a score in [0, 1], and a hysteresis state machine.

Pure logic over numbers: the service (service.py) feeds it each rank's recent steps and reads back
scores and state changes, so every threshold can be tested on synthetic telemetry.

What is compared is each rank's compute time per step *at the job's even batch size*: its median
forward+backward time per sample times the even share, plus (where the service measured it) the
time per step the rank waited for a CPU. With the even split every rank runs, that is exactly the
compute time the ranks report, so the score is "fastest-rank median ÷ this rank's median".
Once shard migration has given a slow rank fewer samples its compute time per step drops to match
the others, while its time per sample does not: judging at the even batch is what lets the
detector tell "balanced by migration" from "recovered" (and not undo a migration that works).
Forward+backward has a part that does not shrink with the batch (per-step work: 1.7 ms, 4 samples'
worth, of a 16-sample step's 9 ms on the straggler test's model on CPU); carried to the even batch
as if per sample, it made a rank migrated down to 2 of 64 samples look 2-3x slow long after it
recovered, so it got its share back late or never. Once a window holds two batch sizes (a
migration), the group's fixed part is fitted and, in samples' worth, kept: each rank's time is
then carried to the even batch as ``unit * (even + fixed)``.
Run delay enters as a rate (seconds waiting per second computing), so that it too is judged at
the even batch. Optimizer time is a per-step constant too; it stays out of
the score and goes into ``fixed_s`` for the migration model.

Ranks are compared only with their peers: ranks at the same pipeline stage and tensor-parallel
position (a first and a last pipeline stage do different work). Peers are the dp replicas.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from trainguard.agent.detect.config import StragglerConfig

_MAD_TO_SIGMA = 1.4826  # MAD of a normal distribution -> its standard deviation


def median(values: Sequence[float]) -> float:
    s = sorted(values)
    n = len(s)
    if n == 0:
        return math.nan
    mid = n // 2
    return float(s[mid]) if n % 2 else (s[mid - 1] + s[mid]) / 2.0


def mad(values: Sequence[float], center: float | None = None) -> float:
    """Median absolute deviation from ``center`` (default: the median)."""
    if not values:
        return math.nan
    c = median(values) if center is None else center
    return median([abs(v - c) for v in values])


class RankState(enum.Enum):
    WARMUP = "warmup"
    HEALTHY = "healthy"
    SUSPECT = "suspect"
    STRAGGLER = "straggler"
    RECOVERING = "recovering"


_ALLOWED: dict[RankState, frozenset[RankState]] = {
    # WARMUP -> STRAGGLER: a straggler before its job restarted is one again after the warm-up,
    # without a second detection (its standing carries over the restart).
    RankState.WARMUP: frozenset({RankState.HEALTHY, RankState.STRAGGLER}),
    RankState.HEALTHY: frozenset({RankState.SUSPECT, RankState.STRAGGLER, RankState.WARMUP}),
    RankState.SUSPECT: frozenset({RankState.HEALTHY, RankState.STRAGGLER, RankState.WARMUP}),
    RankState.STRAGGLER: frozenset({RankState.RECOVERING, RankState.HEALTHY, RankState.WARMUP}),
    RankState.RECOVERING: frozenset({RankState.STRAGGLER, RankState.HEALTHY, RankState.WARMUP}),
}


class InvalidTransition(RuntimeError):
    pass


@dataclass(frozen=True)
class StepSample:
    """One step of one rank, as the detector needs it."""

    step: int
    fwd_bwd_s: float
    opt_s: float
    samples: int


@dataclass(frozen=True)
class RankInput:
    rank: int
    group: int
    """Peer group: ranks with the same pipeline stage and tensor-parallel position."""
    dp_rank: int
    steps: Sequence[StepSample]
    """The rank's recent steps, oldest first (the service passes the table's window)."""
    delay_per_step_s: float = 0.0
    """CPU run-queue delay per step measured by the service (0 when unknown)."""
    attempt: int | None = None
    """The attempt ``steps`` are of (None: not known). The service passes only the job's current
    attempt's steps; a new attempt starts the rank's warm-up again, whatever its step numbers do."""


@dataclass(frozen=True)
class RankFigures:
    """A rank's robust statistics over its window."""

    rank: int
    group: int
    dp_rank: int
    per_sample_s: float
    """Median over the window of forward+backward time / samples."""
    per_sample_mad_s: float
    fixed_s: float
    """Per-step compute that does not scale with the batch: median optimizer time, plus the intercept
    of forward+backward time against batch size when the window holds more than one batch size."""
    marginal_s: float
    """Forward+backward seconds per additional sample (the slope; ``per_sample_s`` until the window
    holds two batch sizes to fit it from)."""
    unit_s: float
    """Median over the window of forward+backward time / (samples + ``fixed_samples``)."""
    unit_mad_s: float
    fixed_samples: float
    """The group's per-step fixed forward+backward work in samples' worth (0 until fitted): what
    ``at_batch`` adds to the batch."""
    delay_s: float
    """CPU run delay per step (0 when not measured)."""
    compute_s: float
    """Median compute time per step (fwd+bwd+opt, plus run delay)."""
    samples: int
    """Samples in the rank's latest step."""
    last_step: int
    n: int
    """Steps the figures are computed over."""

    def at_batch(self, samples: float) -> float:
        """This rank's forward+backward time per step at ``samples`` samples."""
        return self.unit_s * (samples + self.fixed_samples)

    @property
    def speed(self) -> float:
        """Samples per second of forward+backward (the migration weight)."""
        return 1.0 / self.per_sample_s if self.per_sample_s > 0 else math.inf


FIT_MIN_SPREAD = 0.25
"""The smallest and the largest batch size must differ by this share of the largest for a slope to
be fitted: between 36 and 37 samples the step-to-step noise is the slope, and a rank whose slope
came out near zero looked ever faster and was handed ever more samples (the demo flapped)."""


def _times_by_size(points: Sequence[tuple[int, float]], min_group: int) -> dict[int, list[float]]:
    """Batch size -> its times, for the sizes seen at least ``min_group`` times."""
    groups: dict[int, list[float]] = {}
    for n, t in points:
        groups.setdefault(n, []).append(t)
    return {n: ts for n, ts in groups.items() if len(ts) >= min_group}


def fit_cost(points: Sequence[tuple[int, float]], min_group: int = 3,
             min_spread: float = FIT_MIN_SPREAD) -> tuple[float, float] | None:
    """(intercept, slope) of time against batch size from the medians of the smallest and the largest
    batch size seen at least ``min_group`` times; None with fewer than two such sizes, or when they
    differ by less than ``min_spread`` of the largest.

    Medians per size rather than least squares: one slow step (a GC pause) must not tilt the line."""
    groups = _times_by_size(points, min_group)
    sizes = sorted(groups)
    if len(sizes) < 2 or sizes[-1] - sizes[0] < min_spread * sizes[-1]:
        return None
    lo, hi = sizes[0], sizes[-1]
    m_lo, m_hi = median(groups[lo]), median(groups[hi])
    slope = (m_hi - m_lo) / (hi - lo)
    if slope <= 0:
        return None
    return max(0.0, m_lo - slope * lo), slope


@dataclass
class _Track:
    state: RankState = RankState.WARMUP
    count: int = 0  # consecutive evaluations in the current direction
    base_step: int | None = None  # first step seen since the rank (re)started
    last_step: int = -1
    score: float = 1.0
    since: float | None = None  # when it became a straggler
    carried_since: float | None = None  # a straggler when its job restarted: since when
    attempt: int | None = None  # the attempt the rank's steps were last of


@dataclass(frozen=True)
class Transition:
    rank: int
    old: RankState
    new: RankState
    score: float

    @property
    def detected(self) -> bool:
        return self.new == RankState.STRAGGLER and self.old in (RankState.HEALTHY, RankState.SUSPECT)

    @property
    def recovered(self) -> bool:
        return self.new == RankState.HEALTHY and self.old in (RankState.STRAGGLER, RankState.RECOVERING)


@dataclass
class Evaluation:
    figures: dict[int, RankFigures] = field(default_factory=dict)
    scores: dict[int, float] = field(default_factory=dict)
    transitions: list[Transition] = field(default_factory=list)
    evaluated: bool = False
    """False when too few new steps arrived since the last evaluation (states unchanged)."""


def _usable(inp: RankInput, window: int, from_step: int) -> list[StepSample] | None:
    usable = [s for s in inp.steps if s.step >= from_step and s.samples > 0][-window:]
    return usable if len(usable) >= window else None


FIXED_SAMPLES_MAX = 4.0
"""A fitted fixed part above this many times the larger fitted batch is taken as a bad fit (a
slope near zero from noise) and not kept: carried to the even batch it would judge ranks on their
raw step times, which would call a straggler balanced by migration recovered."""


FIXED_FITS_KEPT = 15
"""Fits over the widest spread whose median a group's fixed part is."""


@dataclass(frozen=True)
class FixedPart:
    """A fitted fixed part of forward+backward: ``samples``' worth, fitted over batch sizes
    ``spread`` samples apart (the wider, the less the line's extrapolation to 0 amplifies noise)."""

    samples: float
    spread: int


Fit = tuple[float, float] | None
"""``fit_cost`` of a window: (intercept, slope) of forward+backward time against batch size."""


def window_fit(inp: RankInput, window: int, from_step: int) -> tuple[list[StepSample], Fit] | None:
    """The rank's newest ``window`` steps at or after ``from_step`` (None if fewer) and their cost
    fit, worked out once per evaluation for both the fixed part and the figures."""
    usable = _usable(inp, window, from_step)
    if usable is None:
        return None
    return usable, fit_cost([(s.samples, s.fwd_bwd_s) for s in usable])


def fitted_fixed_part(usable: Sequence[StepSample], fit: Fit, even: float) -> FixedPart | None:
    """The fixed part of a rank's forward+backward (intercept / slope), when its window holds two
    batch sizes far enough apart to fit them (``fit``), by at least ``FIT_MIN_SPREAD`` of the
    group's even batch ``even`` (what the part is carried to: 1 and 2 samples fit no line for a
    batch of 16); None otherwise."""
    if fit is None:
        return None
    intercept, slope = fit
    sizes = sorted(_times_by_size([(s.samples, s.fwd_bwd_s) for s in usable], 3))
    k, spread = intercept / slope, sizes[-1] - sizes[0]
    if spread < FIT_MIN_SPREAD * even or k > FIXED_SAMPLES_MAX * sizes[-1]:
        return None
    return FixedPart(k, spread)


def figures_for(inp: RankInput, usable: Sequence[StepSample], fit: Fit, fixed_samples: float = 0.0) -> RankFigures:
    """Robust figures over a rank's window ``usable`` with its cost ``fit`` (``window_fit``);
    ``fixed_samples``: the group's fixed part of forward+backward in samples' worth."""
    per = [s.fwd_bwd_s / s.samples for s in usable]
    center = median(per)
    units = [s.fwd_bwd_s / (s.samples + fixed_samples) for s in usable]
    unit = median(units)
    opt = median([s.opt_s for s in usable])
    intercept, slope = fit if fit is not None else (0.0, center)
    return RankFigures(
        rank=inp.rank,
        group=inp.group,
        dp_rank=inp.dp_rank,
        per_sample_s=center,
        per_sample_mad_s=mad(per, center),
        fixed_s=opt + intercept,
        marginal_s=slope,
        unit_s=unit,
        unit_mad_s=mad(units, unit),
        fixed_samples=fixed_samples,
        delay_s=inp.delay_per_step_s,
        compute_s=median([s.fwd_bwd_s + s.opt_s for s in usable]) + inp.delay_per_step_s,
        samples=usable[-1].samples,
        last_step=usable[-1].step,
        n=len(usable),
    )


def group_scores(figs: Iterable[RankFigures], mad_k: float, with_delay: bool = True) -> dict[int, tuple[float, bool]]:
    """rank -> (score, significant) within one peer group.

    Each rank's time at the group's even batch ``b`` is ``at_batch(b)`` (its own compute) and,
    ``with_delay``, also that times ``1 + delay rate`` (compute plus waiting for a CPU). A score is the
    fastest rank's time / this rank's; the rank's score is the lower of the two: a rank whose own
    compute is slow is slow however long everyone waits for a CPU (on an oversubscribed node that
    shared wait would dilute the comparison), and a rank that waits longer than the others for a
    CPU is slow even if its compute is not. ``significant`` when the rank's compute exceeds the
    fastest by more than ``mad_k`` pooled robust deviations, or its wait-included time does by more
    than that plus a quarter of the fastest's run delay (run delay is noisier than compute), and
    exceeds the median of its peers by as much: the fastest of several noisy medians sits below a
    typical rank by chance alone (more so the more ranks), so with three or more ranks a healthy rank
    beside one lucky fast peer is not significant; with two, the peer is the fastest.
    """
    figs = list(figs)
    if not figs:
        return {}
    even = sum(f.samples for f in figs) / len(figs)
    pooled = median([f.unit_mad_s * (even + f.fixed_samples) for f in figs]) * _MAD_TO_SIGMA
    own = {f.rank: f.at_batch(even) for f in figs}
    # Run delay as a rate (seconds waited per second of compute), carried to the even batch: a rank
    # that gets half a CPU waits as long as it computes whatever its batch, so migrating work off
    # it must not make it look recovered.
    waited = {f.rank: f.at_batch(even) * (1.0 + f.delay_s / max(f.at_batch(f.samples), 1e-9)) for f in figs}
    fast_own, fast_waited = min(own.values()), min(waited.values())
    fast_delay = min(f.delay_s for f in figs)
    out: dict[int, tuple[float, bool]] = {}
    for f in figs:
        peers = [g.rank for g in figs if g.rank != f.rank] or [f.rank]
        ref_own = max(fast_own, median([own[r] for r in peers]))
        ref_waited = max(fast_waited, median([waited[r] for r in peers]))
        s_own = fast_own / own[f.rank] if own[f.rank] > 0 else 1.0
        sig_own = own[f.rank] - ref_own > mad_k * pooled
        s_wait = fast_waited / waited[f.rank] if with_delay and waited[f.rank] > 0 else 1.0
        sig_wait = with_delay and waited[f.rank] - ref_waited > mad_k * pooled + 0.25 * fast_delay
        score, significant = min(((s_own, sig_own), (s_wait, sig_wait)), key=lambda c: c[0])
        out[f.rank] = (min(1.0, max(0.0, score)), significant)
    return out


class StragglerDetector:
    """Per-job detector; ``evaluate`` is called once per agent tick with every rank's recent steps."""

    def __init__(self, config: StragglerConfig) -> None:
        self.config = config
        self._tracks: dict[int, _Track] = {}
        self._evaluated_at = -1  # min last step over ranks at the previous evaluation
        self._fixed: dict[int, tuple[int, list[float]]] = {}  # peer group -> (widest spread, its fits)

    def fixed_samples(self, group: int) -> float:
        """The group's fixed forward+backward work in samples' worth (0: never fitted)."""
        kept = self._fixed.get(group)
        return median(kept[1]) if kept is not None else 0.0

    def _learn_fixed(self, group: int, parts: list[FixedPart]) -> None:
        """Keep the fits over the widest spread of batch sizes seen, and judge by their median. A
        migrated rank's window over its first move (16 -> 6 samples) fits the line well; later
        ones over 2 and 1 samples put a 5 % jitter into the slope and made a 15 samples' worth
        part 6 (a recovered rank on 1 sample then looked 1.7x slow for good). The windows of the
        few evaluations over one move each fit it; one of them alone said 7 to 13.5 for the same
        model on a loaded machine, and a part taken too small keeps a recovered rank looking slow."""
        best = max(parts, key=lambda p: p.spread)
        kept = self._fixed.get(group)
        widest = [p.samples for p in parts if p.spread == best.spread]
        if kept is None or best.spread > kept[0]:
            self._fixed[group] = (best.spread, widest)
        elif best.spread == kept[0]:
            kept[1].extend(widest)
            del kept[1][:-FIXED_FITS_KEPT]

    def state(self, rank: int) -> RankState:
        t = self._tracks.get(rank)
        return t.state if t is not None else RankState.WARMUP

    def score(self, rank: int) -> float:
        t = self._tracks.get(rank)
        return t.score if t is not None else 1.0

    def straggler_since(self, rank: int) -> float | None:
        t = self._tracks.get(rank)
        return t.since if t is not None else None

    def ranks(self) -> list[int]:
        return sorted(self._tracks)

    def judged_from(self, rank: int) -> int:
        """The first step of ``rank`` that counts (its warm-up after a start or restart excluded)."""
        t = self._tracks.get(rank)
        return (t.base_step or 0) + self.config.warmup_steps if t is not None else self.config.warmup_steps

    def forget(self, rank: int) -> None:
        self._tracks.pop(rank, None)

    def _move(self, rank: int, t: _Track, new: RankState, now: float, out: list[Transition]) -> None:
        if new == t.state:
            return
        if new not in _ALLOWED[t.state]:
            raise InvalidTransition(f"rank {rank}: {t.state.value} -> {new.value}")
        out.append(Transition(rank, t.state, new, t.score))
        if new == RankState.STRAGGLER and t.state in (RankState.HEALTHY, RankState.SUSPECT):
            t.since = now
        if new in (RankState.HEALTHY, RankState.WARMUP):
            t.since = None
        t.state = new
        t.count = 0

    def evaluate(self, inputs: Mapping[int, RankInput], now: float) -> Evaluation:
        cfg = self.config
        result = Evaluation()
        # Restarts: a rank whose steps went backwards starts its warm-up again.
        for rank, inp in inputs.items():
            t = self._tracks.setdefault(rank, _Track())
            if not inp.steps:
                continue
            first, last = inp.steps[0].step, inp.steps[-1].step
            new_attempt = t.base_step is not None and inp.attempt != t.attempt
            if t.base_step is None or last < t.last_step or new_attempt:
                if t.base_step is not None:
                    if t.state in (RankState.STRAGGLER, RankState.RECOVERING):
                        t.carried_since = t.since
                    self._move(rank, t, RankState.WARMUP, now, result.transitions)
                    self._evaluated_at = -1  # the steps started again: evaluations count from them
                # A new attempt's steps come alone (its first is where it began); steps that went
                # back within one attempt's window follow older ones, so the newest is where it began.
                t.base_step = first if t.base_step is None or new_attempt else last
            t.attempt = inp.attempt
            t.last_step = last
        lasts = [t.last_step for r, t in self._tracks.items() if r in inputs]
        if not lasts or min(lasts) - self._evaluated_at < cfg.eval_every_steps:
            return result
        self._evaluated_at = min(lasts)
        result.evaluated = True
        windows = {}
        for rank, inp in inputs.items():
            found = window_fit(inp, cfg.window, (self._tracks[rank].base_step or 0) + cfg.warmup_steps)
            if found is not None:
                windows[rank] = found
        latest: dict[int, list[int]] = {}
        for inp in inputs.values():
            if inp.steps:
                latest.setdefault(inp.group, []).append(inp.steps[-1].samples)
        even = {group: sum(sizes) / len(sizes) for group, sizes in latest.items()}
        fitted: dict[int, list[FixedPart]] = {}
        for rank, (usable, fit) in windows.items():
            inp = inputs[rank]
            part = fitted_fixed_part(usable, fit, even.get(inp.group, 0.0))
            if part is not None:
                fitted.setdefault(inp.group, []).append(part)
        # Kept after the sizes stop changing: a rank left on a small share is judged by it then.
        for group, parts in fitted.items():
            self._learn_fixed(group, parts)
        for rank, (usable, fit) in windows.items():
            inp = inputs[rank]
            result.figures[rank] = figures_for(inp, usable, fit, self.fixed_samples(inp.group))
        groups: dict[int, list[RankFigures]] = {}
        for fig in result.figures.values():
            groups.setdefault(fig.group, []).append(fig)
        for figs in groups.values():
            for rank, (score, significant) in group_scores(figs, cfg.mad_k, cfg.include_run_delay).items():
                result.scores[rank] = score
                self._step_state(rank, score, significant and len(figs) > 1, now, result.transitions)
        return result

    def _step_state(self, rank: int, score: float, significant: bool, now: float, out: list[Transition]) -> None:
        cfg = self.config
        t = self._tracks[rank]
        t.score = score
        slow = score < cfg.enter_score and significant
        well = score >= cfg.leave_score or not significant
        s = t.state
        if s == RankState.WARMUP:
            carried, t.carried_since = t.carried_since, None
            if carried is not None and not well:
                # Still slow after the restart: a straggler as before (same episode, same since).
                self._move(rank, t, RankState.STRAGGLER, now, out)
                t.since = carried
                return
            self._move(rank, t, RankState.HEALTHY, now, out)
            s = t.state
        if s in (RankState.HEALTHY, RankState.SUSPECT):
            if not slow:
                self._move(rank, t, RankState.HEALTHY, now, out)
                return
            if s == RankState.HEALTHY:
                self._move(rank, t, RankState.SUSPECT, now, out)
            t.count += 1
            if t.count >= cfg.enter_windows:
                self._move(rank, t, RankState.STRAGGLER, now, out)
        else:  # STRAGGLER or RECOVERING
            if not well:
                self._move(rank, t, RankState.STRAGGLER, now, out)
                return
            if s == RankState.STRAGGLER:
                self._move(rank, t, RankState.RECOVERING, now, out)
            t.count += 1
            if t.count >= cfg.leave_windows:
                self._move(rank, t, RankState.HEALTHY, now, out)
