"""Memory-tier saves of data-parallel replicas whose all-gather runs while training goes on
(``TierWriter._agree_later``, where per-step snapshots cover a crash): committed with every rank's
own RNG state, also by a script that never closes its run; a replica whose state layout changed
meets no collective the others would never enter; a failed agreement costs that save only."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import torch

from trainguard.agent.checkpoint.memory import MemoryTier
from trainguard.agent.lifecycle.launcher import free_port
from trainguard.checkpoint.tier import TierWriter, _Agreement
from trainguard.run.environment import RunEnvironment

RANK_SCRIPT = textwrap.dedent('''
    import json, os, sys
    import torch, torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    import trainguard

    mode, out = sys.argv[1], sys.argv[2]
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ddp = DDP(model)
    run = trainguard.init()
    state = {"model": model, "optim": opt}
    torch.manual_seed(100 + rank)  # each rank's RNG its own: so must each RNG file be
    rngs = {}
    for step in range(15):
        with run.step(step):
            ddp(torch.randn(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
        if mode == "diverge" and rank == 1 and step == 5:
            state["extra"] = torch.zeros(3)  # after the first save: no longer the agreed layout
        rngs[step + 1] = torch.get_rng_state().tolist()
        run.checkpoint(step, state)
    writer = run._writer
    with open(f"{out}.{rank}.json", "w") as fh:
        json.dump({"later": writer.stats.agreed_later, "failures": run.checkpoint_failures, "rngs": rngs}, fh)
    if mode != "no-close":
        run.close()
    del ddp
    dist.destroy_process_group()
''')


def _job(tmp_path: Path, mode: str) -> tuple[MemoryTier, list[dict[str, Any]]]:
    """Two replicas as torchrun starts them (separate interpreters: a script that never closes
    its run ends through atexit), snapshots every step, a memory-tier save every 5 steps."""
    script = tmp_path / "ranks.py"
    script.write_text(RANK_SCRIPT)
    root, out = tmp_path / "tier", str(tmp_path / "out")
    port = free_port()
    procs = []
    for rank in (0, 1):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TRAINGUARD_SOCKET="/nonexistent",
                   TRAINGUARD_JOB="rep", TRAINGUARD_CKPT_MEMORY_ROOT=str(root), TRAINGUARD_CKPT_MEMORY_EVERY="5",
                   TRAINGUARD_SNAPSHOT_DIR=str(tmp_path / "snap"), TRAINGUARD_SNAPSHOT_EVERY="1")
        procs.append(subprocess.Popen([sys.executable, str(script), mode, out], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    try:
        outputs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:  # a rank waiting forever in a collective (the hang these tests look for)
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0, 0], outputs
    return MemoryTier(str(root)), [json.loads(Path(f"{out}.{r}.json").read_text()) for r in (0, 1)]


def _rng_file(tier: MemoryTier, step: int, rank: int) -> list[int]:
    states = torch.load(tier.step_path("rep", step) / "rng" / f"rank{rank}.pt", weights_only=False)
    return states["torch"].tolist()


def test_saves_agreed_while_training_goes_on_are_committed_with_each_ranks_rng(tmp_path: Path) -> None:
    tier, ranks = _job(tmp_path, "close")
    assert [r["later"] for r in ranks] == [2, 2]  # the first save agrees in the step, the next two later
    assert [r["failures"] for r in ranks] == [0, 0]
    assert [i.step for i in tier.list("rep")] == [5, 10, 15]
    for step in (5, 10, 15):
        assert tier.verify("rep", step).ok
        for rank in (0, 1):
            assert _rng_file(tier, step, rank) == ranks[rank]["rngs"][str(step)]


def test_a_script_that_never_closes_its_run_still_gets_its_last_save(tmp_path: Path) -> None:
    """The last save's rows came in after its last checkpoint call: atexit hands it over."""
    tier, ranks = _job(tmp_path, "no-close")
    assert [r["later"] for r in ranks] == [2, 2]
    assert [i.step for i in tier.list("rep")] == [5, 10, 15]
    assert _rng_file(tier, 15, 1) == ranks[1]["rngs"]["15"]


def test_a_replica_whose_layout_changed_costs_one_save_and_no_hang(tmp_path: Path) -> None:
    """Rank 1's state gains a key after the first save: at the second, rank 0 (still the agreed
    layout) goes on while rank 1 waits for the rows; rank 1 sees that a rank went on and gives the
    save up rather than start DCP's collective save alone, rank 0 drops it when its rows come in.
    The third save agrees first on both and, the layouts differing, is DCP's collective save."""
    tier, ranks = _job(tmp_path, "diverge")
    assert [r["later"] for r in ranks] == [1, 0]
    assert [r["failures"] for r in ranks] == [1, 1]
    assert [i.step for i in tier.list("rep")] == [5, 15]
    assert tier.verify("rep", 15).ok
    files = {p.name for p in tier.step_path("rep", 15).iterdir() if p.suffix == ".distcp"}
    assert files == {"__0_0.distcp", "__1_0.distcp"}, files  # every rank wrote its part


class _FailedWork:
    def is_completed(self) -> bool:
        return True

    def wait(self) -> None:
        raise RuntimeError("Connection closed by peer [127.0.0.1]:1234")


def test_an_agreement_that_fails_drops_its_save_and_says_so(tmp_path: Path) -> None:
    """A rank gone before its row arrived: the all-gather fails on rank 0, whose staged save is
    removed and reported at its next poll; the next save agrees first."""
    env = RunEnvironment.from_environ({"TRAINGUARD_JOB": "rep", "TRAINGUARD_CKPT_MEMORY_ROOT": str(tmp_path / "tier")})
    writer = TierWriter(env)
    staged, error = writer._stage_here(20)
    assert staged is not None and error is None and Path(staged).is_dir()
    row = torch.zeros(4, dtype=torch.uint8)
    writer._agreed_layout = 7
    writer._pending = _Agreement(20, staged, row, [row, row], _FailedWork(), job=object())  # type: ignore[arg-type]
    failed = writer.poll()
    assert len(failed) == 1 and failed[0][0] == 20 and "Connection closed by peer" in failed[0][1], failed
    assert not Path(staged).exists() and writer.stats.failures == 1
    assert writer._agreed_layout is None and writer._pending is None
    assert writer.poll() == []
    assert MemoryTier(str(tmp_path / "tier")).list("rep") == []
