"""A 2-node x 1-rank job under a real Slurm cluster, launched as a torchrun user would with
``torchrun`` replaced by ``trainguard run`` (``sbatch``, ``srun``, c10d rendezvous at the first
node), faults from outside: a rank SIGKILLed, then a whole node (its ranks and its slurmd) lost
under ``--no-kill`` with ``--nnodes 1:2``. No node daemon runs: each ``trainguard run`` keeps its
node's ranks itself."""

from __future__ import annotations

import json
import os
import re
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.events import memory_checkpoints as logged_memory_checkpoints
from tests.helpers.waiting import wait_for
from tests.slurm.cluster import SlurmCluster

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("slurm"), pytest.mark.timeout(300)]

TRAIN = Path(__file__).resolve().parent / "train_gloo.py"


def batch_script(out: Path, nnodes: str, srun_options: str = "", run_options: str = "") -> str:
    return f"""#!/bin/bash
HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)
srun {srun_options} --ntasks-per-node=1 trainguard run --nnodes {nnodes} --nproc-per-node 1 \\
    --rdzv-backend c10d --rdzv-endpoint "$HEAD:29500" --rdzv-id "$SLURM_JOB_ID" {run_options} \\
    {TRAIN} {out}
echo "srun exited $?"
"""


class Ranks:
    """What the ranks wrote (``train_gloo.py``'s lines), per node, read afresh on each call."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def lines(self, node: str) -> list[dict[str, Any]]:
        got = []
        for path in sorted(self.out.glob(f"{node}-rank*.log")):
            for line in path.read_text().splitlines():
                try:
                    got.append(json.loads(line))
                except ValueError:
                    continue  # a line being written
        return got

    def starts(self, node: str) -> list[dict[str, Any]]:
        return [e for e in self.lines(node) if e["event"] == "start"]

    def done_after_start(self, node: str, start: dict[str, Any]) -> list[int]:
        """Steps done by the attempt that logged ``start``."""
        lines = self.lines(node)
        at = next(i for i, e in enumerate(lines) if e == start)
        steps = []
        for e in lines[at + 1:]:
            if e["event"] == "start":
                break
            if e["event"] == "done":
                steps.append(int(e["step"]))
        return steps


def diagnosis(slurm: SlurmCluster, out: Path, job_output: Path) -> Callable[[], str]:
    def text() -> str:
        ranks = "\n".join(f"--- {p.name} ---\n{p.read_text(errors='replace')[-1500:]}" for p in sorted(out.glob("*.log")))
        job = job_output.read_text(errors="replace")[-4000:] if job_output.exists() else "(no job output)"
        return f"--- job output ---\n{job}\n{ranks}\n{slurm.diagnose()}"
    return text


def memory_checkpoints(slurm: SlurmCluster, job_output: Path) -> list[int]:
    """Steps of the memory-tier checkpoints the nodes' agents committed, from their event logs: the
    node daemons', or those of the agents ``trainguard run`` hosted (it printed their paths)."""
    text = job_output.read_text(errors="replace") if job_output.exists() else ""
    logs = [Path(p) for p in re.findall(r"hosting one for this job \(pid \d+, state \S+, events (\S+)\)", text)]
    logs += [n.state_dir / "events" / "events.jsonl" for n in slurm.nodes.values() if slurm.agents]
    return logged_memory_checkpoints(logs)


def start_job(slurm: SlurmCluster, tmp_path: Path, nnodes: str, *, sbatch: tuple[str, ...] = (),
              srun: str = "", run: str = "") -> tuple[str, Ranks, Path, Callable[[], str]]:
    out = tmp_path / "ranks"
    out.mkdir()
    job_output = tmp_path / "job.out"
    job = slurm.sbatch(batch_script(out, nnodes, srun, run), "-N2", f"--output={job_output}", *sbatch)
    ranks = Ranks(out)
    diag = diagnosis(slurm, out, job_output)
    # both nodes train: each one's first attempt has done a few steps
    wait_for(lambda: all(ranks.starts(n) and len(ranks.done_after_start(n, ranks.starts(n)[-1])) >= 5
                         for n in ("n1", "n2")), 180, "both nodes training", interval=0.2, diagnose=diag)
    return job, ranks, out, diag


@pytest.mark.parametrize("cluster", ["slurm", "slurm_agents"], ids=["no-daemon", "node-daemon"])
def test_a_killed_rank_restarts_both_nodes_with_at_most_one_step_lost(cluster: str, request: pytest.FixtureRequest,
                                                                      tmp_path: Path) -> None:
    """Without a node daemon each ``trainguard run`` hosts an agent for its node; with one (named
    by Slurm's TaskProlog in TRAINGUARD_STATE_DIR) it hands the node's ranks to it. Either way the
    ranks resume from their snapshots."""
    slurm: SlurmCluster = request.getfixturevalue(cluster)
    job, ranks, out, diag = start_job(slurm, tmp_path, "2")
    first = {n: ranks.starts(n)[-1] for n in ("n1", "n2")}
    os.kill(int(first["n2"]["pid"]), signal.SIGKILL)

    def restarted() -> bool:
        return all(len(ranks.starts(n)) >= 2 and ranks.done_after_start(n, ranks.starts(n)[-1]) for n in ("n1", "n2"))

    wait_for(restarted, 120, "both nodes' ranks restarted and training", interval=0.2, diagnose=diag)
    for node in ("n1", "n2"):
        again = ranks.starts(node)[1]
        last_done = max(ranks.done_after_start(node, first[node]), default=-1)
        assert again["pid"] != first[node]["pid"], f"{node}'s rank was not restarted\n{diag()}"
        assert again["world"] == 2 and again["attempt"] >= 1, f"{node}: {again}\n{diag()}"
        # resuming at the last step done redoes that one step; any earlier loses more
        assert again["step"] >= last_done, f"{node} resumed at {again['step']}, had done {last_done}\n{diag()}"
    (out / "finish").touch()
    state = slurm.wait_job(job, ["COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"], 120)
    assert state["JobState"] == "COMPLETED" and state["ExitCode"] == "0:0", f"{state}\n{diag()}"
    assert all(ranks.lines(n)[-1]["event"] == "end" for n in ("n1", "n2")), diag()


def lose_a_node(slurm: SlurmCluster, tmp_path: Path) -> tuple[dict[str, Any], list[int], Callable[[], str]]:
    """A 2-node job under ``--no-kill`` with ``--nnodes 1:2`` loses n2 for good (its slurmd,
    trainguard run and rank at once; the batch script runs on n1) once a memory-tier checkpoint
    is committed; returns n1's start with world size 1, the committed steps and the diagnosis,
    after the job finished."""
    # a short last call: the round after the loss waits that long for a second node
    job, ranks, out, diag = start_job(slurm, tmp_path, "1:2", sbatch=("--no-kill",), srun="--no-kill",
                                      run="--rdzv-conf last_call_timeout=3")
    committed = wait_for(lambda: memory_checkpoints(slurm, tmp_path / "job.out"), 120, "a memory-tier checkpoint",
                         interval=0.2, diagnose=diag)
    slurm.kill_node("n2")

    def alone() -> list[dict[str, Any]]:
        starts = [s for s in ranks.starts("n1") if s["world"] == 1]
        return starts if starts and len(ranks.done_after_start("n1", starts[-1])) >= 3 else []

    resumed = wait_for(alone, 150, "n1 training alone (world size 1)", interval=0.2, diagnose=diag)[-1]
    slurm.wait_states({"n2": "down"}, 60)
    (out / "finish").touch()
    state = slurm.wait_job(job, ["COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"], 120)
    assert ranks.lines("n1")[-1]["event"] == "end", diag()
    assert state["JobState"] == "COMPLETED" and state["NodeList"] == "n1", f"{state}\n{diag()}"
    return resumed, committed, diag


@pytest.mark.parametrize("cluster", ["slurm", "slurm_agents"], ids=["no-daemon", "node-daemon"])
def test_a_lost_node_under_no_kill_leaves_the_job_training_on_one_node(cluster: str, request: pytest.FixtureRequest,
                                                                       tmp_path: Path) -> None:
    """Slurm keeps the job and shrinks it to n1; n1's ranks restart alone and train to the end."""
    slurm: SlurmCluster = request.getfixturevalue(cluster)
    resumed, _committed, diag = lose_a_node(slurm, tmp_path)
    assert resumed["attempt"] >= 1, f"{resumed}\n{diag()}"


def test_after_a_node_loss_the_survivor_resumes_from_the_memory_tier(slurm: SlurmCluster, tmp_path: Path) -> None:
    """A world of one node is one no snapshot is of: n1 resumes from its agent's memory tier, and
    its one rank takes the global batch the two had (2 x 8)."""
    resumed, committed, diag = lose_a_node(slurm, tmp_path)
    assert resumed["step"] >= max(committed), f"n1 resumed at {resumed['step']}, after {committed}\n{diag()}"
    assert resumed["restored"] == "checkpoint" and resumed["batch"] == 16, f"{resumed}\n{diag()}"


def test_a_signal_slurm_sends_the_step_reaches_every_nodes_ranks(slurm: SlurmCluster, tmp_path: Path) -> None:
    """``scancel -s USR1`` (as ``--signal=USR1@T`` does before the time limit) signals each node's
    ``trainguard run``, which passes it on to its ranks; the job trains on to the end."""
    job, ranks, out, diag = start_job(slurm, tmp_path, "2")
    slurm.client("scancel", "-s", "USR1", job)
    wait_for(lambda: all(any(e["event"] == "signal" for e in ranks.lines(n)) for n in ("n1", "n2")), 60,
             "SIGUSR1 at both nodes' ranks", interval=0.2, diagnose=diag)
    (out / "finish").touch()
    state = slurm.wait_job(job, ["COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"], 120)
    assert state["JobState"] == "COMPLETED" and state["ExitCode"] == "0:0", f"{state}\n{diag()}"
    assert all(ranks.lines(n)[-1]["event"] == "end" for n in ("n1", "n2")), diag()

