"""A rank's own compute time per step, without the time it waited on its peers' collectives.

Straggler detection compares ranks by their compute. On the CPU a rank's thread CPU time is that
compute (a collective wait sleeps). On CUDA the host only sees wall time, and wall time up to
``torch.cuda.synchronize`` after ``backward()`` holds the gradient all-reduce: DDP and FSDP make the
compute stream wait for their last bucket at the end of backward, so in synchronous training the
fastest rank waits as long as the slowest computes and every rank looks equally slow.

What this module measures instead is the span, on the device's compute stream, from the start of
the step's compute to the moment its last gradient was accumulated (a post-accumulate-grad hook on
every parameter re-stamps one marker). That moment comes before DDP's end-of-backward wait and
FSDP's wait for its last reduce-scatter, and the bucket all-reduces during backward run on their
own stream, so the span is forward plus backward kernels only. On CUDA the stamps are CUDA events
recorded on the stream the hook runs on (read once per step, at its end, when the step's work is
done anyway); on the CPU they are the thread's CPU clock, the same code path with another clock.

Not excluded: a collective the compute stream itself waits for inside forward or backward (FSDP's
all-gathers when they are not prefetched in time, tensor-parallel all-reduces, pipeline sends and
receives). Those are exposed communication and count as the rank's time.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch


class Stamps(Protocol):
    """Two points on one clock: where the compute began and where its last gradient landed."""

    def begin(self) -> None: ...

    def mark(self) -> None: ...

    def elapsed_s(self) -> float | None:
        """Seconds from ``begin`` to the latest ``mark``; None when unmeasurable."""
        ...


class CudaStamps:
    """CUDA events on the current stream (the hook runs with the stream of the backward op)."""

    def __init__(self) -> None:
        self._begin = torch.cuda.Event(enable_timing=True)
        self._last = torch.cuda.Event(enable_timing=True)

    def begin(self) -> None:
        self._begin.record()

    def mark(self) -> None:
        # Re-recording one event keeps a step at two events however many parameters the model has.
        self._last.record()

    def elapsed_s(self) -> float | None:
        self._last.synchronize()
        return float(self._begin.elapsed_time(self._last)) / 1000.0


class ClockStamps:
    """A host clock read in the thread that began the step (thread CPU time on the CPU).

    A mark from another thread is not on that clock: the step is then unmeasured, never wrong."""

    def __init__(self, clock: Callable[[], float] = time.thread_time) -> None:
        self.clock = clock
        self._t0 = 0.0
        self._t1: float | None = None
        self._thread: int | None = None
        self._foreign = False

    def begin(self) -> None:
        self._thread = threading.get_ident()
        self._t0, self._t1, self._foreign = self.clock(), None, False

    def mark(self) -> None:
        if threading.get_ident() != self._thread:
            self._foreign = True
            return
        self._t1 = self.clock()

    def elapsed_s(self) -> float | None:
        if self._foreign or self._t1 is None:
            return None
        return max(0.0, self._t1 - self._t0)


class GradientClock:
    """Compute time of one step: from ``begin()`` to the last gradient accumulated since.

    ``watch(params)`` hooks the parameters once; ``begin()`` at the start of each step's compute;
    ``take()`` at the step's end returns the seconds (None when no gradient landed since
    ``begin``: a step without backward, or an unwatched model) and clears the step."""

    def __init__(self, stamps: Stamps) -> None:
        self.stamps = stamps
        self._began = False
        self._marked = False
        self._handles: list[Any] = []

    @classmethod
    def for_params(cls, params: Iterable[torch.nn.Parameter]) -> GradientClock:
        """A clock for the device the parameters live on, watching them."""
        params = [p for p in params if p.requires_grad]
        on_cuda = any(p.device.type == "cuda" for p in params)
        clock = cls(CudaStamps() if on_cuda else ClockStamps())
        clock.watch(params)
        return clock

    def watch(self, params: Iterable[torch.nn.Parameter]) -> int:
        """Hook every parameter that takes a gradient; returns how many were hooked."""
        n = 0
        for p in params:
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(self._on_grad))
                n += 1
        return n

    def _on_grad(self, _param: torch.Tensor) -> None:
        if self._began:
            self.stamps.mark()
            self._marked = True

    def begin(self) -> None:
        self.stamps.begin()
        self._began, self._marked = True, False

    def take(self) -> float | None:
        if not (self._began and self._marked):
            self._began = False
            return None
        self._began = False
        return self.stamps.elapsed_s()

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
