"""The multi-node recovery arm at its smallest: both launchers restart after the kill, the RESULT
line carries every figure, and trainguard's ranks lose at most one step."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

import pytest

from bench import recovery_multinode
from bench.netns import NetnsUnavailable
from tests.conftest import CPU_ISOLATION


@pytest.mark.slow
@pytest.mark.xdist_group(CPU_ISOLATION)  # 2 nodes x 2 ranks twice: kept apart from the timing benches
def test_multinode_recovery_arm_smoke() -> None:
    peers = os.environ.get("TRAINGUARD_PEERS_VENV")  # torchrun from the peers' venv where set, as the bench
    # A short root: the agents' sockets live below it, and a unix socket path is at most 107 bytes
    # (pytest's per-worker tmp_path under xdist is too deep for it).
    work = Path(tempfile.mkdtemp(prefix="tg-mn-", dir="/tmp"))
    try:
        ours, theirs = recovery_multinode.measure("smoke", Path(peers) if peers else None, work)
    except NetnsUnavailable as exc:
        pytest.fail(str(exc))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    assert ours.ok and theirs.ok, (ours.note, theirs.note)
    assert len(ours.kills) == len(theirs.kills) == 1
    assert ours.kills[0].steps_lost <= 1
    line = recovery_multinode.report(ours, theirs)
    for key in ("multinode_resume_s", "multinode_steps_lost", "multinode_torchrun_resume_s",
                "multinode_torchrun_steps_lost", "multinode_lost_time_ratio"):
        assert re.search(rf"\b{key}=\d+\.\d\d\b", line), line
