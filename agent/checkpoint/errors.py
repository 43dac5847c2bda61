"""Typed errors of the checkpoint storage layer.

Callers branch on the type: a ``CheckpointWriteError`` is an event and the job trains on; a
``CheckpointCorrupt`` makes restore skip that copy and try the next older or slower one.
"""

from __future__ import annotations


class CheckpointError(Exception):
    """Base of every error this package raises on purpose."""


class CheckpointNotFound(CheckpointError):
    """No committed checkpoint for that (job, step) in that tier."""


class CheckpointWriteError(CheckpointError):
    """Writing a checkpoint into a tier failed (full disk, permissions, object store down).

    The tier has already removed its partial copy when this is raised: nothing half-written is
    ever listed as committed.
    """

    def __init__(self, tier: str, job: str, step: int, cause: BaseException | str) -> None:
        self.tier = tier
        self.job = job
        self.step = step
        self.cause = cause
        super().__init__(f"tier {tier}: writing {job} step {step} failed: {describe(cause)}")


class CheckpointCorrupt(CheckpointError):
    """A checkpoint does not match its manifest (or has none that can be trusted)."""

    def __init__(self, message: str, problems: list[str] | None = None) -> None:
        self.problems = problems if problems is not None else [message]
        super().__init__(message)


class ManifestError(CheckpointCorrupt):
    """A manifest that cannot be parsed or does not fit the schema."""


class UnsafePathError(ManifestError):
    """A path from a manifest or an object listing that would leave the checkpoint directory."""


def describe(cause: BaseException | str) -> str:
    """One line for an event: the exception type and message (errno name included for OSError)."""
    if isinstance(cause, str):
        return cause
    if isinstance(cause, OSError) and cause.errno is not None:
        import errno as _errno

        name = _errno.errorcode.get(cause.errno, str(cause.errno))
        return f"{type(cause).__name__}[{name}]: {cause.strerror or cause}"
    return f"{type(cause).__name__}: {cause}"
