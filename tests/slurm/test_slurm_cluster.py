"""The harness itself: two idle nodes, and a step that runs on both with each node's own name."""

from __future__ import annotations

import pytest

from tests.slurm.cluster import REPO, SlurmCluster

pytestmark = pytest.mark.xdist_group("slurm")


def test_two_idle_nodes_run_a_step_each_under_its_own_name(slurm: SlurmCluster) -> None:
    assert slurm.node_states() == {"n1": "idle", "n2": "idle"}
    out = slurm.client("srun", "-N2", "--ntasks-per-node=1", "hostname").stdout.split()
    assert sorted(out) == ["n1", "n2"]
    # a step runs in its node's network: each task sees its own address and the repository under test
    code = ("import os, socket, trainguard; "
            "print(socket.gethostbyname(socket.gethostname()), os.path.dirname(trainguard.__path__[0]))")
    out = slurm.client("srun", "-N2", "--ntasks-per-node=1", "python", "-c", code).stdout.splitlines()
    assert sorted(out) == [f"10.232.0.11 {REPO}", f"10.232.0.12 {REPO}"]
    # and a /dev/shm of its own, as a real node has
    out = slurm.client("srun", "-N2", "--ntasks-per-node=1", "sh", "-c",
                       'touch "/dev/shm/tgsl-$(hostname)"; echo $(hostname) $(ls /dev/shm)').stdout.splitlines()
    assert sorted(out) == ["n1 tgsl-n1", "n2 tgsl-n2"]


def test_with_node_daemons_each_task_finds_its_own_nodes_agent(slurm_agents: SlurmCluster) -> None:
    out = slurm_agents.client("srun", "-N2", "--ntasks-per-node=1", "sh", "-c",
                              'echo "$(hostname) $TRAINGUARD_STATE_DIR"; trainguard status --json --state-dir "$TRAINGUARD_STATE_DIR"').stdout
    for name, node in slurm_agents.nodes.items():
        assert f"{name} {node.state_dir}\n" in out, out
        assert f'"node": "{name}"' in out, out
