"""The interface every checkpoint tier implements, and the small value types they return.

Tiers are ranked by speed (``rank``: lower restores faster). Memory, disk and object tiers live in
this package; the peer tier (a copy held by another node's agent, multi-node issue) implements the
same class: ``list`` what it holds, ``write_from`` a local directory, ``fetch`` into a local
directory with checksum verification, ``verify``, ``prune`` and ``delete``.
"""

from __future__ import annotations

import builtins
import re
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from trainguard.agent.checkpoint.manifest import VerifyResult

# Speed ranks of the built-in tiers; the peer tier slots in between memory and disk.
RANK_MEMORY = 0
RANK_PEER = 10
RANK_DISK = 20
RANK_OBJECT = 30

TMP_PREFIX = ".tmp-"
_JOB_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
_STEP_RE = re.compile(r"^step_(\d{1,18})$")


def check_job(job: str) -> str:
    """Job names become directory names and object keys: letters, digits, ``_.-``, no leading dot."""
    if not isinstance(job, str) or not _JOB_RE.match(job):
        raise ValueError(f"invalid job name {job!r}: use letters, digits, '_', '.', '-' (max 128)")
    return job


def check_step(step: int) -> int:
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"invalid step {step!r}: must be a non-negative integer")
    return step


def step_dirname(step: int) -> str:
    return f"step_{check_step(step)}"


def parse_step_dirname(name: str) -> int | None:
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class CheckpointInfo:
    """One committed checkpoint in one tier."""

    tier: str
    job: str
    step: int
    location: str  # local directory path, or the object-store URL of the checkpoint prefix
    size: int  # bytes of checkpoint data (manifest excluded)
    created: float  # wall-clock seconds of the commit

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class Tier(ABC):
    """A place that holds committed checkpoints.

    Every method that writes is atomic from a reader's point of view: a checkpoint is listed only
    once its manifest is committed, and a failed write leaves nothing listed.
    """

    name: str
    rank: int

    @abstractmethod
    def list(self, job: str) -> list[CheckpointInfo]:
        """Committed checkpoints of ``job``, oldest step first."""

    @abstractmethod
    def write_from(self, src_dir: Path, job: str, step: int) -> CheckpointInfo:
        """Copy a checkpoint directory into this tier and commit it.

        When ``src_dir`` holds a manifest, the bytes are checked against it while copying (a
        corrupt source raises CheckpointCorrupt instead of being copied on). Any I/O failure raises
        CheckpointWriteError after the partial copy has been removed.
        """

    @abstractmethod
    def open(self, job: str, step: int) -> Path | None:
        """A local directory that restore may read in place, or None when it must ``fetch``."""

    @abstractmethod
    def fetch(self, job: str, step: int, dest_dir: Path) -> Path:
        """Materialize the checkpoint as ``dest_dir`` (created; must not exist), verifying checksums.

        Raises CheckpointCorrupt on a mismatch (nothing is left at ``dest_dir``) and
        CheckpointNotFound when the tier does not hold it.
        """

    @abstractmethod
    def verify(self, job: str, step: int) -> VerifyResult:
        """Check the stored copy against its manifest (reads every byte)."""

    @abstractmethod
    def delete(self, job: str, step: int) -> None:
        """Uncommit first (so a crash half-way never leaves a listed partial), then remove."""

    def prune(self, job: str, keep: int, listed: builtins.list[CheckpointInfo] | None = None) -> builtins.list[int]:
        """Delete all but the newest ``keep`` checkpoints of ``job``; returns the deleted steps.
        ``listed``: what ``list(job)`` just returned, not read again (a checkpoint committed since
        is newer than all of it, so nothing it holds is pruned too early)."""
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        infos = self.list(job) if listed is None else listed
        doomed = [i.step for i in infos[:-keep]]
        deleted = []
        for step in doomed:
            if self._may_delete(job, step):
                self.delete(job, step)
                deleted.append(step)
        return deleted

    def _may_delete(self, job: str, step: int) -> bool:
        """Hook for tiers that pin checkpoints being read."""
        return True

    def newest(self, job: str) -> CheckpointInfo | None:
        infos = self.list(job)
        return infos[-1] if infos else None

    def cleanup_tmp(self) -> int:
        """Remove leftovers of writes interrupted by a crash; returns how many were removed."""
        return 0

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} rank={self.rank}>"
