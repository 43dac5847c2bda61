"""The tests' nodes: ``bench/netns.py``'s, failing (never skipping) where they cannot be made."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import netns
from bench.netns import PORT, REPO, Node, trainguard_run

__all__ = ["PORT", "REPO", "Node", "Nodes", "trainguard_run"]


class Nodes(netns.Nodes):
    def __init__(self, root: Path, names: list[str]) -> None:
        try:
            super().__init__(root, names)
        except netns.NetnsUnavailable as exc:
            pytest.fail(str(exc))


