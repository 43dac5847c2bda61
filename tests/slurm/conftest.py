"""The ``slurm`` fixture: a fresh two-node Slurm cluster per test, torn down even on failure."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.slurm.cluster import SlurmCluster


@pytest.fixture
def slurm(tmp_path: Path) -> Iterator[SlurmCluster]:
    with SlurmCluster(tmp_path / "slurm") as cluster:
        yield cluster
