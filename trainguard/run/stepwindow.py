"""Short steps gathered into one telemetry message.

A message per step costs a rank ~25 us of Python (the dataclass, its JSON) and the agent a decode
and a table entry; at a few milliseconds per step, on a node whose cores the ranks already fill,
that was most of what the API cost (bench/integration.py). Steps shorter than ``WINDOW_S`` are
therefore summed: one message per ``window_steps`` steps carries their means (times,
loss, gradient figures), their total samples and tokens, and ``steps``; a step that takes longer is
sent alone, as before.

Windows end where the step count is a multiple of their length, a power of two: ranks of one job
step in lockstep and so pick the same length, and where two ranks' lengths differ, the longer
window's ends are ends of the shorter one's too, so the agent still finds every rank's message for
the steps it compares (the controller matches ranks by step).

A message also carries its steps' compute times and loss in ``parts`` of at most ``PART_S`` each
(whole steps, ending where the step count is a multiple of the part's length, a power of two):
straggler detection judges a rank on the median of its last 16 samples and the controller calls a
loss divergent on the median of its last 3 points; each part is one sample and one point, as when a
message was at most ``PART_S`` long, so neither waits for that many messages nor sees a loss spike
averaged away.
"""

from __future__ import annotations

import math
from typing import Any

MAX_STEPS = 128
"""The most steps one message sums up."""
WINDOW_S = 0.25
"""Seconds of steps one message sums up at most (one step when a step takes longer). Each message
costs its rank ~0.1-0.2 ms of Python on a node whose cores the ranks fill (the dataclass, its
JSON: a message per 33 ms step was ~0.5 % of the step) and the agent a decode."""
PART_S = 0.05
"""Seconds of steps that one part of a message (one sample of straggler detection) spans at most
(one step when a step takes longer)."""
MAX_PARTS = 16
"""The most parts one message carries: a window that holds this many is sent."""

_MEAN_EXTRAS = ("flops_per_s", "mfu", "comm_bytes", "bubble_frac", "mem_frag", "compress_ratio", "update_cos",
                "traj_cos")
_LAST_EXTRAS = ("val_loss",)
EXTRAS = _MEAN_EXTRAS + _LAST_EXTRAS
"""Optional per-step figures a step may report (wire names)."""


def window_steps(step_s: float, flush_s: float) -> int:
    """Steps per message for steps of ``step_s`` seconds: the largest power of two of them that
    lasts at most ``flush_s`` (1 for a step as long as that), at most ``MAX_STEPS``."""
    if not step_s > 0:
        return 1
    fit = flush_s / step_s
    if fit < 2:
        return 1
    return min(MAX_STEPS, 1 << (int(fit).bit_length() - 1))


def window_length(step_s: float, flush_s: float) -> tuple[int, float, float]:
    """``window_steps(step_s, flush_s)`` and the step times (lo, hi] that give the same length (a
    step time outside works it out again)."""
    steps = window_steps(step_s, flush_s)
    if not step_s > 0:
        return steps, math.inf, -math.inf  # an empty span: the next step works it out again
    if steps == 1:
        return 1, flush_s / 2, math.inf
    if steps == MAX_STEPS:
        return steps, 0.0, flush_s / MAX_STEPS
    return steps, flush_s / (2 * steps), flush_s / steps


class StepWindow:
    """Sums of the steps since the last message."""

    __slots__ = ("steps", "step_s", "data_s", "fwd_bwd_s", "comm_s", "opt_s", "samples", "tokens", "loss_sum",
                 "loss_n", "bad_loss", "grad_sum", "grad_n", "gsq_sum", "gsq_n", "extras", "plan_version",
                 "last_step", "parts", "_part")

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self.steps = 0
        self.step_s = self.data_s = self.fwd_bwd_s = self.comm_s = self.opt_s = 0.0
        self.samples = self.tokens = 0
        self.loss_sum = self.grad_sum = self.gsq_sum = 0.0
        self.loss_n = self.grad_n = self.gsq_n = 0
        self.bad_loss: float | None = None
        self.extras: dict[str, list[float]] = {}
        self.plan_version = -1
        self.last_step = -1
        self.parts: list[list[Any]] = []
        """Closed parts: [steps, fwd_bwd_s sum, opt_s sum, samples, loss sum, losses, bad loss]."""
        self._part: list[Any] = _new_part()

    def add(self, step: int, step_s: float, times: tuple[float, float, float, float], samples: int, tokens: int,
            reported: dict[str, Any], plan_version: int, part_steps: int = 1) -> None:
        """One step: its number, seconds, (data, fwd_bwd, comm, opt) seconds (``Step.timings``),
        samples and tokens, what it reported; ``part_steps``: the length of the part it falls in
        (``window_steps`` for ``PART_S``). Runs after every step of every rank: few calls."""
        data_s, fwd_bwd_s, comm_s, opt_s = times
        part = self._part
        part[0] += 1
        part[1] += fwd_bwd_s
        part[2] += opt_s
        part[3] += samples
        loss = reported.get("loss") if reported else None
        if loss is not None:
            loss = loss if type(loss) is float else _number(loss)
        if loss is not None:
            if math.isfinite(loss):
                part[4] += loss
                part[5] += 1
                self.loss_sum += loss
                self.loss_n += 1
            else:
                part[6] = loss
                self.bad_loss = loss  # a diverged step is not averaged away
        if (step + 1) % part_steps == 0:
            self.parts.append(part)
            self._part = _new_part()
        self.steps += 1
        self.last_step = step
        self.step_s += step_s
        self.data_s += data_s
        self.fwd_bwd_s += fwd_bwd_s
        self.comm_s += comm_s
        self.opt_s += opt_s
        self.samples += samples
        self.tokens += tokens
        self.plan_version = plan_version
        if reported and len(reported) > ("loss" in reported) + ("lr" in reported):
            self._add_others(reported)

    def _add_others(self, reported: dict[str, Any]) -> None:
        """What a step reported besides its loss and LR."""
        grad = _number(reported.get("grad_norm"))
        if grad is not None:
            self.grad_sum += grad
            self.grad_n += 1
        gsq = _number(reported.get("local_grad_sq"))
        if gsq is not None:
            self.gsq_sum += gsq
            self.gsq_n += 1
        for name in EXTRAS:
            value = reported.get(name)
            if value is not None:
                self.extras.setdefault(name, []).append(value)

    @property
    def parts_full(self) -> bool:
        return len(self.parts) >= MAX_PARTS

    @property
    def has_loss(self) -> bool:
        return self.loss_n > 0 or self.bad_loss is not None

    def message_fields(self) -> dict[str, Any]:
        """The wire fields the window decides (means per step, totals, ``steps``)."""
        n = max(1, self.steps)
        out: dict[str, Any] = {
            "steps": n, "step_s": self.step_s / n, "data_s": self.data_s / n, "fwd_bwd_s": self.fwd_bwd_s / n,
            "comm_s": self.comm_s / n, "opt_s": self.opt_s / n, "samples": self.samples, "tokens": self.tokens,
            "loss": self.bad_loss if self.bad_loss is not None else (self.loss_sum / self.loss_n if self.loss_n else math.nan),
            "grad_norm": self.grad_sum / self.grad_n if self.grad_n else math.nan,
            "local_grad_sq": self.gsq_sum / self.gsq_n if self.gsq_n else math.nan,
        }
        for name, values in self.extras.items():
            if name in _LAST_EXTRAS:
                out[name] = values[-1]
                continue
            try:
                mean = sum(values) / len(values)
            except TypeError:
                continue  # not numbers: the wire would refuse them
            out[name] = round(mean) if all(isinstance(v, int) and not isinstance(v, bool) for v in values) else mean
        parts = self.parts + [self._part] if self._part[0] else self.parts
        if len(parts) > 1:  # one part is the message's own means
            out["parts"] = [[n, round(fwd / n, 7), round(opt / n, 7), int(samples),
                             bad if bad is not None else (loss / losses if losses else None)]
                            for n, fwd, opt, samples, loss, losses, bad in parts]
        return out


def _new_part() -> list[Any]:
    return [0, 0.0, 0.0, 0, 0.0, 0, None]


def _number(value: Any) -> float | None:
    if value is None:
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None
