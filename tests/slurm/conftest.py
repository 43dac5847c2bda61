"""Fixtures: a fresh two-node Slurm cluster per test, torn down even on failure; ``slurm_agents``
with a ``trainguard agent`` on each node as its daemon."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.slurm.cluster import SlurmCluster


@pytest.fixture
def slurm(tmp_path: Path) -> Iterator[SlurmCluster]:
    with SlurmCluster(tmp_path / "slurm") as cluster:
        yield cluster


@pytest.fixture
def slurm_agents(tmp_path: Path) -> Iterator[SlurmCluster]:
    with SlurmCluster(tmp_path / "slurm", agents=True) as cluster:
        yield cluster
