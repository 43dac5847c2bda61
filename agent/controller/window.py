"""A job's control windows and what the controller keeps per job: the steps a window scored,
the settings in force and tried, and the helpers that turn them into plans and events
(``trainguard.agent.controller.controller`` runs them)."""

from __future__ import annotations

import math
import zlib
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any

from trainguard.agent.controller.evidence_plan import EvidenceDriver
from trainguard.agent.controller.noise import NoiseScale
from trainguard.agent.controller.strategy import Setting, Space, Strategy, WindowResult
from trainguard.agent.wire import Telemetry


def by_part(m: Telemetry) -> list[Telemetry]:
    """A message as the parts it carries (``trainguard.run.stepwindow``), each a message of its own
    steps, compute, samples and loss, ending when its last step ended; the other figures (gradient
    norms, noise scale inputs, plan) the message's. Other ranks' messages are matched by step, so
    only the last part meets them."""
    if not m.parts:
        return [m]
    return [replace(m, step=end, steps=steps, fwd_bwd_s=fwd_bwd_s, opt_s=opt_s, samples=samples,
                    loss=m.loss if loss is None else loss, has_loss=loss is not None or m.has_loss, parts=None,
                    wall_time=m.wall_time - (m.step - end) * m.step_s)
            for end, steps, fwd_bwd_s, opt_s, samples, loss in m.part_rows()]


@dataclass(frozen=True)
class StepPoint:
    step: int
    elapsed: float
    loss: float
    samples: int
    plan_version: int
    step_s: float
    fixed_s: float
    per_sample_s: float
    steps: int = 1
    """Steps the point stands for (a rank may send short steps gathered, ``Telemetry.steps``)."""


@dataclass
class Window:
    setting: Setting
    version: int
    ref_loss: float | None
    recovery: bool = False
    """After a rollback or rescale: run but not scored (the loss is recovering from something else)."""
    guarded: bool = False
    """Set by the LR guard, not the strategy: a good setting once it completes, but not the
    strategy's to learn from (it did not propose it)."""
    points: list[StepPoint] = field(default_factory=list)
    aligns: list[float] = field(default_factory=list)
    """The leader's update_cos of the window's steps (where the ranks send it)."""


@dataclass
class JobControl:
    job: str
    space: Space
    strategy: Strategy
    dp: int
    current: Setting
    good: Setting
    noise: NoiseScale
    known_version: int = 0
    """Newest plan version the controller wrote or has taken into account."""
    last_step: int = -1
    origin: float | None = None
    window: Window | None = None
    recent: deque[float] = field(default_factory=lambda: deque(maxlen=16))
    decisions: int = 0
    objective: float | None = None
    history: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=256))
    warmup_aligns: list[float] = field(default_factory=list)
    """update_cos of the warm-up's second half: the LR guard's first look."""
    evidence: EvidenceDriver | None = None
    """strategy evidence: the job's evidence controller (None until its plan went out)."""


def split_batch(total: int, dp: int, unit: int, weights: list[int] | None) -> list[int]:
    """``total`` samples over ``dp`` ranks in multiples of ``unit``, in proportion to ``weights``
    (the current per-rank sizes, so a shard migration's balance survives a batch change), else even.

    >>> split_batch(12, 2, 1, None), split_batch(12, 2, 1, [3, 1]), split_batch(8, 2, 2, [1, 1])
    ([6, 6], [9, 3], [4, 4])
    """
    units = total // unit
    if not weights or len(weights) != dp or sum(weights) <= 0:
        weights = [1] * dp
    wsum = sum(weights)
    raw = [units * w / wsum for w in weights]
    out = [int(math.floor(r)) for r in raw]
    for i in sorted(range(dp), key=lambda i: raw[i] - out[i], reverse=True)[: units - sum(out)]:
        out[i] += 1
    # Every rank keeps at least one unit when there are enough, so none idles by rounding.
    for i in range(dp):
        if out[i] == 0 and units >= dp:
            j = max(range(dp), key=lambda k: out[k])
            out[j] -= 1
            out[i] += 1
    return [u * unit for u in out]


def strategy_seed(seed: int, job: str, attempt: int) -> int:
    """The strategies' seed: ``seed`` where set, else one drawn from the job and its attempt, so
    jobs and restarts do not all explore alike.

    >>> strategy_seed(7, "j", 0), strategy_seed(0, "j", 0) == strategy_seed(0, "j", 0)
    (7, True)
    """
    if seed:
        return seed
    return zlib.crc32(f"{job}:{attempt}".encode()) & 0x7FFFFFFF


def decision_fields(result: WindowResult | None, inputs: dict[str, Any]) -> dict[str, Any]:
    """The event fields of a decision taken at the end of ``result``'s window."""
    objective = None if result is None or not math.isfinite(result.objective) else result.objective
    return {"window": [result.start_step, result.end_step] if result else None, "objective": objective,
            "inputs": inputs}
