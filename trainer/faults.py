"""Fault injection for tests and demos: kill, hang, slow and NaN faults at chosen steps and ranks.

Specs follow the command line's ``--fault``: ``kill:rank=1,step=40``, ``hang:rank=2,step=60``,
``slow:rank=3,factor=2[,step=K][,until=M]``, ``nan:step=80[,rank=R]``. A spec without ``rank``
applies to every rank. ``slow`` applies on steps ``K <= step < M`` (``until`` exclusive, open
ended by default); the others fire once, at exactly their step.

Specs come from the caller (config, ``--fault``) and from ``$TRAINGUARD_FAULTS``
(semicolon-separated), so the agent can inject faults without editing a config. With a marker
directory (argument or ``$TRAINGUARD_FAULT_MARKER_DIR``) a fired fault leaves a file behind and
never fires again, so a kill at step 40 does not kill the job again after it restarts from a
step-30 checkpoint.

This module never imports torch: it is imported by launchers and the CLI, which must start fast.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

ENV_FAULTS = "TRAINGUARD_FAULTS"
ENV_MARKER_DIR = "TRAINGUARD_FAULT_MARKER_DIR"

KINDS = ("kill", "hang", "slow", "nan")
_KEYS = {
    "kill": {"rank", "step"},
    "hang": {"rank", "step"},
    "nan": {"rank", "step"},
    "slow": {"rank", "step", "until", "factor"},
}
_REQUIRED = {"kill": {"step"}, "hang": {"step"}, "nan": {"step"}, "slow": {"factor"}}


@dataclass(frozen=True)
class FaultSpec:
    """One fault. ``rank=None`` means every rank."""

    kind: str
    step: int | None = None
    """kill/hang/nan: the step it fires at. slow: the first slowed step (None = from the start)."""
    rank: int | None = None
    until: int | None = None
    """slow only: first step that is no longer slowed (exclusive); None = never ends."""
    factor: float = 1.0
    """slow only: compute time is multiplied by this (>= 1)."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"fault kind {self.kind!r} unknown; expected one of {', '.join(KINDS)}")
        if self.kind != "slow" and self.step is None:
            raise ValueError(f"fault {self.kind!r}: 'step' is required")
        if self.step is not None and self.step < 0:
            raise ValueError(f"fault {self.kind!r}: 'step' must be >= 0, got {self.step}")
        if self.rank is not None and self.rank < 0:
            raise ValueError(f"fault {self.kind!r}: 'rank' must be >= 0, got {self.rank}")
        if self.kind == "slow":
            if not self.factor >= 1.0:  # also rejects NaN
                raise ValueError(f"fault 'slow': 'factor' must be >= 1, got {self.factor}")
            if self.until is not None and self.until <= (self.step or 0):
                raise ValueError(f"fault 'slow': 'until' ({self.until}) must be after 'step' ({self.step or 0})")
        elif self.until is not None or self.factor != 1.0:
            raise ValueError(f"fault {self.kind!r}: 'until'/'factor' only apply to 'slow'")

    def applies_to(self, rank: int) -> bool:
        return self.rank is None or self.rank == rank

    def active_at(self, step: int) -> bool:
        """slow: inside [step, until). Others: exactly at their step."""
        if self.kind == "slow":
            return step >= (self.step or 0) and (self.until is None or step < self.until)
        return step == self.step

    def __str__(self) -> str:
        parts = []
        if self.rank is not None:
            parts.append(f"rank={self.rank}")
        if self.step is not None:
            parts.append(f"step={self.step}")
        if self.kind == "slow":
            parts.append(f"factor={self.factor:g}")
            if self.until is not None:
                parts.append(f"until={self.until}")
        return f"{self.kind}:{','.join(parts)}"


def parse_fault(spec: str) -> FaultSpec:
    """Parse one spec such as ``kill:rank=1,step=40``; ValueError names the bad part.

    >>> parse_fault("slow:rank=3,factor=2,step=10")
    FaultSpec(kind='slow', step=10, rank=3, until=None, factor=2.0)
    """
    text = spec.strip()
    kind, sep, params = text.partition(":")
    kind = kind.strip().lower()
    if kind not in KINDS:
        raise ValueError(f"fault spec {spec!r}: kind {kind!r} unknown; expected one of {', '.join(KINDS)}")
    if not sep or not params.strip():
        need = ", ".join(sorted(_REQUIRED[kind]))
        raise ValueError(f"fault spec {spec!r}: missing parameters after {kind!r} (need {need})")
    values: dict[str, str] = {}
    for part in params.split(","):
        key, eq, value = part.partition("=")
        key, value = key.strip(), value.strip()
        if not eq or not key or not value:
            raise ValueError(f"fault spec {spec!r}: part {part.strip()!r} is not key=value")
        if key not in _KEYS[kind]:
            allowed = ", ".join(sorted(_KEYS[kind]))
            raise ValueError(f"fault spec {spec!r}: key {key!r} not valid for {kind!r} (allowed: {allowed})")
        if key in values:
            raise ValueError(f"fault spec {spec!r}: key {key!r} given twice")
        values[key] = value
    missing = _REQUIRED[kind] - values.keys()
    if missing:
        raise ValueError(f"fault spec {spec!r}: missing {', '.join(sorted(missing))!r}")

    def as_int(key: str) -> int | None:
        if key not in values:
            return None
        try:
            return int(values[key])
        except ValueError:
            raise ValueError(f"fault spec {spec!r}: {key}={values[key]!r} is not an integer") from None

    factor = 1.0
    if "factor" in values:
        try:
            factor = float(values["factor"])
        except ValueError:
            raise ValueError(f"fault spec {spec!r}: factor={values['factor']!r} is not a number") from None
    try:
        return FaultSpec(kind=kind, step=as_int("step"), rank=as_int("rank"), until=as_int("until"), factor=factor)
    except ValueError as e:
        raise ValueError(f"fault spec {spec!r}: {e}") from None


def specs_from_env(environ: Mapping[str, str]) -> list[str]:
    raw = environ.get(ENV_FAULTS, "")
    return [s.strip() for s in raw.split(";") if s.strip()]


def hang_forever(sleep: Callable[[float], None] = time.sleep) -> None:
    """Block in Python (short sleeps) so py-spy shows this frame, like a rank stuck in user code."""
    while True:
        sleep(0.05)


def burn_cpu(seconds: float, clock: Callable[[], float] = time.thread_time) -> float:
    """Busy-compute for ``seconds`` of ``clock`` time (this thread's CPU time by default: the
    trainer measures a rank's compute as CPU time, and a CPU deadline makes the slowdown a factor
    of work, independent of how busy the machine is); return the time spent.

    A tight float loop rather than a sleep: a slowed rank must really consume CPU, as a rank on a
    throttled or oversubscribed core would, so that CPU-side monitors see it too.
    """
    start = clock()
    deadline = start + seconds
    x = 1.0
    while clock() < deadline:
        for _ in range(2000):
            x = x * 1.0000001 + 1e-9
            if x > 2.0:
                x = 1.0
    return clock() - start


class FaultInjector:
    """The hooks the training loop calls; a no-op (cheap checks) when no spec matches this rank."""

    def __init__(
        self,
        specs: Iterable[FaultSpec],
        rank: int,
        clock: Callable[[], float] = time.thread_time,
        marker_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        self.rank = rank
        self.specs = [s for s in specs if s.applies_to(rank)]
        self.clock = clock
        self.marker_dir = Path(marker_dir) if marker_dir is not None else None
        self._fired: set[FaultSpec] = set()
        self._by_kind = {k: [s for s in self.specs if s.kind == k] for k in KINDS}

    @classmethod
    def from_specs(
        cls,
        specs: Iterable[str],
        rank: int,
        clock: Callable[[], float] = time.thread_time,
        *,
        marker_dir: str | os.PathLike[str] | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> FaultInjector:
        """Parse ``specs`` plus those in ``$TRAINGUARD_FAULTS``; ``marker_dir`` defaults to
        ``$TRAINGUARD_FAULT_MARKER_DIR``. Pass ``environ={}`` to ignore the environment."""
        env = os.environ if environ is None else environ
        parsed = [parse_fault(s) for s in [*specs, *specs_from_env(env)]]
        if marker_dir is None and env.get(ENV_MARKER_DIR):
            marker_dir = env[ENV_MARKER_DIR]
        return cls(parsed, rank, clock, marker_dir)

    def __bool__(self) -> bool:
        return bool(self.specs)

    # -- one-shot bookkeeping -------------------------------------------------------------------

    def marker_path(self, spec: FaultSpec) -> Path | None:
        if self.marker_dir is None:
            return None
        # The rank is in the name: a rank-less spec fires once on every rank.
        name = str(spec).replace(":", "_").replace(",", "_").replace("=", "")
        return self.marker_dir / f"fault-{name}-on-rank{self.rank}.fired"

    def _take(self, spec: FaultSpec) -> bool:
        """True exactly once per spec: in this process, and across restarts given a marker dir."""
        if spec in self._fired:
            return False
        path = self.marker_path(spec)
        if path is not None and path.exists():
            self._fired.add(spec)
            return False
        self._fired.add(spec)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            # Durable before a kill: the restarted job must see it.
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.write(fd, f"{spec} rank={self.rank} pid={os.getpid()} time={time.time():.3f}\n".encode())
                os.fsync(fd)
            finally:
                os.close(fd)
        return True

    def _announce(self, spec: FaultSpec, step: int) -> None:
        sys.stderr.write(f"trainguard: injecting fault {spec} on rank {self.rank} at step {step}\n")
        sys.stderr.flush()

    # -- hooks ------------------------------------------------------------------------------------

    def before_step(self, step: int) -> None:
        """Call at the top of each step: kill (SIGKILL self) or hang forever if due."""
        for spec in self._by_kind["kill"]:
            if spec.active_at(step) and self._take(spec):
                self._announce(spec, step)
                sys.stdout.flush()
                os.kill(os.getpid(), signal.SIGKILL)
        for spec in self._by_kind["hang"]:
            if spec.active_at(step) and self._take(spec):
                self._announce(spec, step)
                hang_forever()

    def loss_override(self, step: int) -> bool:
        """True when this step's loss must be replaced by NaN (fires once)."""
        due = False
        for spec in self._by_kind["nan"]:
            if spec.active_at(step) and self._take(spec):
                self._announce(spec, step)
                due = True
        return due

    def slow_factor(self, step: int) -> float:
        """Product of the factors of the slow faults active at ``step`` (1.0 when none)."""
        factor = 1.0
        for spec in self._by_kind["slow"]:
            if spec.active_at(step):
                factor *= spec.factor
        return factor

    def after_compute(self, step: int, compute_s: float) -> float:
        """Call after forward+backward took ``compute_s``: burn (factor-1) x compute_s of CPU.

        Returns the time spent burning (0.0 when no slow fault is active).
        """
        factor = self.slow_factor(step)
        if factor <= 1.0 or compute_s <= 0.0:
            return 0.0
        return burn_cpu((factor - 1.0) * compute_s, self.clock)
