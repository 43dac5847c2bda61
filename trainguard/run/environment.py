"""What a training process learns from its environment about its job and its node agent.

Three ways a rank can be started, one reader for all of them:

* by a trainguard agent (``trainguard run``, ``trainguard train``): ``TRAINGUARD_JOB``,
  ``TRAINGUARD_SOCKET``, ``TRAINGUARD_PLAN`` and the checkpoint variables are set by its launcher;
* by torchrun (or any launcher that sets ``RANK``/``WORLD_SIZE``) on a node that runs an agent: the
  agent is found through the discovery file it writes in its run directory
  (``/run/trainguard/agent.json``, or ``$TRAINGUARD_STATE_DIR/run/agent.json``), and the job is
  named after torchrun's run id;
* by anything else, or with no agent: every field is a harmless default and the run is a no-op.

Torch-free (the agent imports the ``trainguard`` package).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass

from trainguard.agent.wire import ENV_JOB, ENV_PLAN, ENV_SOCKET, valid_job_id

ENV_STATE_DIR = "TRAINGUARD_STATE_DIR"
ENV_ATTEMPT = "TRAINGUARD_ATTEMPT"
ENV_MEMORY_ROOT = "TRAINGUARD_CKPT_MEMORY_ROOT"
ENV_MEMORY_EVERY = "TRAINGUARD_CKPT_MEMORY_EVERY"
ENV_RESTORE = "TRAINGUARD_RESTORE"
ENV_PART = "TRAINGUARD_CKPT_PART"
ENV_PARTS = "TRAINGUARD_CKPT_PARTS"
ENV_SNAPSHOT_DIR = "TRAINGUARD_SNAPSHOT_DIR"
ENV_SNAPSHOT_EVERY = "TRAINGUARD_SNAPSHOT_EVERY"
ENV_SNAPSHOT_STEP = "TRAINGUARD_SNAPSHOT_STEP"
ENV_RESTORE_STEP = "TRAINGUARD_RESTORE_STEP"
ENV_LR_BATCH_RULE = "TRAINGUARD_LR_BATCH_RULE"
SNAPSHOT_AUTO = -1
DISCOVERY_NAME = "agent.json"
DEFAULT_RUN_DIR = "/run/trainguard"


def discovery_path(environ: Mapping[str, str]) -> str:
    """Where the node agent says where its sockets and tiers are."""
    state_dir = environ.get(ENV_STATE_DIR, "")
    run_dir = os.path.join(state_dir, "run") if state_dir else DEFAULT_RUN_DIR
    return os.path.join(run_dir, DISCOVERY_NAME)


def read_discovery(path: str) -> dict[str, object]:
    """The agent's discovery file, or {} when there is none (or it is unreadable)."""
    try:
        with open(path, "rb") as fh:
            body = json.loads(fh.read(65536))
    except (OSError, ValueError):
        return {}
    return body if isinstance(body, dict) else {}


def _int(environ: Mapping[str, str], key: str, default: int) -> int:
    try:
        return int(environ.get(key, "") or default)
    except ValueError:
        return default


def _attempt(environ: Mapping[str, str], launched: bool) -> int:
    """Restarts before this one. An agent's ``TRAINGUARD_ATTEMPT`` wins over a
    ``TORCHELASTIC_RESTART_COUNT`` the rank may have inherited from an outer torchrun: for a job
    spanning nodes it is the cluster's attempt, which every node's ranks scope their keys by."""
    if launched and environ.get(ENV_ATTEMPT, "").strip().isdigit():
        return max(0, int(environ[ENV_ATTEMPT]) - 1)
    return max(0, _int(environ, "TORCHELASTIC_RESTART_COUNT", max(0, _int(environ, ENV_ATTEMPT, 1) - 1)))


def plan_prefix(attempt: int) -> str:
    """The job store prefix of plan sync for ``attempt`` (``RunEnvironment.attempt``): every rank
    of one attempt, on whatever node, reads and writes under the same one."""
    return f"trainguard/plan/{attempt}/"


def _snapshot_every(text: str) -> int:
    if text.strip().lower() == "auto":
        return SNAPSHOT_AUTO
    try:
        return max(0, int(text or 0))
    except ValueError:
        return 0


def _torchrun_job(environ: Mapping[str, str]) -> str:
    run_id = environ.get("TORCHELASTIC_RUN_ID", "")
    if run_id and run_id != "none":
        name = f"torchrun-{run_id}"
    else:
        # torchrun's default run id is "none": ranks of one job share their rendezvous port.
        name = f"torchrun-{environ.get('MASTER_PORT', '0')}"
    name = "".join(c if c.isalnum() or c in "-_." else "-" for c in name)[:64]
    return name if valid_job_id(name) else "torchrun"


@dataclass(frozen=True)
class RunEnvironment:
    job: str
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    attempt: int
    """Restarts so far (TORCHELASTIC_RESTART_COUNT), 0 on the first start; for a job spanning nodes
    the cluster's attempt - 1, the same on every node (plan-sync keys and snapshot headers use it)."""
    socket: str
    """Telemetry socket ("" when no agent is known)."""
    plan_path: str
    memory_root: str
    """Memory checkpoint tier root ("" when there is none)."""
    memory_every: int
    restore_path: str
    """The checkpoint the agent picked for this attempt ("" when none)."""
    part: str
    """This node's name when the job spans nodes (its checkpoint part), else ""."""
    parts: tuple[str, ...]
    launched_by_agent: bool
    """True when a trainguard agent started this process (it restarts and restores the job)."""
    snapshot_dir: str = ""
    """Where this rank's per-step snapshots go ("" when none: ``trainguard.checkpoint.snapshot.writer``)."""
    snapshot_every: int = 0
    """Steps between snapshots: 0 none, SNAPSHOT_AUTO chosen from the measured stall."""
    snapshot_step: int = -1
    """The snapshot the agent picked for this attempt (-1: none; ``restore_path`` is the fallback)."""
    restore_step: int = -1
    """A job spanning nodes: the whole checkpoint the nodes agreed on (-1: none); ranks with a
    ``restore_path`` send it to those without (``trainguard.checkpoint.share``)."""
    group_rank: int = 0
    """The node's place among the job's nodes (torchrun's GROUP_RANK)."""
    lr_batch_rule: str = "sqrt"
    """How the LR follows a global batch the world changed (the agent's ``controller.lr_batch_rule``)."""

    @property
    def has_agent(self) -> bool:
        return bool(self.socket)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None, *, job: str | None = None) -> RunEnvironment:
        env = os.environ if environ is None else environ
        rank = _int(env, "RANK", 0)
        world = max(1, _int(env, "WORLD_SIZE", 1))
        local_rank = _int(env, "LOCAL_RANK", rank)
        local_world = max(1, _int(env, "LOCAL_WORLD_SIZE", world))
        launched = bool(env.get(ENV_JOB)) and bool(env.get(ENV_SOCKET))
        attempt = _attempt(env, launched)
        if launched:
            name = job or env[ENV_JOB]
            return cls(
                job=name, rank=rank, local_rank=local_rank, world_size=world, local_world_size=local_world,
                attempt=attempt, socket=env.get(ENV_SOCKET, ""), plan_path=env.get(ENV_PLAN, ""),
                memory_root=env.get(ENV_MEMORY_ROOT, ""), memory_every=max(1, _int(env, ENV_MEMORY_EVERY, 100)),
                restore_path=env.get(ENV_RESTORE, ""), part=env.get(ENV_PART, ""),
                parts=tuple(p for p in env.get(ENV_PARTS, "").split(",") if p), launched_by_agent=True,
                snapshot_dir=env.get(ENV_SNAPSHOT_DIR, ""), snapshot_every=_snapshot_every(env.get(ENV_SNAPSHOT_EVERY, "")),
                snapshot_step=_int(env, ENV_SNAPSHOT_STEP, -1), restore_step=_int(env, ENV_RESTORE_STEP, -1),
                group_rank=_int(env, "GROUP_RANK", 0), lr_batch_rule=env.get(ENV_LR_BATCH_RULE, "sqrt"))
        name = job or env.get(ENV_JOB) or (_torchrun_job(env) if "RANK" in env else "standalone")
        # What the environment names explicitly wins; the agent's discovery file fills the rest.
        found = read_discovery(discovery_path(env))
        socket = env.get(ENV_SOCKET) or str(found.get("telemetry_socket", "") or "")
        if socket and not env.get(ENV_SOCKET) and not os.path.exists(socket):
            socket = ""  # a discovery file left by an agent that is gone
        plans_dir = str(found.get("plans_dir", "")) if socket else ""
        plan_path = env.get(ENV_PLAN) or (os.path.join(plans_dir, f"{name}.json") if plans_dir else "")
        memory_root = env.get(ENV_MEMORY_ROOT) or (str(found.get("memory_root", "")) if socket else "")
        every = _int(env, ENV_MEMORY_EVERY, 0) or found.get("memory_every", 100)
        return cls(
            job=name, rank=rank, local_rank=local_rank, world_size=world, local_world_size=local_world,
            attempt=attempt, socket=socket, plan_path=plan_path, memory_root=memory_root,
            memory_every=every if isinstance(every, int) and every > 0 else 100,
            restore_path=env.get(ENV_RESTORE, ""), part="", parts=(), launched_by_agent=False,
            group_rank=_int(env, "GROUP_RANK", 0), lr_batch_rule=env.get(ENV_LR_BATCH_RULE, "sqrt"))
