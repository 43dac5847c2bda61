"""What a launch works with: a job's rank processes, the context that tells them where the agent
is, and the block of global ranks this node runs with the torchrun environment it implies.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from trainguard.agent.lifecycle.jobs import JobSpec


class ProcessHandle(Protocol):
    """What the supervisor needs of a rank process: a Popen, a rank forked by the zygote, a unit."""

    @property
    def pid(self) -> int: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


@dataclass
class RankProcess:
    rank: int
    local_rank: int
    popen: ProcessHandle
    started: float
    log_path: str
    exit_code: int | None = None
    exit_signal: int | None = None
    ended: float | None = None
    gpu: int | None = None
    """The GPU the agent gave the rank (None: the rank's own choice)."""
    pidfd: int | None = field(default=None, init=False, repr=False, compare=False)
    """The supervisor's pidfd of the process (None: not opened yet; -1: none, or closed)."""
    pidfd_fired: bool = field(default=False, init=False, repr=False, compare=False)
    """The pidfd said the process ended; its exit status has not been reaped yet."""

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def alive(self) -> bool:
        return self.exit_code is None and self.exit_signal is None


@dataclass
class LaunchContext:
    """Where a job's ranks find the agent."""

    telemetry_socket: str
    plan_path: str
    log_dir: str
    master_addr: str = "127.0.0.1"
    python: str = ""
    user: str = ""
    """Run ranks as this user (``launcher.user``; empty: as the agent, without its capabilities)."""
    extra_env: dict[str, str] = field(default_factory=dict)
    run_dir: str = ""
    """The agent's runtime directory: rank units' environment files go in ``<run_dir>/env/<job>``
    (empty: ``<log_dir>/.env``)."""
    cpus: float = 0.0
    """CPU quota of the job's cgroup in CPUs (0: none)."""
    memory_max: int = 0
    """Memory ceiling of the job's cgroup in bytes (0: none)."""
    gpus: tuple[int, ...] | None = None
    """GPUs the job's ranks may use, in order (``CUDA_VISIBLE_DEVICES``, local rank i on the i-th);
    None leaves the environment's choice alone (nothing on the node has failed)."""


@dataclass(frozen=True)
class RankBlock:
    """This node's share of a job that spans nodes: global ranks ``rank_offset`` ..
    ``rank_offset + nproc - 1`` of ``world_size``, rendezvous at the leader-chosen master."""

    rank_offset: int
    nproc: int
    world_size: int
    master_addr: str
    master_port: int
    group_rank: int = 0
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment for this attempt (restore path, checkpoint part names)."""
    attempt: int = 0
    """The cluster-wide attempt these ranks belong to (a failure report names it)."""
    restore: dict[str, Any] | None = field(default=None, compare=False)
    """The checkpoint this attempt restores (shown in status, used for the recovery clock)."""
    socket_ifname: str = ""
    """The interface holding this node's advertised address: gloo and NCCL bind there unless the
    job's environment names one (the hostname may resolve to loopback, which peers cannot reach)."""
    rendezvous: bool = False
    """Handed by ``trainguard run --nnodes`` (``rdzvjobs``), not by the cluster leader: the ranks
    restore their own snapshots of ``snapshot_step``, the step every node's ranks hold."""
    snapshot_step: int | None = field(default=None, compare=False)
    restore_step: int | None = field(default=None, compare=False)
    """With no common snapshot: the whole checkpoint every node's ranks restore; the nodes that
    hold it (``restore_here``) load it from their tiers and send it to the other nodes' ranks."""
    restore_here: bool = field(default=False, compare=False)


SOCKET_IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def torchrun_env(spec: JobSpec, block: RankBlock, attempt: int, rank: int) -> dict[str, str]:
    """torchrun's environment contract beyond RANK/WORLD_SIZE/MASTER_*: what scripts written for
    torchrun (and the frameworks that detect it) read. ``rank`` is the global rank: with one role,
    torchrun's ROLE_RANK is the RANK."""
    return {
        "TORCHELASTIC_RESTART_COUNT": str(max(0, attempt - 1)),
        "TORCHELASTIC_MAX_RESTARTS": str(spec.max_restarts),
        "TORCHELASTIC_RUN_ID": spec.job,
        "TORCHELASTIC_USE_AGENT_STORE": "False",
        "GROUP_WORLD_SIZE": str(max(1, block.world_size // max(1, block.nproc))),
        "ROLE_NAME": "default",
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(block.world_size),
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    }


def visible_gpus(allowed: tuple[int, ...] | None, requested: str | None) -> tuple[int, ...] | None:
    """The GPUs a job's ranks get: ``allowed`` (the node's healthy GPUs), narrowed to the job's own
    ``CUDA_VISIBLE_DEVICES`` in its order when it names GPUs by index; None leaves it alone."""
    if allowed is None:
        return None
    if requested:
        try:
            wanted = [int(x) for x in requested.split(",") if x.strip()]
        except ValueError:  # UUIDs or MIG names: the healthy set by index is all that is known
            return allowed
        return tuple(g for g in wanted if g in allowed)
    return allowed
