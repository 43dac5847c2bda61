"""Which checkpoint to restore: the newest one that verifies, across all tiers.

Candidates are ordered newest step first and, for equal steps, fastest tier first (``Tier.rank``).
Each is verified against its manifest before it is used; one that fails is reported
(``checkpoint_corrupt``) and the next candidate (older, or the same step in a slower tier) is
tried. A tier that cannot even be listed (object store down) is reported and skipped.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from trainguard.agent.checkpoint.errors import CheckpointCorrupt, describe
from trainguard.agent.checkpoint.local import LocalDirTier, rmtree_quiet
from trainguard.agent.checkpoint.status import CheckpointStatus
from trainguard.agent.checkpoint.tier import CheckpointInfo, Tier, check_job, step_dirname

EmitFn = Callable[[str, dict[str, object]], None]


def _noop(kind: str, fields: dict[str, object]) -> None:
    pass


def candidates(
    job: str, tiers: Sequence[Tier], *, max_step: int | None = None, emit: EmitFn = _noop,
    exclude: Collection[int] = (),
) -> list[tuple[Tier, CheckpointInfo]]:
    """Every committed checkpoint of ``job`` (at most ``max_step``, none of the steps in
    ``exclude``: those a rollback came from), best restore choice first."""
    check_job(job)
    out: list[tuple[Tier, CheckpointInfo]] = []
    for tier in tiers:
        try:
            infos = tier.list(job)
        except Exception as exc:
            emit("checkpoint_tier_unavailable", {"tier": tier.name, "job": job, "error": describe(exc)})
            continue
        out += [(tier, i) for i in infos if (max_step is None or i.step <= max_step) and i.step not in exclude]
    out.sort(key=lambda ti: (-ti[1].step, ti[0].rank))
    return out


def _report_corrupt(emit: EmitFn, status: CheckpointStatus | None, tier: Tier, info: CheckpointInfo,
                    problems: list[str]) -> None:
    if status is not None:
        status.observe_corrupt(tier.name)
    emit("checkpoint_corrupt", {"tier": tier.name, "job": info.job, "step": info.step,
                                "location": info.location, "problems": problems[:20]})


def newest_restorable(
    job: str,
    tiers: Sequence[Tier],
    *,
    max_step: int | None = None,
    emit: EmitFn = _noop,
    status: CheckpointStatus | None = None,
    exclude: Collection[int] = (),
) -> tuple[Tier, CheckpointInfo] | None:
    """The newest checkpoint that verifies (fastest tier on equal steps), or None."""
    for tier, info in candidates(job, tiers, max_step=max_step, emit=emit, exclude=exclude):
        try:
            result = tier.verify(job, info.step)
        except Exception as exc:
            _report_corrupt(emit, status, tier, info, [f"verify failed: {describe(exc)}"])
            continue
        if result.ok:
            return tier, info
        _report_corrupt(emit, status, tier, info, result.problems())
    return None


@dataclass
class Restored:
    """A verified checkpoint materialized as a local directory the ranks load from.

    Call ``release`` once the ranks have loaded it: it unpins an in-place copy (so retention may
    prune it again) or removes a fetched scratch copy.
    """

    tier: str
    info: CheckpointInfo
    path: Path
    fetched: bool
    _release: Callable[[], None] = field(repr=False, default=lambda: None)
    _done: threading.Event = field(repr=False, default_factory=threading.Event)

    def release(self) -> None:
        if not self._done.is_set():
            self._done.set()
            self._release()


def restore(
    job: str,
    tiers: Sequence[Tier],
    scratch_root: Path,
    *,
    max_step: int | None = None,
    emit: EmitFn = _noop,
    status: CheckpointStatus | None = None,
    exclude: Collection[int] = (),
) -> Restored | None:
    """Materialize the newest verified checkpoint of ``job`` locally, or None if none verifies.

    In-place tiers (memory, disk) are pinned and verified where they are; the others are fetched
    into ``scratch_root/<job>/`` with checksum verification on the way. ``max_step`` restricts the
    choice to checkpoints at or before a step (rollback to before a loss spike).
    """
    for tier, info in candidates(job, tiers, max_step=max_step, emit=emit, exclude=exclude):
        local = tier.open(job, info.step)
        if local is not None:
            release: Callable[[], None] = (
                tier.acquire(job, info.step) if isinstance(tier, LocalDirTier) else (lambda: None)
            )
            try:
                result = tier.verify(job, info.step)
            except Exception as exc:
                release()
                _report_corrupt(emit, status, tier, info, [f"verify failed: {describe(exc)}"])
                continue
            if result.ok:
                return Restored(tier.name, info, local, False, release)
            release()
            _report_corrupt(emit, status, tier, info, result.problems())
            continue
        dest = Path(scratch_root) / job / f"{step_dirname(info.step)}-{tier.name}-{uuid.uuid4().hex[:8]}"
        try:
            path = tier.fetch(job, info.step, dest)
        except CheckpointCorrupt as exc:
            _report_corrupt(emit, status, tier, info, exc.problems)
            continue
        except Exception as exc:  # unreachable store, permissions: try the next candidate
            emit("checkpoint_fetch_failed", {"tier": tier.name, "job": job, "step": info.step,
                                             "error": describe(exc)})
            continue
        return Restored(tier.name, info, path, True, lambda p=path: rmtree_quiet(p))  # type: ignore[misc]
    return None
