"""The warm launcher's spares (trainer/zygote.py ``Spares``): ranks forked ahead of need, handed a
restart's work at once, and the rendezvous store rank 0 hosts before its code runs. A real zygote
(it imports torch: ~5 s) forking real processes."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from tests.helpers.waiting import wait_for
from trainguard.agent.lifecycle.launcher import free_port
from trainguard.agent.lifecycle.zygote_client import Zygote
from trainguard.agent.wire import ENV_HOST_STORE, ENV_STARTED_AT

REPO = Path(__file__).resolve().parents[2]

# A rank: says when it was given its work, then waits to be killed (or, with STORE_KEY, meets the
# other rank through the job's rendezvous store as torch's own rendezvous would, and ends).
RANK_SCRIPT = """
import json, os, sys, time
out = {"rank": os.environ["RANK"], "started_at": os.environ.get("TRAINGUARD_STARTED_AT"), "pid": os.getpid()}
if os.environ.get("STORE_KEY"):
    from datetime import timedelta
    import torch.distributed as dist
    t0 = time.monotonic()
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), 2, False, timeout=timedelta(seconds=20))
    store.set(f"rank{os.environ['RANK']}", "here")
    store.wait(["rank0", "rank1"])
    out["met_s"] = time.monotonic() - t0
with open(os.environ["OUT"], "w") as fh:
    json.dump(out, fh)
if not os.environ.get("STORE_KEY"):
    time.sleep(120)
"""


def _zygote(tmp_path: Path) -> Zygote:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return Zygote([sys.executable, "-m", "trainguard.trainer.zygote"], env, str(tmp_path), str(tmp_path / "zygote.log"))


def _spares(zygote: Zygote, n: int) -> set[int] | None:
    """The zygote's spares once there are ``n`` (a spare killed by a test is told gone when reaped)."""
    found = zygote.own_pids() - {zygote.proc.pid}
    return found if len(found) == n and all(map(_alive, found)) else None


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _read_json(path: Path) -> Any:
    """The rank's output once it is whole (None while the file is missing or half written)."""
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def test_a_restart_takes_spares_forked_ahead_and_a_closed_zygote_leaves_none(tmp_path: Path) -> None:
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    zygote = _zygote(tmp_path)
    try:
        def spawn(rank: int, attempt: int) -> int:
            out = tmp_path / f"rank{rank}-{attempt}.json"
            env = dict(os.environ, RANK=str(rank), OUT=str(out))
            return zygote.spawn(rank, env, str(tmp_path / f"rank{rank}.log"), str(tmp_path), f"path:{script}", []).pid

        first = [spawn(r, 1) for r in range(2)]
        assert not zygote.own_pids() - {zygote.proc.pid}  # none while the ranks start
        # As many spares as ranks, once the zygote has been idle a while.
        spares = wait_for(lambda: _spares(zygote, 2), 20, "two spares")
        assert spares.isdisjoint(first) and all(_alive(p) for p in spares)
        for pid in first:
            os.kill(pid, signal.SIGKILL)
        asked = time.time()
        second = [spawn(r, 2) for r in range(2)]
        assert set(second) == spares, (second, spares)  # no fork: the spares took the work
        outs = [wait_for(lambda r=r: _read_json(tmp_path / f"rank{r}-2.json"), 30, f"rank {r}'s output")
                for r in range(2)]
        for r, out in enumerate(outs):
            # Its start for the recovery timeline: when it was handed its work, not when it was forked.
            assert out["rank"] == str(r) and out["started_at"] is not None and float(out["started_at"]) >= asked - 0.01
        # A spare that died before it was given work is passed over: the other one takes it.
        spares = wait_for(lambda: _spares(zygote, 2), 20, "two spares again")
        dead, other = sorted(spares)
        os.kill(dead, signal.SIGKILL)
        wait_for(lambda: not _alive(dead), 10, "the killed spare's end")
        third = spawn(0, 3)
        assert third == other and _alive(third)
        left = wait_for(lambda: _spares(zygote, 3), 20, "a spare for each of the three ranks")
    finally:
        zygote.close(timeout=10)
    # Its spares go with it; its ranks train on (as orphans: killed here).
    wait_for(lambda: not any(map(_alive, left)), 10, "the spares to exit with their zygote")
    for pid in [*second, third]:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_rank_zero_hosts_the_rendezvous_store_before_its_code_runs(tmp_path: Path) -> None:
    """Both ranks connect as clients (as torch's rendezvous does under TORCHELASTIC_USE_AGENT_STORE):
    without rank 0's process hosting the store before its code runs, neither would find one."""
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    port = free_port()
    zygote = _zygote(tmp_path)
    try:
        for rank in (1, 0):
            env = dict(os.environ, RANK=str(rank), OUT=str(tmp_path / f"meet{rank}.json"), STORE_KEY="1",
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2")
            if rank == 0:
                env[ENV_HOST_STORE] = "1"
            env.pop(ENV_STARTED_AT, None)
            zygote.spawn(rank, env, str(tmp_path / f"meet{rank}.log"), str(tmp_path), f"path:{script}", [])
        met = [wait_for(lambda r=r: (tmp_path / f"meet{r}.json").exists() and json.loads(
            (tmp_path / f"meet{r}.json").read_text()), 30, f"rank {r} to meet") for r in (0, 1)]
        assert all("met_s" in m for m in met), met
    finally:
        zygote.close(timeout=10)
