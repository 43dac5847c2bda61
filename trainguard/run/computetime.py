"""A rank's own compute time per step, without the time it waited on its peers' collectives.

Straggler detection compares ranks by their compute. On the CPU a rank's thread CPU time is that
compute (a collective wait sleeps). On CUDA the host only sees wall time, and wall time up to
``torch.cuda.synchronize`` after ``backward()`` holds the gradient all-reduce: DDP and FSDP make the
compute stream wait for their last bucket at the end of backward, so in synchronous training the
fastest rank waits as long as the slowest computes and every rank looks equally slow.

What this module measures instead is the span, on the device's compute stream, from the start of
the step's compute to the moment its last gradient was accumulated (a post-accumulate-grad hook
re-stamps one marker: on every parameter until one is seen to come last, then on that one,
``GradientClock``). That moment comes before DDP's end-of-backward wait and
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


LEARN_STEPS = 8
"""Steps in a row whose last gradient must land on the same parameter before only it is hooked."""
VERIFY_EVERY = 256
"""Steps between two checks, with every parameter hooked again for one step, that it still is."""


class GradientClock:
    """Compute time of one step: from ``begin()`` to the last gradient accumulated since.

    ``watch(params)`` hooks the parameters; ``begin()`` at the start of each step's compute;
    ``take()`` at the step's end returns the seconds (None when no gradient landed since
    ``begin``: a step without backward, or an unwatched model) and clears the step.

    A hook is a call from the autograd engine into Python (~5 us each on this CPU: a model of a
    hundred parameters pays half a millisecond per step). Backward runs the same graph in the same
    order step after step, so once the last gradient has landed on the same parameter ``LEARN_STEPS``
    steps in a row only that parameter stays hooked; every ``VERIFY_EVERY`` steps all are hooked for
    one step again to see that it still comes last, and a step on which it got no gradient at all
    hooks all of them again until one is last consistently (a graph that changes from step to step
    keeps every hook)."""

    def __init__(self, stamps: Stamps) -> None:
        self.stamps = stamps
        self._began = False
        self._marked = False
        self._params: dict[int, torch.nn.Parameter] = {}
        self._handles: dict[int, Any] = {}
        self._last = -1  # id of the parameter whose gradient landed last in this step
        self._candidate, self._streak = -1, 0
        self._narrowed_for = 0  # steps since only the candidate is hooked (0: all are)

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
            if p.requires_grad and id(p) not in self._params:
                self._params[id(p)] = p
                n += 1
        self._widen()
        return n

    @property
    def hooked(self) -> int:
        return len(self._handles)

    def _hook(self, key: int) -> None:
        if key not in self._handles:
            self._handles[key] = self._params[key].register_post_accumulate_grad_hook(self._on_grad)

    def _widen(self) -> None:
        for key in self._params:
            self._hook(key)
        self._narrowed_for = 0

    def _narrow(self, key: int) -> None:
        for other in [k for k in self._handles if k != key]:
            self._handles.pop(other).remove()
        self._narrowed_for = 1

    def _on_grad(self, param: torch.Tensor) -> None:
        if self._began:
            self.stamps.mark()
            self._marked = True
            self._last = id(param)

    def begin(self) -> None:
        self.stamps.begin()
        self._began, self._marked = True, False

    def take(self) -> float | None:
        if not (self._began and self._marked):
            self._began = False
            if self._narrowed_for:
                self._widen()  # the one hooked parameter got no gradient: the graph changed
                self._streak = 0
            return None
        self._began = False
        self._learn(self._last)
        return self.stamps.elapsed_s()

    def _learn(self, last: int) -> None:
        if self._narrowed_for:
            self._narrowed_for += 1
            if self._narrowed_for > VERIFY_EVERY:
                self._widen()  # one step with every hook, to see the same parameter come last
                self._streak = LEARN_STEPS - 1
            return
        self._streak = self._streak + 1 if last == self._candidate else 1
        self._candidate = last
        if self._streak >= LEARN_STEPS and len(self._handles) > 1:
            self._narrow(last)

    def close(self) -> None:
        for h in self._handles.values():
            h.remove()
        self._handles.clear()
        self._params.clear()
