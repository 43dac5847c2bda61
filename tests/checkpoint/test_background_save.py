"""Memory-tier saves written by the rank's background writer process (``trainguard.checkpoint.savewriter``):
what was handed over is what gets committed, whatever the rank does next or dies of, and a writer
killed from outside costs at most the save it held, reported."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import torch
from torch import nn

import trainguard
from tests.helpers.waiting import wait_for
from trainguard.agent.checkpoint.memory import MemoryTier
from trainguard.checkpoint.dcpstate import load


def _env(root: Path, job: str) -> dict[str, str]:
    return {"TRAINGUARD_SOCKET": "/nonexistent", "TRAINGUARD_JOB": job,
            "TRAINGUARD_CKPT_MEMORY_ROOT": str(root), "TRAINGUARD_CKPT_MEMORY_EVERY": "1"}


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_the_state_as_handed_over_is_committed_though_training_changes_it_at_once(tmp_path: Path) -> None:
    root = tmp_path / "shm"
    run = trainguard.init(environ=_env(root, "iso"))
    model = nn.Sequential(*[nn.Linear(32, 32) for _ in range(8)])
    state = {"model": model, "note": "step 1"}
    with run.step(0):
        pass
    want = {k: v.clone() for k, v in model.state_dict().items()}
    assert run.checkpoint(0, state) is True
    with torch.no_grad():  # the next steps, in place, while the writer may still be writing
        for p in model.parameters():
            p.add_(1.0)
    state["note"] = "changed"
    assert run.wait_checkpoint() is True
    tier = MemoryTier(str(root))
    assert [i.step for i in tier.list("iso")] == [1] and tier.verify("iso", 1).ok
    fresh = nn.Sequential(*[nn.Linear(32, 32) for _ in range(8)])
    loaded = {"model": fresh, "note": ""}
    meta = load(str(tier.step_path("iso", 1)), loaded, rank=0)
    assert meta["step"] == 1 and loaded["note"] == "step 1"
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, want[k]), k
    run.close()


_DYING_RANK = textwrap.dedent("""
    import os, signal, sys, torch
    from torch import nn
    import trainguard
    run = trainguard.init(environ={"TRAINGUARD_SOCKET": "/nonexistent", "TRAINGUARD_JOB": "die",
                                   "TRAINGUARD_CKPT_MEMORY_ROOT": sys.argv[1], "TRAINGUARD_CKPT_MEMORY_EVERY": "1"})
    torch.manual_seed(3)
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(24)])  # 6 MB: the write takes a while
    optim = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 256)).sum().backward()
    optim.step()
    torch.save(model.state_dict(), sys.argv[2])
    with run.step(0):
        pass
    run.checkpoint(0, {"model": model, "optim": optim})
    os.kill(os.getpid(), signal.SIGKILL)  # dies with the save handed over, not yet committed
""")


def test_a_rank_killed_right_after_a_save_still_gets_it_committed_and_leaves_no_process(tmp_path: Path) -> None:
    root, want = tmp_path / "shm", tmp_path / "want.pt"
    proc = subprocess.Popen([sys.executable, "-c", _DYING_RANK, str(root), str(want)])
    writers: list[int] = []
    while proc.poll() is None:
        writers = _children(proc.pid) or writers
        time.sleep(0.002)
    assert proc.returncode == -signal.SIGKILL
    tier = MemoryTier(str(root))
    wait_for(lambda: [i.step for i in tier.list("die")] == [1], 30, "step 1 committed",
             diagnose=lambda: str(list(tier.list("die"))))
    assert tier.verify("die", 1).ok
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(24)])
    load(str(tier.step_path("die", 1)), {"model": model}, rank=0)
    saved = torch.load(want, weights_only=True)
    assert all(torch.equal(v, saved[k]) for k, v in model.state_dict().items())
    assert writers, "the rank started no writer process"
    wait_for(lambda: not any(_alive(p) for p in writers), 10.0, "the writer to end with its rank")


def test_a_writer_killed_from_outside_costs_only_the_save_it_held(tmp_path: Path) -> None:
    root = tmp_path / "shm"
    run = trainguard.init(environ=_env(root, "wk"))
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(24)])
    state = {"model": model}
    with run.step(0):
        pass
    before = set(_children(os.getpid()))
    assert run.checkpoint(0, state) and run.wait_checkpoint() is True
    (writer,) = set(_children(os.getpid())) - before
    assert run.checkpoint(1, state) is True
    os.kill(writer, signal.SIGKILL)  # while it writes step 2 (or just after: then step 2 is there)
    ok = run.wait_checkpoint()
    tier = MemoryTier(str(root))
    steps = [i.step for i in tier.list("wk")]
    assert (ok, steps) in ((False, [1]), (True, [1, 2])), (ok, steps)
    assert run.checkpoint_failures == (0 if ok else 1)
    assert run.checkpoint(2, state) is True and run.wait_checkpoint() is True
    assert 3 in [i.step for i in tier.list("wk")] and tier.verify("wk", 3).ok
    assert not _alive(writer)
    run.close()
    wait_for(lambda: not set(_children(os.getpid())) - before, 10.0, "no child left behind",
             diagnose=lambda: str(_children(os.getpid())))
