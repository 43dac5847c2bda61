"""The one error a snapshot raises."""


class SnapshotError(Exception):
    """A snapshot that cannot be taken or restored (the caller falls back to DCP checkpoints)."""
