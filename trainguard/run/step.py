"""One training step of one rank (``with run.step(i) as s:``): its phases, what it reports, and the
split of its time into data, compute, communication and optimizer."""

from __future__ import annotations

import sys
import time
from types import TracebackType
from typing import TYPE_CHECKING, Any

from trainguard.run.plan import RunPlan

if TYPE_CHECKING:
    from trainguard.run.run import Run

PHASES = ("data", "compute", "comm", "optim")
_CPU_PHASES = frozenset(("compute", "optim"))
"""Phases whose thread CPU time is read: only these count CPU time as the rank's own work (the
others count their wall time), and each read is a system call."""


def cuda_in_use() -> bool:
    torch = sys.modules.get("torch")
    return bool(torch is not None and getattr(torch, "cuda", None) is not None and torch.cuda.is_initialized())


class Step:
    """One training step of one rank: ``with run.step(i, samples=n) as s:``.

    Phases (``with s.phase("compute"):``) split the step's time. What straggler detection compares
    is the rank's own compute, not its waiting on peers: on the CPU the compute and optim phases
    count their thread's CPU time (a collective wait sleeps), the rest of their wall time counts as
    communication; an explicit ``comm`` phase is communication. Without phases, the whole step is
    measured that way. With ``run.watch_gradients(model.parameters())`` the compute is the span
    from the start of the compute phase (or of the step) to the step's last gradient, on the
    device's own clock: on CUDA that leaves out the gradient all-reduce wait that wall time holds
    (``trainguard.run.computetime``).
    """

    __slots__ = ("run", "step", "samples", "tokens", "wall", "cpu", "reported", "_t0", "_c0", "_phase")

    def __init__(self, run: Run, step: int, samples: int, tokens: int) -> None:
        self.run = run
        self.step = step
        self.samples = max(0, int(samples))
        self.tokens = max(0, int(tokens))
        self.wall: dict[str, float] = {}
        self.cpu: dict[str, float] = {}
        self.reported: dict[str, Any] = {}
        self._t0 = 0.0
        self._c0 = 0.0
        self._phase: tuple[str, float, float] | None = None

    @property
    def loss_weight(self) -> float:
        return self.run.plan.loss_weight

    def weighted(self, loss: Any) -> Any:
        """``loss * loss_weight``, for ``backward()``; the loss itself while the weight is 1 (an
        even split), so that the common case adds no multiply and no backward node to the step."""
        weight = self.run._view.loss_weight  # not through two properties: it runs every step
        return loss if weight == 1.0 else loss * weight

    @property
    def plan(self) -> RunPlan:
        return self.run.plan

    def __enter__(self) -> Step:
        run = self.run
        if not run._started:
            run._before_step(self)
        if run._grad_clock is not None:
            run._grad_clock.begin()
        self._t0 = time.perf_counter()
        self._c0 = time.thread_time()
        return self

    def _clock_begin(self, phase: str | None) -> None:
        clock = self.run._grad_clock
        if clock is not None and phase == "compute":
            clock.begin()

    def phase(self, name: str) -> _Phase:
        """``with s.phase("compute"):`` -- one of ``data``, ``compute``, ``comm``, ``optim``."""
        return _Phase(self, name)

    def switch(self, name: str | None) -> None:
        """End the running phase (if any) and start ``name`` (None: no phase). For code that sees
        a step only through hooks (framework callbacks), where a ``with`` block cannot span."""
        self._switch(name, time.perf_counter(), time.thread_time())

    def _switch(self, name: str | None, now: float, cpu: float) -> None:
        if self._phase is not None:
            running, t0, c0 = self._phase
            self.wall[running] = self.wall.get(running, 0.0) + now - t0
            if running in _CPU_PHASES:
                self.cpu[running] = self.cpu.get(running, 0.0) + cpu - c0
        self._phase = (name, now, cpu) if name is not None else None
        self._clock_begin(name)

    def report(self, loss: float | None = None, lr: float | None = None, grad_norm: float | None = None,
               **extra: Any) -> None:
        """Values of this step for the agent (loss, LR, gradient norm; optional wire fields such as
        ``val_loss``, ``mfu``, ``local_grad_sq``, ``comm_bytes``)."""
        if loss is not None:
            self.reported["loss"] = loss
        if lr is not None:
            self.reported["lr"] = lr
        if grad_norm is not None:
            self.reported["grad_norm"] = grad_norm
        self.reported.update(extra)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is not None:
            return  # a failing step is not reported, and no collective is entered after it
        now, cpu = time.perf_counter(), time.thread_time()
        if self._phase is not None:
            self._switch(None, now, cpu)
        self.run._after_step(self, now - self._t0, cpu - self._c0)

    # -- what the step measured ------------------------------------------------------------------

    def timings(self, step_s: float, step_cpu_s: float) -> dict[str, float]:
        """data_s, fwd_bwd_s, comm_s, opt_s as the wire carries them."""
        data, compute, comm, optim = self._times(step_s, step_cpu_s, not cuda_in_use())
        return {"data_s": data, "fwd_bwd_s": compute, "comm_s": comm, "opt_s": optim}

    def _times(self, step_s: float, step_cpu_s: float, by_cpu: bool) -> tuple[float, float, float, float]:
        """(data, compute, comm, optim) seconds; ``by_cpu``: compute and optim count thread CPU
        time (no CUDA in this process)."""
        wall, cpu = self.wall, self.cpu
        clock = self.run._grad_clock
        clocked = clock.take() if clock is not None else None
        if not wall:
            whole = min(step_cpu_s, step_s) if by_cpu else step_s
            if clocked is not None and not by_cpu:
                whole = min(clocked, step_s)  # the step's wall time holds the collective wait
            return 0.0, whole, max(0.0, step_s - whole), 0.0
        compute_w, optim_w = wall.get("compute", 0.0), wall.get("optim", 0.0)
        if by_cpu:
            compute, optim = min(cpu.get("compute", 0.0), compute_w), min(cpu.get("optim", 0.0), optim_w)
        else:
            compute, optim = compute_w, optim_w
        if clocked is not None and "compute" in wall:
            compute = min(clocked, compute_w)
        return wall.get("data", 0.0), compute, wall.get("comm", 0.0) + (compute_w - compute) + (optim_w - optim), optim


class _Phase:
    """A phase's ``with`` block: a class, not a generator, since it runs a few times every step
    (``contextlib.contextmanager`` costs ~3 us a use, most of a phase's cost)."""

    __slots__ = ("step", "name", "t0", "c0", "by_cpu")

    def __init__(self, step: Step, name: str) -> None:
        self.step = step
        self.name = name
        self.by_cpu = name in _CPU_PHASES

    def __enter__(self) -> None:
        if self.name == "compute":
            clock = self.step.run._grad_clock
            if clock is not None:
                clock.begin()
        self.t0 = time.perf_counter()
        if self.by_cpu:
            self.c0 = time.thread_time()

    def __exit__(self, *exc: object) -> None:
        step, name = self.step, self.name
        if self.by_cpu:
            c1 = time.thread_time()
            step.cpu[name] = step.cpu.get(name, 0.0) + c1 - self.c0
        step.wall[name] = step.wall.get(name, 0.0) + time.perf_counter() - self.t0
