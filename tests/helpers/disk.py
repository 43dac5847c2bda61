"""A disk that refuses writes: filling a small filesystem the test mounted."""

from __future__ import annotations

import errno
from pathlib import Path


def fill(directory: Path) -> Path:
    """Write one file in ``directory`` until the filesystem is full (ENOSPC); return that file."""
    filler = directory / "filler"
    with open(filler, "wb", buffering=0) as fh:
        for size in (1 << 16, 4096, 1):
            try:
                while True:
                    fh.write(b"x" * size)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
    return filler
