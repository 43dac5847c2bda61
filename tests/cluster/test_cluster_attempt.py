"""Ranks of a spanning job scope what they agree on by the cluster's attempt, and bind gloo/NCCL to
the interface of the advertised address (real processes through the supervisor; a fake interface
table)."""

from __future__ import annotations

import socket
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from trainguard.agent.cluster.netif import interface_for, socket_ifname
from trainguard.agent.eventlog import EventLog
from trainguard.agent.lifecycle.jobs import JobSpec, JobState
from trainguard.agent.lifecycle.launcher import Launcher, free_port
from trainguard.agent.lifecycle.plans import PlanStore
from trainguard.agent.lifecycle.ranks import LaunchContext, RankBlock
from trainguard.agent.lifecycle.supervisor import Supervisor
from trainguard.run.environment import RunEnvironment, plan_prefix

DUMP_ENV = [sys.executable, "-c", "import json, os; print('ENV=' + json.dumps(dict(os.environ)))"]


def make_supervisor(tmp_path: Path) -> Supervisor:
    events = EventLog(str(tmp_path / "events"), "n1", fsync=False)
    plans = PlanStore(str(tmp_path / "plans"))

    def ctx(spec: JobSpec) -> LaunchContext:
        return LaunchContext(telemetry_socket=str(tmp_path / "telemetry.sock"), plan_path=plans.path(spec.job),
                             log_dir=str(tmp_path / "jobs" / spec.job))

    return Supervisor(events, plans, Launcher(mode="cold"), ctx, stop_grace_s=3)  # type: ignore[arg-type]


def rank_env(sup: Supervisor, tmp_path: Path, job: str, rank: int) -> dict[str, str]:
    deadline = time.monotonic() + 60
    while sup.jobs[job].state not in (JobState.SUCCEEDED, JobState.FAILED):
        assert time.monotonic() < deadline, f"job {job} still {sup.jobs[job].state}"
        time.sleep(0.05)
    text = (tmp_path / "jobs" / job / f"rank{rank}.log").read_text()
    line = next(ln for ln in text.splitlines() if "ENV=" in ln)
    import json

    env: dict[str, str] = json.loads(line.split("ENV=", 1)[1])
    return env


def test_block_of_a_later_attempt_on_a_node_new_to_the_job_uses_the_cluster_attempt(tmp_path: Path) -> None:
    """The spare's situation after a node loss: it never ran the job, the leader's attempt is 3."""
    sup = make_supervisor(tmp_path)
    try:
        block = RankBlock(1, 1, 2, "127.0.0.1", free_port(), 1, {}, 3, None, "lo")
        sup.submit(JobSpec("spanning", 2, command=DUMP_ENV), block=block, on_failure=lambda job, cause: None)
        env = rank_env(sup, tmp_path, "spanning", 1)
        assert env["TRAINGUARD_ATTEMPT"] == "3"
        assert env["TORCHELASTIC_RESTART_COUNT"] == "2"
        assert env["RANK"] == "1" and env["WORLD_SIZE"] == "2"
        assert env["GLOO_SOCKET_IFNAME"] == "lo" and env["NCCL_SOCKET_IFNAME"] == "lo"
        assert sup.jobs["spanning"].attempt == 3
        # What the rank derives from it: the same plan-sync keys rank 0 of attempt 3 writes.
        run_env = RunEnvironment.from_environ(env)
        assert run_env.attempt == 2 and plan_prefix(run_env.attempt) == "trainguard/plan/2/"
    finally:
        sup.launcher.close_job("spanning")
        sup.close()


def test_job_env_names_its_own_interface_and_single_node_jobs_count_locally(tmp_path: Path) -> None:
    sup = make_supervisor(tmp_path)
    try:
        block = RankBlock(0, 1, 1, "127.0.0.1", free_port(), 0, {}, 5, None, "lo")
        sup.submit(JobSpec("own-if", 1, command=DUMP_ENV, env={"GLOO_SOCKET_IFNAME": "eth7"}), block=block,
                   on_failure=lambda job, cause: None)
        env = rank_env(sup, tmp_path, "own-if", 0)
        assert env["GLOO_SOCKET_IFNAME"] == "eth7" and env["NCCL_SOCKET_IFNAME"] == "lo"
        assert env["TRAINGUARD_ATTEMPT"] == "5"

        sup.submit(JobSpec("local", 1, command=DUMP_ENV))
        env = rank_env(sup, tmp_path, "local", 0)
        assert env["TRAINGUARD_ATTEMPT"] == "1" and env["TORCHELASTIC_RESTART_COUNT"] == "0"
        assert "GLOO_SOCKET_IFNAME" not in env or env["GLOO_SOCKET_IFNAME"] != "lo"
    finally:
        for job in ("own-if", "local"):
            sup.launcher.close_job(job)
        sup.close()


def test_agent_attempt_wins_over_an_inherited_torchelastic_count() -> None:
    env = {"TRAINGUARD_JOB": "j", "TRAINGUARD_SOCKET": "/x.sock", "TRAINGUARD_ATTEMPT": "4",
           "TORCHELASTIC_RESTART_COUNT": "0"}
    assert RunEnvironment.from_environ(env).attempt == 3
    # Under torchrun alone its restart count is the attempt.
    assert RunEnvironment.from_environ({"RANK": "0", "TORCHELASTIC_RESTART_COUNT": "2"}).attempt == 2
    # A garbled value is no crash.
    assert RunEnvironment.from_environ({**env, "TRAINGUARD_ATTEMPT": "x"}).attempt == 0


def _addr(address: str, family: int = socket.AF_INET) -> SimpleNamespace:
    return SimpleNamespace(family=family, address=address)


TABLE = {
    "lo": [_addr("127.0.0.1"), _addr("::1", socket.AF_INET6)],
    "eth0": [_addr("00:11:22:33:44:55", getattr(socket, "AF_PACKET", 17)), _addr("10.9.0.12")],
    "eth1": [_addr("fd00::5", socket.AF_INET6)],
}


def no_dns(host: str) -> list[str]:
    raise OSError(f"cannot resolve {host}")


def test_interface_of_the_advertised_address_from_a_fake_table() -> None:
    assert interface_for("10.9.0.12:7443", TABLE) == "eth0"
    assert interface_for("[fd00::5]:7443", TABLE) == "eth1"
    assert interface_for("node-b:7443", TABLE, resolve=lambda h: ["10.9.0.12"]) == "eth0"
    assert interface_for("10.9.0.99:7443", TABLE) == ""
    assert socket_ifname("10.9.0.12:7443", TABLE, hostname="node-b", resolve=no_dns) == ("eth0", "")
    # A loopback cluster (tests, one host): nothing to set, nothing to say.
    assert socket_ifname("127.0.0.1:7443", TABLE, hostname="h", resolve=lambda h: ["127.0.1.1"]) == ("", "")


def test_loopback_hostname_without_an_interface_for_the_address_is_told() -> None:
    name, warning = socket_ifname("10.9.0.99:7443", TABLE, hostname="debian",
                                  resolve=lambda h: ["127.0.1.1"] if h == "debian" else [])
    assert name == ""
    assert "127.0.1.1" in warning and "GLOO_SOCKET_IFNAME" in warning and "cluster.advertise" in warning
    # The host name resolves to a routable address: gloo advertises that one; no warning.
    assert socket_ifname("10.9.0.99:7443", TABLE, hostname="n", resolve=lambda h: ["10.9.0.98"]) == ("", "")
    # Neither resolves: nothing known, nothing claimed.
    assert socket_ifname("nowhere:7443", TABLE, hostname="n", resolve=no_dns) == ("", "")
