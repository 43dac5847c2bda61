"""A torchrun command line with ``torchrun`` replaced by ``trainguard run`` runs the same on one
node, through a real agent: each rank sees torchrun's environment and the script's arguments, as
under torchrun itself (run here too, ``python -m torch.distributed.run``), and the ranks meet in
a gloo all_reduce."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow

SCRIPT = """\
import json, os, sys
import torch
import torch.distributed as dist

dist.init_process_group("gloo")  # env://: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
t = torch.tensor([float(os.environ["RANK"]) + 1.0])
dist.all_reduce(t)
seen = {k: v for k, v in os.environ.items()
        if k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                 "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS")
        or k.startswith("TORCHELASTIC_")}
out = {"env": seen, "argv": sys.argv[1:], "sum": t.item(), "rank_from_dist": dist.get_rank(), "main": __name__,
       "python": os.path.realpath(sys.executable)}
with open(os.path.join(os.environ["DUMP_DIR"], f"rank{os.environ['RANK']}.json"), "w") as f:
    json.dump(out, f)
dist.destroy_process_group()
print("rank", os.environ["RANK"], "done")
"""

# Command lines, each run after both launchers' names: torchrun's standalone form, and the
# rendezvous form of a single node running a module (torchrun's run id is then the --rdzv-id).
LINES = {
    "standalone": ["--standalone", "--nproc-per-node", "2", "--max-restarts", "0", "train.py", "--arg", "x",
                   "--lr", "0.1"],
    "rdzv-module": ["--nnodes", "1", "--nproc_per_node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                    "localhost:0", "--rdzv-id", "dropin-7", "--max_restarts", "0", "-m", "pkg.train", "--arg", "x",
                    "--lr", "0.1"],
}
# Variables both launchers set to the same values for the same rank.
SAME = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
        "ROLE_WORLD_SIZE", "ROLE_NAME", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "OMP_NUM_THREADS")


def _run(launcher: list[str], line: list[str], workdir: Path, dump: Path,
         extra_env: dict[str, str]) -> tuple[subprocess.CompletedProcess[str], list[dict[str, Any]]]:
    dump.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PET_") and k != "OMP_NUM_THREADS"}
    env.update({"PYTHONPATH": str(REPO), "DUMP_DIR": str(dump), **extra_env})
    res = subprocess.run([*launcher, *line], cwd=workdir, capture_output=True, text=True, timeout=240, env=env)
    ranks = [json.loads((dump / f"rank{r}.json").read_text()) for r in (0, 1) if (dump / f"rank{r}.json").exists()]
    return res, ranks


@pytest.mark.parametrize("form", sorted(LINES))
def test_the_torchrun_line_runs_unchanged_through_the_agent(agent_factory: Any, tmp_path: Path, form: str) -> None:
    agent = agent_factory(config="[agent]\ninterval_s = 0.25\n[collectors]\ngpu = false\n")
    line = LINES[form]
    (tmp_path / "train.py").write_text(SCRIPT)
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "train.py").write_text(SCRIPT)
    # The agent is found through TRAINGUARD_STATE_DIR, as the ranks' API finds it.
    ours, got = _run([sys.executable, "-m", "trainguard", "run"], line, tmp_path, tmp_path / "ours",
                     {"TRAINGUARD_STATE_DIR": str(agent.state_dir)})
    assert ours.returncode == 0, ours.stderr[-3000:]
    assert "from this process" not in ours.stderr  # through the agent, not the agentless fallback
    assert sorted(line for line in ours.stdout.splitlines()) == ["[rank0]:rank 0 done", "[rank1]:rank 1 done"]
    jobs = [j for j in agent.client().status()["jobs"] if j["state"] == "succeeded"]
    assert len(jobs) == 1, agent.client().status()["jobs"]
    theirs, want = _run([sys.executable, "-m", "torch.distributed.run"], line, tmp_path, tmp_path / "torchrun", {})
    assert theirs.returncode == 0, theirs.stderr[-3000:]
    assert len(got) == len(want) == 2
    for rank, (mine, ref) in enumerate(zip(got, want, strict=True)):
        assert mine["argv"] == ref["argv"] == ["--arg", "x", "--lr", "0.1"]
        assert mine["sum"] == ref["sum"] == 3.0 and mine["rank_from_dist"] == ref["rank_from_dist"] == rank
        assert mine["python"] == ref["python"] and mine["main"] == ref["main"] == "__main__"
        assert {k: mine["env"].get(k) for k in SAME} == {k: ref["env"].get(k) for k in SAME}, (mine, ref)
        assert mine["env"]["RANK"] == str(rank) and mine["env"]["LOCAL_WORLD_SIZE"] == "2"
        for key in ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE"):
            assert mine["env"].get(key) and ref["env"].get(key), key
        assert mine["env"]["TORCHELASTIC_RUN_ID"] == jobs[0]["job"]
        if "--rdzv-id" in line:
            assert jobs[0]["job"] == ref["env"]["TORCHELASTIC_RUN_ID"] == "dropin-7"
