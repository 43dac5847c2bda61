"""Slurm with a node daemon on every node: the ranks are the agent's children, outside the Slurm
step, so ending the step (``scancel``, the time limit) must end them through ``trainguard run``."""

from __future__ import annotations

import time

import pytest

from tests.slurm.cluster import SlurmCluster
from trainguard.agent.api.client import ApiClient

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("slurm")]

SCRIPT = """#!/bin/bash
HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)
srun --ntasks-per-node=1 trainguard run --nnodes {nnodes} --nproc-per-node 1 --rdzv-backend c10d \\
    --rdzv-endpoint "$HEAD:29500" --rdzv-id "$SLURM_JOB_ID" \\
    -- python -c 'import time; print("up", flush=True); time.sleep(600)'
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("nnodes", ["1", "2"], ids=["a-job-per-node", "one-job-over-both"])
def test_scancel_stops_the_ranks_the_node_daemons_run(slurm_agents: SlurmCluster, nnodes: str) -> None:
    job = slurm_agents.sbatch(SCRIPT.format(nnodes=nnodes), "-N2", f"--output={slurm_agents.root / 'job.out'}")
    clients = {n: ApiClient.local(str(node.state_dir / "run" / "agent.sock"), timeout=5)
               for n, node in slurm_agents.nodes.items()}

    def rank_pids() -> dict[str, int]:
        pids: dict[str, int] = {}
        for name, client in clients.items():
            try:
                ranks = client.job(job)["ranks"]
            except Exception:  # noqa: BLE001 - not submitted yet
                continue
            pids.update((name, r["pid"]) for r in ranks if r.get("alive") and r.get("pid"))
        return pids

    deadline = time.monotonic() + 60
    while len(pids := rank_pids()) < 2:
        assert time.monotonic() < deadline, f"ranks not running on both nodes: {pids}\n{slurm_agents.diagnose()}"
        time.sleep(0.2)
    slurm_agents.client("scancel", job)
    slurm_agents.wait_job(job, ["CANCELLED"], 30)
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid in pids.values()):
        assert time.monotonic() < deadline, f"ranks {pids} outlived their cancelled step\n{slurm_agents.diagnose()}"
        time.sleep(0.2)
    for name, client in clients.items():
        assert client.job(job)["state"] in ("stopped", "failed"), f"{name}: {client.job(job)}"
