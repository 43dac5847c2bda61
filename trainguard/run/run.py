"""The public API a training script uses: ``trainguard.init()`` and the ``Run`` it returns.

A ``Run`` reports per-step telemetry to the node agent (fire-and-forget; steps shorter than the
link's flush interval gathered into one message, ``trainguard.run.stepwindow``), applies
the agent's plan (LR, this rank's batch size, checkpoint-now, stop) at the same step on every
rank, saves checkpoints into the agent's memory tier when they are due, and restores the one the
agent picked after a restart. With no agent every call is a cheap no-op that never raises into
training: ``restore`` returns 0, ``checkpoint`` does nothing, ``plan`` stays the default.

This module imports no torch (the agent imports the package); the parts that need it live in
``trainguard.checkpoint.tier`` and ``trainguard.run.plansync`` and are imported when first used.
"""

from __future__ import annotations

import atexit
import gc
import json
import math
import os
import resource
import statistics
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from trainguard.agent.batch_rule import follow_batch
from trainguard.agent.wire import (
    APPLIES_ALL,
    APPLIES_BATCH_SIZES,
    APPLIES_LR,
    ENV_STARTED_AT,
    Plan,
    Telemetry,
    applies_mask,
)
from trainguard.run import rendezvous_clock
from trainguard.run.environment import SNAPSHOT_AUTO, RunEnvironment
from trainguard.run.link import PlanWatcher, TelemetrySender
from trainguard.run.stepwindow import PART_S, WINDOW_S, StepWindow, window_length

PHASES = ("data", "compute", "comm", "optim")
_CPU_PHASES = frozenset(("compute", "optim"))
"""Phases whose thread CPU time is read: only these count CPU time as the rank's own work (the
others count their wall time), and each read is a system call."""


@dataclass(frozen=True)
class RunPlan:
    """The agent's plan as one rank sees it (every rank sees the same version at the same step)."""

    version: int = 0
    lr_scale: float = 1.0
    lr: float | None = None
    """An absolute LR that replaces the script's own (None: scale the script's by ``lr_scale``)."""
    batch_size: int | None = None
    """This rank's samples per step (None: the script's own)."""
    batch_sizes: tuple[int, ...] | None = None
    """Samples per step of every data-parallel rank (None: the script's even split)."""
    loss_weight: float = 1.0
    """Multiply the mean loss by this before ``backward()``: keeps the averaged gradient exact
    when ranks have uneven batches (dp x this rank's batch / global batch)."""
    checkpoint_now: bool = False
    stop: bool = False
    reason: str = ""

    def lr_for(self, base_lr: float) -> float:
        """The LR to use given the script's own schedule value ``base_lr``."""
        return float(self.lr) if self.lr is not None else base_lr * self.lr_scale


def _cuda_in_use() -> bool:
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
        data, compute, comm, optim = self._times(step_s, step_cpu_s, not _cuda_in_use())
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


def _finite(value: Any, default: float) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return default
    return number


SNAPSHOT_COST_WINDOW = 25
"""Snapshots whose cost the automatic interval takes the median of. With 9, a cost whose median
was 0.94-0.97 % of the step (the recovery bench's job, BENCHMARKS.md) had a median of 9 above 1 %
often enough to snapshot every 2 steps for 28-40 % of a run."""

SNAPSHOT_CLEARLY_OVER = 4.0
"""Times the budget (1 % of the step) a median cost must reach to move the interval before the
window is full: a state whose snapshot costs a large part of a step should not take 25 of them."""

SNAPSHOT_COLD_TAKES = 3
"""An attempt's first snapshots whose cost the interval does not go by: each of the two slots' first
fill maps and touches its pages (2.3-6.4 ms against 0.3 ms after, on the recovery bench's job),
and with the copy overlapped a cost is read one snapshot late."""

SNAPSHOT_EARLY_MIN = 5
"""Costs the median of which may widen the interval before the window is full (when clearly over
the budget). The median of the first one to three once said 15-34 % of the step, which set every
16 steps; the 0.3 ms costs after it could not narrow it back before the window was full (200-400
steps), and a kill in that time lost up to 16 steps."""

SNAPSHOT_WIDEN_OVER = 1.25
"""Times the budget a median cost must reach at the interval in force to widen it: a wider interval
costs a crash more steps, and a cost near the budget moves with the node's load. On the recovery
bench's 4 ranks on 2 cores snapshots every 2 steps cost 0.95-1.1 % of the step, and the interval
went to 4 for part of a run, where a kill lost 2 steps (BENCHMARKS.md)."""


class Run:
    """One rank's handle on trainguard (see the module docstring). Build it with ``init()``."""

    def __init__(self, env: RunEnvironment, *, dp_rank: int | None = None, dp_size: int | None = None,
                 batch_size: int | None = None, telemetry: TelemetrySender | None = None,
                 plans: PlanWatcher | None = None, plan_every: int = 4, applies: int | None = None,
                 init_at: float | None = None) -> None:
        self.env = env
        self.dp_rank = env.rank if dp_rank is None else dp_rank
        self.dp_size = env.world_size if dp_size is None else dp_size
        self.default_batch_size = batch_size
        self.applies = default_applies(batch_size) if applies is None else applies
        """What of the plan this rank applies (``wire.APPLIES_*`` bits), told to the agent with every
        message: it moves samples only between ranks that take batch sizes."""
        self.plan_every = plan_every
        self.telemetry = telemetry if telemetry is not None else TelemetrySender(env.socket or None)
        self.plans = plans if plans is not None else PlanWatcher(env.plan_path or None)
        self._plan = Plan()
        self._kept_batch: tuple[int, ...] | None = None
        """Per-rank batch sizes that keep the global batch of a checkpoint saved at another
        data-parallel degree (a node lost or joined), until a plan gives sizes for this one."""
        self._batch_lr = 1.0
        """The LR factor of a global batch that changed with the world, for ranks that take no
        batch sizes (``lr_batch_rule``), carried in the checkpoints after it."""
        self._ckpt_id_seen = 0
        self._meta_cache: tuple[Plan, int, dict[str, Any]] | None = None
        self._view = self._make_view(self._plan)
        self._sync: Any = None  # trainguard.run.plansync.PlanSync once torch.distributed is up
        self._writer: Any = None  # trainguard.checkpoint.tier.TierWriter on first use
        self._started = False
        self.last_step = -1
        self.checkpoint_failures = 0
        self._failures_waited = 0
        self.last_checkpoint: str | None = None
        self._failed_save: tuple[int, str] | None = None
        self._grad_clock: Any = None  # trainguard.run.computetime.GradientClock after watch_gradients()
        self._snapshots: Any = None  # trainguard.checkpoint.snapshot.writer.SnapshotWriter on first use
        auto = env.snapshot_every == SNAPSHOT_AUTO
        self.snapshot_every = (env.snapshot_every if env.snapshot_every > 0 else int(auto)) if env.snapshot_dir else 0
        """Steps between snapshots now (0: none); tuned from the measured stall when automatic."""
        self._snapshot_wish = self.snapshot_every  # what this rank's stalls ask for (rank 0's is agreed)
        self._stall_ratios: list[float] = []
        self._snapshot_cost_scale = 1.0
        """``trainguard.checkpoint.snapshot.cost.cost_scale`` of this node, set with the first snapshot."""
        self._last_step_s = 0.0
        self.restored_from = ""
        """What ``restore`` loaded: "snapshot", "checkpoint" or "" (nothing)."""
        self._restore_span: tuple[float, float] | None = None
        self._started_at: float | None = None
        self._init_at = time.time() if init_at is None else init_at
        """When the script entered ``trainguard.init``: its start-up ends there at the latest."""
        self._timeline_sends = 5  # the first datagrams carry the attempt's start-up times (one may drop)
        self._window = StepWindow()
        self._window_steps = 1
        self._part_steps = 1
        self._lengths_hold = (0.0, 0.0)
        """Step times (lo, hi] for which both lengths above stay what they are (``_relength``)."""
        self._step_s_avg = 0.0
        self._by_cpu = True
        """No CUDA in this process: compute and optim count thread CPU time. Looked at when a
        message goes (a CUDA context is made before training, and is never torn down)."""
        self._last_reported: dict[str, Any] = {}
        self._last_samples = 0
        if self.telemetry.path:
            self._pid = os.getpid()
            atexit.register(self._flush_at_exit)  # a script that never calls close() keeps its last steps

    # -- identity ----------------------------------------------------------------------------------

    @property
    def job(self) -> str:
        return self.env.job

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def restart_count(self) -> int:
        return self.env.attempt

    @property
    def has_agent(self) -> bool:
        return self.env.has_agent

    # -- the plan ----------------------------------------------------------------------------------

    @property
    def plan(self) -> RunPlan:
        return self._view

    @property
    def raw_plan(self) -> Plan:
        """The wire-level plan in force (for adapters that need every field)."""
        return self._plan

    def _make_view(self, plan: Plan) -> RunPlan:
        sizes = plan.batch_sizes
        mine = self.default_batch_size
        weight = 1.0
        if sizes is not None and len(sizes) == self.dp_size and 0 <= self.dp_rank < len(sizes) and sum(sizes) > 0:
            mine = sizes[self.dp_rank]
            weight = self.dp_size * mine / sum(sizes)
        elif self._kept_batch is not None:
            sizes = list(self._kept_batch)  # no split for this world size: the restored global batch, kept
            mine = self._kept_batch[self.dp_rank]
            weight = self.dp_size * mine / sum(self._kept_batch)
        elif sizes is not None:
            sizes = None  # a split for another world size (the job shrank): the script's own
        return RunPlan(version=plan.version, lr_scale=plan.lr_scale * self._batch_lr, lr=plan.lr, batch_size=mine,
                       batch_sizes=tuple(sizes) if sizes is not None else None, loss_weight=weight,
                       checkpoint_now=plan.checkpoint_id > self._ckpt_id_seen, stop=plan.stop, reason=plan.reason)

    def _apply(self, plan: Plan) -> None:
        self._plan = plan
        self._view = self._make_view(plan)

    def _plan_sync(self) -> Any:
        """The cross-rank plan synchroniser, once torch.distributed is initialised (else None)."""
        if self._sync is not None or self.env.world_size <= 1 or not self.plans.path:
            return self._sync  # with no agent's plan to read every rank keeps the one it has: nothing to agree
        dist = sys.modules.get("torch.distributed")
        if dist is None or not dist.is_available() or not dist.is_initialized():
            return None
        # Imported here, not at the top: it imports torch, which the agent never loads.
        from trainguard.run.plansync import PlanSync

        self._sync = PlanSync(self.plans, is_leader=self.env.rank == 0, attempt=self.env.attempt, every=self.plan_every)
        return self._sync

    def _start(self) -> None:
        """First step: every rank starts from rank 0's view of the agent's plan (or the one the
        checkpoint carried, when the agent's is not newer)."""
        self._started = True
        self._by_cpu = not _cuda_in_use()
        sync = self._plan_sync()
        polled = sync.initial(self._snapshot_wish) if sync is not None else self.plans.poll()
        if polled is not None and polled.version >= self._plan.version:
            self._apply(polled)

    def _before_step(self, step: Step) -> None:
        if not self._started:
            try:
                self._start()
            except Exception as exc:  # noqa: BLE001 - the agent's plan is an extra, never a failure
                self._warn(f"plan sync unavailable: {exc}")

    def _after_step(self, step: Step, step_s: float, step_cpu_s: float) -> None:
        # Every step of every rank runs this: it is kept to few calls and lookups (a call costs
        # several times its hot-loop figure between a real step's kernels; bench/BENCHMARKS.md).
        self.last_step = step.step
        self._last_step_s = step_s
        if self.telemetry.path:
            self._send(step, step_s, step_cpu_s)
        sync = self._sync
        try:
            if sync is None:
                sync = self._plan_sync()
            newer = sync.after_step(step_s, self._snapshot_wish) if sync is not None else self.plans.poll()
        except Exception as exc:  # noqa: BLE001
            self._warn(f"plan sync failed, plans are no longer applied: {exc}")
            self._sync = _Disabled()
            return
        agreed = sync.snapshot_every if sync is not None else 0
        if agreed > 0 and self.snapshot_every > 0 and self.env.snapshot_every == SNAPSHOT_AUTO:
            self.snapshot_every = agreed
        if newer is not None and newer.version > self._plan.version:
            self._apply(newer)

    def _send(self, step: Step, step_s: float, step_cpu_s: float) -> None:
        r = step.reported
        window = self._window
        if window.steps and window.plan_version != self._plan.version:
            self._flush_window()  # one message, one plan: the agent tells a change's effect by version
        window.add(step.step, step_s, step._times(step_s, step_cpu_s, self._by_cpu), step.samples, step.tokens, r,
                   self._plan.version, self._part_steps)
        self._last_reported = r
        self._last_samples = step.samples
        avg = self._step_s_avg = step_s if self._step_s_avg <= 0 else 0.8 * self._step_s_avg + 0.2 * step_s
        # A long step shortens the window at once; short ones lengthen it as the average follows.
        slowest = avg if avg > step_s else step_s
        lo, hi = self._lengths_hold
        if not lo < slowest <= hi:
            self._relength(slowest)
        # Sent at once: the start-up timeline (the recovery clock stops at the first step), a failed
        # save (its alert), a loss gone bad; other windows' messages wait for the link's next send.
        urgent = self._timeline_sends > 0 or self._failed_save is not None or window.bad_loss is not None
        # Only where the step count is a multiple of the window's length, also when a slow step just
        # shortened it: a window cut at once where it stood ended off the multiples that the other
        # ranks' windows end at (the agent compares ranks at those steps), and the next multiple of
        # the shorter length comes within it, so no window outgrows the longer one it started as.
        # (Or when its parts fill the message: steps that slowed within one long window.)
        if urgent or (step.step + 1) % self._window_steps == 0 or window.parts_full:
            self._flush_window(urgent)

    def _relength(self, step_s: float) -> None:
        """The window's and a part's lengths in steps for steps of ``step_s`` seconds, and the
        step times for which both stay the same (so that most steps need not work them out)."""
        self._window_steps, w_lo, w_hi = window_length(step_s, WINDOW_S)
        self._part_steps, p_lo, p_hi = window_length(step_s, PART_S)
        self._lengths_hold = (max(w_lo, p_lo), min(w_hi, p_hi))

    def _flush_at_exit(self) -> None:
        if os.getpid() == self._pid:  # not in a child forked from this rank that exits through atexit
            self._flush_window(urgent=True)
            if self._writer is not None:
                self._writer.settle(block=True)  # a save still being agreed goes to the writer, which outlives the rank

    def _flush_window(self, urgent: bool = False) -> None:
        """End the window: the steps gathered since the last message become one (nothing when there
        are none), sent with the link's next datagram, or at once when ``urgent``."""
        window = self._window
        self._by_cpu = not _cuda_in_use()
        if not window.steps or not self.telemetry.path:
            return
        r = self._last_reported
        optional = {k: v for k, v in window.message_fields().items() if v is not None}
        lr = _finite(r.get("lr"), 0.0)
        try:
            msg = Telemetry(
                job=self.env.job, rank=self.env.rank, local_rank=self.env.local_rank, pid=os.getpid(),
                step=max(0, window.last_step + 1), wall_time=time.time(), lr=lr if math.isfinite(lr) and 0 <= lr <= 1e3 else 0.0,
                batch_size=self._last_samples, mem_bytes=int(r.get("mem_bytes") or _rss_bytes()),
                plan_version=window.plan_version, dp_rank=self.dp_rank, world_size=self.env.world_size,
                has_loss=window.has_loss, attempt=self.env.attempt, applies=self.applies,
                ckpt_failed=self._failed_save[0] if self._failed_save else None,
                ckpt_error=self._failed_save[1] if self._failed_save else None, **optional,
                **self._timeline(window.last_step + 1, window.steps))
        except (TypeError, ValueError):
            self.telemetry.stats.dropped += 1
            window.clear()
            return
        window.clear()
        if self.telemetry.send(msg, urgent=urgent):
            self._failed_save = None

    def _timeline(self, end: int, steps: int) -> dict[str, Any]:
        """Start-up and snapshot times for a message of ``steps`` steps that ends at step count ``end``."""
        out: dict[str, Any] = {}
        if self._snapshots is not None and self._snapshots.stats.last_step > end - steps:
            out["snapshot_s"] = self._snapshots.stats.last_stall_s  # the window's last snapshot
        if self._timeline_sends <= 0:
            return out
        self._timeline_sends -= 1
        if self._started_at is None:
            self._started_at = _process_start() or 0.0
        started = self._started_at or None
        if started is not None:
            out["proc_start"] = started
        out["init_at"] = self._init_at
        rendezvous = rendezvous_clock.span()
        if rendezvous is not None:
            out["rdzv_begin"], out["group_ready"] = rendezvous
        if self._restore_span is not None:
            out["restore_begin"], out["restore_end"] = self._restore_span
        return out

    # -- steps -------------------------------------------------------------------------------------

    def watch_gradients(self, params: Any, clock: Any = None) -> None:
        """Measure each step's compute up to its last gradient on the device's own clock (CUDA
        events on a GPU), so that the collective wait at the end of backward is not counted as this
        rank's compute: without it, on CUDA every rank of a synchronous job looks as slow as the
        slowest. ``params``: the model's parameters; ``clock``: a ``GradientClock`` to use instead.
        Parameters on the CPU get no clock: there a phase's thread CPU time already leaves the
        collective wait out (a wait sleeps), and a gradient hook would cost each step ~14 us of
        the same figure (bench/BENCHMARKS.md, integration)."""
        if self._grad_clock is not None:
            self._grad_clock.close()
            self._grad_clock = None
        if clock is None:
            params = [p for p in params if p.requires_grad]
            if not any(p.device.type == "cuda" for p in params):
                return
            # Imported here: it needs torch, which the agent (importing this package) must not load.
            from trainguard.run.computetime import GradientClock

            clock = GradientClock.for_params(params)
        else:
            clock.watch(params)
        self._grad_clock = clock

    def step(self, step: int, samples: int = 0, tokens: int = 0) -> Step:
        """Context manager around one training step (``step`` counts from 0; the agent sees steps
        done, ``step + 1``, the same count a checkpoint taken after this step carries)."""
        return Step(self, step, samples, tokens)

    # -- checkpoints -------------------------------------------------------------------------------

    def _tier_writer(self) -> Any:
        if self._writer is None and self.env.memory_root:
            # Imported here: torch and DCP are needed only by a run that checkpoints.
            from trainguard.checkpoint.tier import TierWriter

            self._writer = TierWriter(self.env)
        return self._writer

    def checkpoint_due(self, step: int) -> bool:
        """Whether ``checkpoint(step, ...)`` would save (same answer on every rank)."""
        if not self.env.memory_root:
            return False
        return (step + 1) % self.env.memory_every == 0 or self._view.checkpoint_now

    def checkpoint(self, step: int, state: Mapping[str, Any]) -> bool:
        """After step ``step`` (counting from 0) is done: snapshot ``state`` into this rank's shared
        memory when a snapshot is due (every step by default, wider where that costs over 1% of the
        step: ``_tune_snapshots``; ``trainguard.checkpoint.snapshot.writer``: no collective),
        and save it into the memory tier when that is due (every ``memory_every`` steps, or when the
        plan asks; collective: every rank calls it). Objects with ``state_dict``/``load_state_dict``
        (models, optimizers, schedulers) and plain values are saved; a failed save is skipped and
        reported, never raised. Returns True when either was written or handed to the background
        writer (the memory-tier save of a rank writing alone is committed shortly after; one that
        fails there is reported like any other: ``wait_checkpoint``)."""
        snapped = self.snapshot_due(step) and self._snapshot(step, state)
        if self._writer is not None:
            self._background_failures(self._writer.poll())
        if not self.checkpoint_due(step):
            return snapped
        writer = self._tier_writer()
        self._ckpt_id_seen = max(self._ckpt_id_seen, self._plan.checkpoint_id)
        self._view = self._make_view(self._plan)
        # Only while snapshots cover a crash in the steps before a save reaches rank 0's writer do
        # the ranks agree on it while they train on (``TierWriter._agree_later``).
        path = writer.save(step + 1, state, self.checkpoint_meta(),
                           agree_later=self.snapshot_every > 0 and self._snapshots is not None)
        self._background_failures(writer.poll())
        if path is None:
            self._background_failures([(step + 1, writer.stats.last_error)])
            return snapped
        self.last_checkpoint = path
        return True

    def wait_checkpoint(self, timeout: float = 120.0) -> bool:
        """Wait until the memory-tier save in flight is committed (``close`` does it too); False
        when a save failed since the last call or did not finish in ``timeout`` seconds."""
        finished = self._writer is None or self._writer.wait(timeout)
        if self._writer is not None:
            self._background_failures(self._writer.poll())
        fresh = self.checkpoint_failures > self._failures_waited
        self._failures_waited = self.checkpoint_failures
        return finished and not fresh

    def _background_failures(self, failed: list[tuple[int, str]]) -> None:
        for label, error in failed:
            self.checkpoint_failures += 1
            # The next step's telemetry tells the agent (checkpoint_write_failed, and its alert).
            self._failed_save = (label, error[:300])

    def snapshot_due(self, step: int) -> bool:
        return self.snapshot_every > 0 and (step + 1) % self.snapshot_every == 0

    @property
    def snapshot_stats(self) -> Any:
        """``trainguard.checkpoint.snapshot.writer.SnapshotStats`` of this rank (None before the first snapshot)."""
        return self._snapshots.stats if self._snapshots is not None else None

    def _snapshot(self, step: int, state: Mapping[str, Any]) -> bool:
        """Take the snapshot that is due after ``step``."""
        # Imported here: torch is needed only by a run that checkpoints.
        from trainguard.checkpoint.snapshot.cost import cost_scale, overlap_pays, usable_cpus
        from trainguard.checkpoint.snapshot.errors import SnapshotError
        from trainguard.checkpoint.snapshot.writer import SnapshotWriter

        try:
            if self._snapshots is None:
                # Replicas share their common tensors out only where every slot is on this node.
                one_node = not self.env.part and self.env.local_world_size == self.env.world_size
                cpus = usable_cpus()  # the affinity mask and the cgroup files, read once for both
                self._snapshots = SnapshotWriter(self.env.snapshot_dir, self.env.rank, self.env.world_size,
                                                 self.env.attempt, share=one_node,
                                                 overlap=overlap_pays(self.env.local_world_size, cpus=cpus))
                self._snapshot_cost_scale = cost_scale(self.env.local_world_size, cpus=cpus)
            self._snapshots.take(step + 1, state, self.checkpoint_meta())
            taken = self._snapshots.stats.taken
            if taken == 1:
                self._snapshots.check_restorable()
            if taken <= SNAPSHOT_COLD_TAKES:
                return True
        except (SnapshotError, OSError) as exc:
            self.snapshot_every = 0
            self._warn(f"per-step snapshots off for this attempt (DCP checkpoints go on): {exc}", any_rank=True)
            return False
        if self.env.snapshot_every == SNAPSHOT_AUTO:
            # What the newest finished snapshot cost (the previous one, when its copy is
            # overlapped): take() and the helper thread's copy, which on a node whose cores the
            # ranks fill comes out of training as surely as a stall does.
            self._tune_snapshots(self._snapshots.stats.last_cost_s)
        return True

    def _tune_snapshots(self, stall_s: float) -> None:
        """The fewest steps between snapshots, a power of two, that keeps their cost to the job
        within 1% of the step time (``stall_s`` times ``trainguard.checkpoint.snapshot.cost.cost_scale``: where the
        node's ranks outnumber its cores, each rank's snapshot work slows them all), from the
        median of the last ``SNAPSHOT_COST_WINDOW`` cost/step ratios (one slow step or one slow
        copy does not move it, nor does the noise of a cost near the budget flip it back and
        forth). A wider interval than the one in force needs a cost ``SNAPSHOT_WIDEN_OVER`` times
        the budget at the one in force; a narrower one goes at once. Until the window is full, only
        the median of at least ``SNAPSHOT_EARLY_MIN`` costs clearly over the budget
        (``SNAPSHOT_CLEARLY_OVER`` times it) widens the interval: the first snapshots of an
        attempt run out of colder caches, and the median of a few of them took the recovery
        bench's job to every 2 steps for its first ~20 steps. In a multi-rank job with an agent
        this is only a wish: rank 0's is agreed at the plan sync points (``PlanSync``), since ranks
        whose intervals drift apart keep no common step in their two slots; alone, the rank
        applies it."""
        if self._last_step_s <= 0:
            return
        self._stall_ratios.append(stall_s * self._snapshot_cost_scale / self._last_step_s)
        del self._stall_ratios[:-SNAPSHOT_COST_WINDOW]
        ratio = statistics.median(self._stall_ratios)
        every = 1
        while every < 64 and ratio / every > 0.01:
            every *= 2
        early = len(self._stall_ratios) < SNAPSHOT_COST_WINDOW
        if early and every > self._snapshot_wish and (
                len(self._stall_ratios) < SNAPSHOT_EARLY_MIN or ratio < SNAPSHOT_CLEARLY_OVER * 0.01):
            return
        if every > self._snapshot_wish and ratio / self._snapshot_wish <= SNAPSHOT_WIDEN_OVER * 0.01:
            every = self._snapshot_wish
        self._snapshot_wish = every
        if self._sync is None:
            self.snapshot_every = every

    def checkpoint_meta(self) -> dict[str, Any]:
        """What a checkpoint carries besides the state: the plan in force (so a restarted job keeps
        its batch split and LR), and which checkpoint requests it already answered. Worked out
        once per plan: a snapshot after every step takes it (encoding a plan: ~15-50 us)."""
        cached = self._meta_cache
        if cached is None or cached[0] is not self._plan or cached[1] != self._ckpt_id_seen:
            global_batch = (sum(self._view.batch_sizes) if self._view.batch_sizes is not None
                            else (self._view.batch_size or 0) * self.dp_size)
            cached = self._meta_cache = (self._plan, self._ckpt_id_seen,
                                         {"plan": json_plan(self._plan), "ckpt_id_seen": self._ckpt_id_seen,
                                          "global_batch": global_batch, "dp_size": self.dp_size,
                                          "batch_lr": self._batch_lr})
        return dict(cached[2])

    def take_meta(self, meta: Mapping[str, Any]) -> None:
        """Adopt what ``checkpoint_meta`` saved, from a checkpoint just loaded."""
        plan = meta.get("plan")
        if isinstance(plan, dict):
            try:
                self._plan = Plan.from_dict(plan)
            except (TypeError, ValueError):
                pass
        try:
            self._ckpt_id_seen = int(meta.get("ckpt_id_seen", self._ckpt_id_seen) or 0)
        except (TypeError, ValueError):
            pass
        saved = meta.get("global_batch")
        self._kept_batch = kept_batch(saved, self.default_batch_size, self.dp_size, self.applies)
        self._batch_lr = self._lr_for_batch(saved, meta.get("batch_lr"))
        self._meta_cache = None
        self._view = self._make_view(self._plan)

    def _lr_for_batch(self, saved: object, factor: object) -> float:
        """The LR factor after a restore: the checkpoint's own, times the rule's for a global batch
        that the world changed and these ranks cannot keep (they take LR but no batch sizes)."""
        before = float(factor) if isinstance(factor, (int, float)) and not isinstance(factor, bool) else 1.0
        if not math.isfinite(before) or before <= 0:
            before = 1.0
        now = (self.default_batch_size or 0) * self.dp_size
        if (self._kept_batch is not None or not isinstance(saved, int) or isinstance(saved, bool) or saved <= 0
                or now <= 0 or saved == now or not self.applies & APPLIES_LR or self.applies & APPLIES_BATCH_SIZES):
            return before
        multiplier, how = follow_batch(self.env.lr_batch_rule, saved, now, None)
        self._warn(f"the world changed the global batch from {saved} to {now} samples: {how}")
        return before * multiplier

    def restore(self, state: Mapping[str, Any]) -> int:
        """Load what the agent picked for this attempt into ``state`` (in place) and return the step
        to resume at (0 with nothing to restore): every rank's snapshot of the same step when the
        world size is unchanged, else (or when any rank cannot load its snapshot) the memory-tier
        checkpoint, which DCP reshards when the data-parallel degree changed. Collective when
        there is something to restore."""
        began = time.time()
        try:
            return self._restore(state)
        finally:
            self._restore_span = (began, time.time())

    def _restore(self, state: Mapping[str, Any]) -> int:
        if self.env.snapshot_step >= 0 and self.env.snapshot_dir:
            step = self._restore_snapshot(state)
            if step is not None:
                return step
        if self.env.restore_step >= 0 and _distributed(self.env.world_size):
            return self._restore_shared(state)
        from_env = self.env.restore_path
        path = from_env if from_env and os.path.isdir(from_env) else None
        if path is None and self.env.memory_root and not self.env.launched_by_agent:
            # A job the agent did not start (torchrun's own restarts): the newest memory checkpoint.
            from trainguard.checkpoint.tier import newest_memory_checkpoint

            path = newest_memory_checkpoint(self.env.memory_root, self.env.job)
        if path is None:
            return 0
        from trainguard.checkpoint.tier import load

        meta = load(path, state, rank=self.env.rank)
        self.take_meta(meta)
        self.restored_from = "checkpoint"
        return int(meta.get("step", 0))

    def _restore_shared(self, state: Mapping[str, Any]) -> int:
        """A job spanning nodes in a new world: the whole checkpoint the nodes agreed on, which the
        ranks of the nodes that hold it send to the others (``trainguard.checkpoint.share``)."""
        # torch stays out of ``import trainguard`` until a script restores
        from trainguard.checkpoint.share import ShareError, share
        from trainguard.checkpoint.tier import load

        env = self.env
        held = env.restore_path if env.restore_path and os.path.isdir(env.restore_path) else None
        try:
            path, done = share(held, rank=env.rank, world=env.world_size, node=env.group_rank,
                               local_rank=env.local_rank)
        except ShareError as exc:
            self._warn(f"the checkpoint of step {env.restore_step} could not reach every node ({exc}): "
                       "training starts afresh")
            return 0
        if path is None:
            self._warn(f"no rank holds the checkpoint of step {env.restore_step}: training starts afresh")
            return 0
        try:
            meta = load(path, state, rank=env.rank)
        finally:
            done()
        self.take_meta(meta)
        self.restored_from = "checkpoint"
        return int(meta.get("step", 0))

    def _restore_snapshot(self, state: Mapping[str, Any]) -> int | None:
        from trainguard.checkpoint.snapshot.errors import SnapshotError
        from trainguard.checkpoint.snapshot.load import load_snapshot

        step = self.env.snapshot_step
        meta: dict[str, Any] = {}
        try:
            meta = load_snapshot(self.env.snapshot_dir, self.env.rank, self.env.world_size, step, state)
            ok = True
        except (SnapshotError, OSError) as exc:
            ok = False
            self._warn(f"rank {self.env.rank} cannot restore the snapshot of step {step}: {exc}", any_rank=True)
        if not _all_ranks_agree(ok, self.env.world_size):
            self._warn(f"not every rank could restore the snapshot of step {step}: restoring the checkpoint instead")
            return None
        self.take_meta(meta)
        self.restored_from = "snapshot"
        return step

    # -- end ---------------------------------------------------------------------------------------

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._background_failures(self._writer.poll())
        self._flush_window(urgent=True)
        atexit.unregister(self._flush_at_exit)
        self.telemetry.close()
        if self._snapshots is not None:
            self._snapshots.close()
            self._snapshots = None
        if self._grad_clock is not None:
            self._grad_clock.close()
            self._grad_clock = None
        # DCP's state-dict functions (the memory and disk tiers) leave reference cycles holding the
        # script's modules (a closure of torch.distributed.checkpoint.state_dict that refers to
        # itself); until the collector finds them, a script that drops its DDP model before
        # destroy_process_group does not free it there (test_api_run: a rank's exit hung in
        # ~ProcessGroupGloo). Whether a collection had run by then was up to chance.
        gc.collect()

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    _warned: set[str] = set()

    def _warn(self, text: str, any_rank: bool = False) -> None:
        if text not in self._warned and (any_rank or self.env.rank == 0):
            self._warned.add(text)
            print(f"trainguard: {text}", file=sys.stderr, flush=True)


class _Disabled:
    """Stands in for a plan synchroniser that failed: no further collectives, no new plans."""

    snapshot_every = 0

    def after_step(self, step_s: float = 0.0, snapshot_every: int = 0) -> None:
        return None

    def initial(self, snapshot_every: int = 0) -> None:
        return None


def _distributed(world_size: int) -> bool:
    dist = sys.modules.get("torch.distributed")
    return world_size > 1 and dist is not None and dist.is_available() and dist.is_initialized()


def _all_ranks_agree(ok: bool, world_size: int) -> bool:
    """True when every rank's ``ok`` is True (one all-reduce when torch.distributed is up)."""
    dist = sys.modules.get("torch.distributed")
    if world_size <= 1 or dist is None or not dist.is_available() or not dist.is_initialized():
        return ok
    torch = sys.modules["torch"]
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(int(flag.item()))


def json_plan(plan: Plan) -> dict[str, Any]:
    body: dict[str, Any] = json.loads(plan.encode())
    return body


def _process_start() -> float | None:
    """When this process started (Unix time): when it was given its work, for a rank a warm
    launcher forked ahead of need; else from /proc (None where there is no /proc)."""
    given = os.environ.get(ENV_STARTED_AT)
    if given:
        try:
            return float(given)
        except ValueError:
            pass
    try:
        with open("/proc/self/stat") as fh:
            ticks = int(fh.read().rsplit(")", 1)[1].split()[19])
        # Its age on the boot clock the start time counts on (btime is whole seconds: too coarse).
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    return time.time() - age


def kept_batch(global_batch: object, batch_size: int | None, dp_size: int, applies: int) -> tuple[int, ...] | None:
    """The per-rank batch sizes that keep ``global_batch`` (a restored checkpoint's) over
    ``dp_size`` ranks, as even as whole samples allow; None where the script's own batch already
    makes it, where it takes no batch sizes, or where there are fewer samples than ranks.

    >>> kept_batch(16, 8, 1, APPLIES_ALL), kept_batch(16, 8, 3, APPLIES_ALL), kept_batch(16, 8, 2, APPLIES_ALL)
    ((16,), (6, 5, 5), None)
    """
    if (not isinstance(global_batch, int) or isinstance(global_batch, bool) or not batch_size
            or not applies & APPLIES_BATCH_SIZES or global_batch == batch_size * dp_size or global_batch < dp_size):
        return None
    base, extra = divmod(global_batch, dp_size)
    return tuple(base + (1 if r < extra else 0) for r in range(dp_size))


def default_applies(batch_size: int | None) -> int:
    """What a script that declares nothing applies: the plan's LR and stop, and its batch sizes only
    when it gave ``init`` its own batch size (it reads ``run.plan.batch_size`` then)."""
    return APPLIES_ALL if batch_size is not None else applies_mask(("lr", "stop"))


def _rss_bytes() -> int:
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def init(*, job: str | None = None, dp_rank: int | None = None, dp_size: int | None = None,
         batch_size: int | None = None, plan_every: int = 4, environ: Mapping[str, str] | None = None,
         applies: Iterable[str] | None = None) -> Run:
    """This rank's ``Run``. Reads the environment its launcher set (``trainguard run``, torchrun or
    nothing). ``dp_rank``/``dp_size``: this rank's data-parallel position when not every rank is
    a data-parallel replica (tensor or pipeline parallelism); default RANK/WORLD_SIZE.
    ``batch_size``: this rank's own samples per step, what ``run.plan.batch_size`` says until the
    agent moves samples between ranks. ``plan_every``: the fewest steps between two looks at the
    agent's plan (one store round trip each, made by a thread of the rank; more steps when steps
    are short, about one look per 0.3 s: ``trainguard.run.plansync``). ``applies``: what of the plan this
    rank applies, of ``"batch_sizes"``, ``"lr"``, ``"stop"`` (default: LR and stop, and batch sizes
    when ``batch_size`` is given); the agent moves samples only where every rank takes batch sizes.
    Never raises for a missing agent (an unknown ``applies`` name is a ValueError: a script's bug)."""
    entered = time.time()
    mask = applies_mask(applies) if applies is not None else None
    rendezvous_clock.watch()  # a process group this script brings up after init: its rendezvous is timed
    env = RunEnvironment.from_environ(environ, job=job)
    return Run(env, dp_rank=dp_rank, dp_size=dp_size, batch_size=batch_size, plan_every=plan_every,
               applies=mask, init_at=entered)


rendezvous_clock.watch()  # a script that imports torch before trainguard: its rendezvous is timed
