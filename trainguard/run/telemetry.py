"""A rank's step telemetry to its node agent: steps gathered into windows (``StepWindow``), one
message per window, the attempt's start-up times on the first ones, sent fire-and-forget."""

from __future__ import annotations

import math
import os
import resource
import time
from typing import Any

from trainguard.agent.wire import ENV_STARTED_AT, Telemetry
from trainguard.run import rendezvous_clock
from trainguard.run.environment import RunEnvironment
from trainguard.run.link import TelemetrySender
from trainguard.run.step import Step, cuda_in_use
from trainguard.run.stepwindow import PART_S, WINDOW_S, StepWindow, window_length


class StepReporter:
    """One rank's telemetry: ``send`` after each step, ``flush`` to end the window now."""

    def __init__(self, sender: TelemetrySender, env: RunEnvironment, *, dp_rank: int, applies: int,
                 init_at: float) -> None:
        self.sender = sender
        self.env = env
        self.dp_rank = dp_rank
        self.applies = applies
        self.snapshot_stats: Any = None
        """The rank's ``SnapshotStats`` once it takes snapshots: the window's last one is told."""
        self.failed_save: tuple[int, str] | None = None
        """A memory-tier save that failed (step, error), told with the next message."""
        self.restore_span: tuple[float, float] | None = None
        self._started_at: float | None = None
        self._init_at = init_at
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

    def start(self) -> None:
        """The first step begins: whether its compute counts CPU time."""
        self._by_cpu = not cuda_in_use()

    def send(self, step: Step, step_s: float, step_cpu_s: float, plan_version: int) -> None:
        """Add a finished step to the window, and end the window where it is due."""
        r = step.reported
        window = self._window
        if window.steps and window.plan_version != plan_version:
            self.flush()  # one message, one plan: the agent tells a change's effect by version
        window.add(step.step, step_s, step._times(step_s, step_cpu_s, self._by_cpu), step.samples, step.tokens, r,
                   plan_version, self._part_steps)
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
        urgent = self._timeline_sends > 0 or self.failed_save is not None or window.bad_loss is not None
        # Only where the step count is a multiple of the window's length, also when a slow step just
        # shortened it: a window cut at once where it stood ended off the multiples that the other
        # ranks' windows end at (the agent compares ranks at those steps), and the next multiple of
        # the shorter length comes within it, so no window outgrows the longer one it started as.
        # (Or when its parts fill the message: steps that slowed within one long window.)
        if urgent or (step.step + 1) % self._window_steps == 0 or window.parts_full:
            self.flush(urgent)

    def _relength(self, step_s: float) -> None:
        """The window's and a part's lengths in steps for steps of ``step_s`` seconds, and the
        step times for which both stay the same (so that most steps need not work them out)."""
        self._window_steps, w_lo, w_hi = window_length(step_s, WINDOW_S)
        self._part_steps, p_lo, p_hi = window_length(step_s, PART_S)
        self._lengths_hold = (max(w_lo, p_lo), min(w_hi, p_hi))

    def flush(self, urgent: bool = False) -> None:
        """End the window: the steps gathered since the last message become one (nothing when there
        are none), sent with the link's next datagram, or at once when ``urgent``."""
        window = self._window
        self._by_cpu = not cuda_in_use()
        if not window.steps or not self.sender.path:
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
                ckpt_failed=self.failed_save[0] if self.failed_save else None,
                ckpt_error=self.failed_save[1] if self.failed_save else None, **optional,
                **self._timeline(window.last_step + 1, window.steps))
        except (TypeError, ValueError):
            self.sender.stats.dropped += 1
            window.clear()
            return
        window.clear()
        if self.sender.send(msg, urgent=urgent):
            self.failed_save = None

    def _timeline(self, end: int, steps: int) -> dict[str, Any]:
        """Start-up and snapshot times for a message of ``steps`` steps that ends at step count ``end``."""
        out: dict[str, Any] = {}
        snapshots = self.snapshot_stats
        if snapshots is not None and snapshots.last_step > end - steps:
            out["snapshot_s"] = snapshots.last_stall_s  # the window's last snapshot
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
        if self.restore_span is not None:
            out["restore_begin"], out["restore_end"] = self.restore_span
        return out


def _finite(value: Any, default: float) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return default
    return number


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


def _rss_bytes() -> int:
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
