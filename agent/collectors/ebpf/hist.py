"""Log2 latency histograms as the kernel programs keep them, and their Prometheus form.

The kernel side counts a latency of ``d`` microseconds in slot ``floor(log2(d))`` (slot 0 also
takes 0 and 1 µs), so slot ``i`` covers ``[2^i, 2^(i+1))`` µs, and keeps the exact sum in ns next
to the slots. Everything here is pure: no bcc, no clock.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from prometheus_client.utils import floatToGoString

NSLOTS = 32  # kernel slots (the last one also takes everything beyond it)
EXPORT_SLOTS = 25  # finite Prometheus buckets: le = 2 µs … 2^25 µs (33.6 s); beyond that only +Inf
MICROSECOND = 1e-6


@dataclass(frozen=True)
class Log2Hist:
    """Cumulative-since-attach log2 histogram of one series (node, rank or device)."""

    slots: tuple[int, ...] = (0,) * NSLOTS
    sum_ns: int = 0

    def __post_init__(self) -> None:
        if len(self.slots) != NSLOTS:
            raise ValueError(f"slots: want {NSLOTS} log2 slots, got {len(self.slots)}")

    @property
    def count(self) -> int:
        return sum(self.slots)

    @property
    def sum_s(self) -> float:
        return self.sum_ns * 1e-9

    def since(self, earlier: Log2Hist) -> Log2Hist:
        """What was added after ``earlier``; a histogram that went backwards was reset, so all of it."""
        if any(a < b for a, b in zip(self.slots, earlier.slots, strict=True)) or self.sum_ns < earlier.sum_ns:
            return self
        return Log2Hist(tuple(a - b for a, b in zip(self.slots, earlier.slots, strict=True)),
                        self.sum_ns - earlier.sum_ns)

    def __add__(self, other: Log2Hist) -> Log2Hist:
        return Log2Hist(tuple(a + b for a, b in zip(self.slots, other.slots, strict=True)),
                        self.sum_ns + other.sum_ns)


def slot_upper_s(slot: int, unit_s: float = MICROSECOND) -> float:
    """Upper bound (exclusive) of a log2 slot in seconds: slot i covers [2^i, 2^(i+1)) units."""
    return float(2 ** (slot + 1)) * unit_s


def log2_buckets(slots: Sequence[int], unit_s: float = MICROSECOND,
                 finite: int = EXPORT_SLOTS) -> list[tuple[str, float]]:
    """Log2 slot counts -> cumulative Prometheus buckets ``[(le, count), ..., ("+Inf", total)]``.

    Always the same ``finite`` bucket bounds, whatever the data, so series stay comparable across
    scrapes and nodes; counts in slots at or beyond ``finite`` show up only in ``+Inf``.

    >>> log2_buckets([3, 0, 2], finite=3)
    [('2e-06', 3.0), ('4e-06', 3.0), ('8e-06', 5.0), ('+Inf', 5.0)]
    """
    if finite < 1:
        raise ValueError("finite: need at least one finite bucket")
    if any(c < 0 for c in slots):
        raise ValueError("slots: counts must be >= 0")
    out: list[tuple[str, float]] = []
    running = 0
    for i in range(finite):
        running += slots[i] if i < len(slots) else 0
        out.append((floatToGoString(slot_upper_s(i, unit_s)), float(running)))
    out.append(("+Inf", float(sum(slots))))
    return out


def log2_quantile(slots: Sequence[int], q: float, unit_s: float = MICROSECOND) -> float:
    """Estimate the q-quantile (seconds) by linear interpolation inside the slot that holds it,
    as Prometheus' histogram_quantile does; NaN when there are no samples.

    >>> log2_quantile([0, 0, 4], 0.5)  # all samples in [4, 8) µs -> the middle, 6 µs
    6e-06
    """
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q: quantile must be in [0, 1], got {q}")
    total = sum(slots)
    if total == 0:
        return math.nan
    target = q * total
    running = 0
    for i, c in enumerate(slots):
        if c and running + c >= target:
            lo = 0.0 if i == 0 else float(2**i)
            hi = float(2 ** (i + 1))
            frac = (target - running) / c
            return (lo + (hi - lo) * frac) * unit_s
        running += c
    return float(2 ** len(slots)) * unit_s
