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
import math
import os
import sys
import time
from collections.abc import Iterable, Mapping
from typing import Any

from trainguard.agent.batch_rule import follow_batch
from trainguard.agent.wire import APPLIES_BATCH_SIZES, APPLIES_LR, Plan, applies_mask
from trainguard.run import rendezvous_clock
from trainguard.run.environment import SNAPSHOT_AUTO, RunEnvironment
from trainguard.run.link import PlanWatcher, TelemetrySender
from trainguard.run.plan import RunPlan, default_applies, json_plan, kept_batch, plan_view
from trainguard.run.restore import restore
from trainguard.run.snapshot_cadence import SNAPSHOT_COLD_TAKES, SnapshotCadence
from trainguard.run.step import Step
from trainguard.run.telemetry import StepReporter


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
        self._grad_clock: Any = None  # trainguard.run.computetime.GradientClock after watch_gradients()
        self._snapshots: Any = None  # trainguard.checkpoint.snapshot.writer.SnapshotWriter on first use
        auto = env.snapshot_every == SNAPSHOT_AUTO
        self.snapshot_every = (env.snapshot_every if env.snapshot_every > 0 else int(auto)) if env.snapshot_dir else 0
        """Steps between snapshots now (0: none); tuned from the measured stall when automatic."""
        self._cadence = SnapshotCadence(self.snapshot_every)
        self._last_step_s = 0.0
        self.restored_from = ""
        """What ``restore`` loaded: "snapshot", "checkpoint" or "" (nothing)."""
        self._reporter = StepReporter(self.telemetry, env, dp_rank=self.dp_rank, applies=self.applies,
                                      init_at=time.time() if init_at is None else init_at)
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
        return plan_view(plan, dp_rank=self.dp_rank, dp_size=self.dp_size, batch_size=self.default_batch_size,
                         ckpt_id_seen=self._ckpt_id_seen, kept=self._kept_batch, batch_lr=self._batch_lr)

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
        self._reporter.start()
        sync = self._plan_sync()
        polled = sync.initial(self._cadence.wish) if sync is not None else self.plans.poll()
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
            self._reporter.send(step, step_s, step_cpu_s, self._plan.version)
        sync = self._sync
        try:
            if sync is None:
                sync = self._plan_sync()
            newer = sync.after_step(step_s, self._cadence.wish) if sync is not None else self.plans.poll()
        except Exception as exc:  # noqa: BLE001
            self._warn(f"plan sync failed, plans are no longer applied: {exc}")
            self._sync = _Disabled()
            return
        agreed = sync.snapshot_every if sync is not None else 0
        if agreed > 0 and self.snapshot_every > 0 and self.env.snapshot_every == SNAPSHOT_AUTO:
            self.snapshot_every = agreed
        if newer is not None and newer.version > self._plan.version:
            self._apply(newer)

    def _flush_at_exit(self) -> None:
        if os.getpid() == self._pid:  # not in a child forked from this rank that exits through atexit
            self._reporter.flush(urgent=True)
            if self._writer is not None:
                self._writer.settle(block=True)  # a save still being agreed goes to the writer, which outlives the rank

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
            self._reporter.failed_save = (label, error[:300])

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
                self._reporter.snapshot_stats = self._snapshots.stats
                self._cadence.cost_scale = cost_scale(self.env.local_world_size, cpus=cpus)
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

    def _tune_snapshots(self, cost_s: float) -> None:
        """Move the steps between snapshots by what the newest one cost (``SnapshotCadence.tune``):
        alone, the rank applies its wish; with a plan synchroniser rank 0's is agreed first."""
        every = self._cadence.tune(cost_s, self._last_step_s)
        if every is not None and self._sync is None:
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
            restored = restore(self.env, state, self._warn)
            if restored.source:
                self.take_meta(restored.meta)
                self.restored_from = restored.source
            return restored.step
        finally:
            self._reporter.restore_span = (began, time.time())

    # -- end ---------------------------------------------------------------------------------------

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._background_failures(self._writer.poll())
        self._reporter.flush(urgent=True)
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
