"""The multi-node recovery arm at its smallest: both launchers restart after the kill, the RESULT
line carries every figure, and trainguard's ranks lose at most one step."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.conftest import CPU_ISOLATION, REPO


@pytest.mark.slow
@pytest.mark.xdist_group(CPU_ISOLATION)  # 2 nodes x 2 ranks twice: kept apart from the timing benches
def test_multinode_recovery_arm_smoke() -> None:
    """``python bench/recovery_multinode.py --size smoke``: one kill, both arms restart."""
    peers = os.environ.get("TRAINGUARD_PEERS_VENV")  # torchrun from the peers' venv where set, as the bench
    # A short root: the agents' sockets live below it, and a unix socket path is at most 107 bytes
    # (pytest's per-worker tmp_path under xdist is too deep for it).
    work = Path(tempfile.mkdtemp(prefix="tg-mn-", dir="/tmp"))
    try:
        run = subprocess.run([sys.executable, "bench/recovery_multinode.py", "--size", "smoke", "--work", str(work),
                              *(["--peers-venv", peers] if peers else [])],
                             cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-3000:]  # both arms ran and restarted (1 when either did not)
    kills = {arm: re.findall(rf"^  {arm} +kill at step +(\d+): resumed at step +(-?\d+)", run.stdout, re.M)
             for arm in ("trainguard", "torchrun")}
    assert len(kills["trainguard"]) == len(kills["torchrun"]) == 1, out[-3000:]
    at, resumed = map(int, kills["trainguard"][0])
    assert at - resumed <= 1, kills
    line = next(ln for ln in run.stdout.splitlines() if ln.startswith("RESULT "))
    for key in ("multinode_resume_s", "multinode_steps_lost", "multinode_torchrun_resume_s",
                "multinode_torchrun_steps_lost", "multinode_lost_time_ratio"):
        assert re.search(rf"\b{key}=\d+\.\d\d\b", line), line
