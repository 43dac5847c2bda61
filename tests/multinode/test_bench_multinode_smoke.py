"""The multi-node recovery arm at its smallest: both launchers restart after the kill, the RESULT
line carries every figure, and trainguard's ranks lose at most one step."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from bench import recovery_multinode
from bench.netns import NetnsUnavailable


@pytest.mark.slow
@pytest.mark.xdist_group("multinode")
def test_multinode_recovery_arm_smoke(tmp_path: Path) -> None:
    peers = os.environ.get("TRAINGUARD_PEERS_VENV")  # torchrun from the peers' venv where set, as the bench
    try:
        ours, theirs = recovery_multinode.measure("smoke", Path(peers) if peers else None, tmp_path)
    except NetnsUnavailable as exc:
        pytest.fail(str(exc))
    assert ours.ok and theirs.ok, (ours.note, theirs.note)
    assert len(ours.kills) == len(theirs.kills) == 1
    assert ours.kills[0].steps_lost <= 1
    line = recovery_multinode.report(ours, theirs)
    for key in ("multinode_resume_s", "multinode_steps_lost", "multinode_torchrun_resume_s",
                "multinode_torchrun_steps_lost", "multinode_lost_time_ratio"):
        assert re.search(rf"\b{key}=\d+\.\d\d\b", line), line
