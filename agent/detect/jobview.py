"""What the straggler service knows of a job: its parallel layout (from the spec, or guessed from
telemetry), its detection and migration state, and the evidence other nodes sent for their ranks."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from trainguard.agent.detect.causes import Evidence
from trainguard.agent.detect.straggler import StepSample, StragglerDetector
from trainguard.agent.heal.migration import MigrationPolicy
from trainguard.agent.wire import APPLIES_BATCH_SIZES, Telemetry

if TYPE_CHECKING:
    # Types only, a real cycle: the supervisor imports agent.detect.peerdiag, which loads this package first.
    from trainguard.agent.lifecycle.supervisor import Supervisor


@dataclass(frozen=True)
class Layout:
    dp: int
    tp: int
    pp: int
    microbatches: int
    global_batch: int | None
    known: bool
    """From the job's spec (True) or guessed from telemetry (False: dp only)."""

    def group(self, rank: int) -> int:
        """Peer-group key: the (pipeline stage, tensor position) a rank holds."""
        return (rank // (self.dp * self.tp)) * self.tp + rank % self.tp

    @property
    def quantum(self) -> int:
        return self.microbatches if self.pp > 1 else 1


CAUSE_RETRIES = 64
"""Evaluations after a detection that may still name an "unknown" straggler's cause."""


@dataclass
class _JobState:
    detector: StragglerDetector
    policy: MigrationPolicy
    causes: dict[int, str] = field(default_factory=dict)
    excluded: set[int] = field(default_factory=set)
    sizes: list[int] | None = None
    detections: Counter[str] = field(default_factory=Counter)
    migrations: int = 0
    cause_retries: Counter[int] = field(default_factory=Counter)
    applied_told: int = -1
    """The last migration plan version whose application the ranks' own telemetry was told for."""


def step_samples(messages: list[Telemetry]) -> list[StepSample]:
    """The detector's samples from a rank's messages: one per part (``Telemetry.part_rows``),
    times and samples per step."""
    return [StepSample(end, fwd_bwd_s, opt_s, round(samples / steps))
            for m in messages for end, steps, fwd_bwd_s, opt_s, samples, _ in m.part_rows()]


def current_attempt(views: Mapping[int, Any]) -> int | None:
    """The job's current attempt: that of the rank whose word came last (a rank of an older one has
    not reported in this one yet; a job submitted again under the name starts again at 0)."""
    if not views:
        return None
    return max(views.values(), key=lambda v: v.last_seen).attempt  # type: ignore[no-any-return]


def takes_batch_sizes(views: Mapping[int, Any]) -> bool:
    """Whether every rank declared that it applies the plan's batch sizes (``trainguard.init(applies=...)``)."""
    return bool(views) and all(v.applies is not None and v.applies & APPLIES_BATCH_SIZES for v in views.values())


def _layout(supervisor: Supervisor, job: str, views: Mapping[int, Any]) -> Layout:
    rec = supervisor.jobs.get(job)
    trainer = rec.spec.trainer if rec is not None else None
    if trainer:
        par = trainer.get("parallel", {}) or {}
        return Layout(int(par.get("dp", 1)), int(par.get("tp", 1)), int(par.get("pp", 1)),
                      int(par.get("microbatches", 2)), int(trainer.get("global_batch", 8)), True)
    dps = {v.dp_rank if v.dp_rank is not None else v.rank for v in views.values()}
    return Layout(max(1, len(dps)), 1, 1, 1, None, False)


REMOTE_EVIDENCE_TTL_S = 10.0
"""Evidence a node sent for its ranks counts this long (it comes every forward, ~0.25 s); older
evidence is unknown rather than stale."""


@dataclass(frozen=True)
class RemoteEvidence:
    node: str
    evidence: Evidence
    delay_per_step_s: float
    at: float
