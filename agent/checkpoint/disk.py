"""The disk tier: checkpoints in a configured local directory (NVMe), durable across reboots.

Every file and directory is fsync'd before the commit rename and the parent directory after it,
so a committed ``step_<N>`` survives a power cut. A full filesystem (ENOSPC) or any other I/O
error raises CheckpointWriteError after the partial copy has been removed (``LocalDirTier``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from trainguard.agent.checkpoint.local import LocalDirTier
from trainguard.agent.checkpoint.tier import RANK_DISK


class DiskTier(LocalDirTier):
    """Checkpoints on a local filesystem.

    ``restore_in_place`` (default True): restore reads the committed directory directly, pinned
    against pruning while the ranks load it; copying a local disk checkpoint to another local
    scratch directory first would only add a full read and write to the restart time.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        name: str = "disk",
        restore_in_place: bool = True,
        clock: Callable[[], float] = time.time,
    ) -> None:
        super().__init__(name, root, RANK_DISK, durable=True, restore_in_place=restore_in_place, clock=clock)
