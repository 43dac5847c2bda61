"""Tiered checkpoint storage, torch-free: manifests with checksums, atomic commits, memory / disk /
object tiers behind one ``Tier`` interface, background replication between them, and the catalog
that picks the newest verified checkpoint to restore.

The daemon holds one ``CheckpointManager``; the trainer only needs ``MemoryTier`` (stage/commit)
and ``open_for_overwrite`` (its DCP writer's file opener, for buffer reuse).
"""

from trainguard.agent.checkpoint.catalog import Restored, candidates, newest_restorable, restore
from trainguard.agent.checkpoint.disk import DiskTier
from trainguard.agent.checkpoint.errors import (
    CheckpointCorrupt,
    CheckpointError,
    CheckpointNotFound,
    CheckpointWriteError,
    ManifestError,
    UnsafePathError,
)
from trainguard.agent.checkpoint.manager import CheckpointManager, CheckpointSettings
from trainguard.agent.checkpoint.manifest import (
    MANIFEST_NAME,
    Manifest,
    VerifyResult,
    build_manifest,
    read_manifest,
    safe_relpath,
    verify,
    write_manifest,
)
from trainguard.agent.checkpoint.memory import MemoryTier, bench_buffer_reuse, open_for_overwrite
from trainguard.agent.checkpoint.objectstore import ObjectStoreConfig, ObjectTier
from trainguard.agent.checkpoint.replicator import TierReplicator
from trainguard.agent.checkpoint.status import METRICS, CheckpointStatus
from trainguard.agent.checkpoint.tier import CheckpointInfo, Tier

__all__ = [
    "METRICS",
    "MANIFEST_NAME",
    "CheckpointCorrupt",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointManager",
    "CheckpointNotFound",
    "CheckpointSettings",
    "CheckpointStatus",
    "CheckpointWriteError",
    "DiskTier",
    "Manifest",
    "ManifestError",
    "MemoryTier",
    "ObjectStoreConfig",
    "ObjectTier",
    "Restored",
    "Tier",
    "TierReplicator",
    "UnsafePathError",
    "VerifyResult",
    "bench_buffer_reuse",
    "build_manifest",
    "candidates",
    "newest_restorable",
    "open_for_overwrite",
    "read_manifest",
    "restore",
    "safe_relpath",
    "verify",
    "write_manifest",
]
