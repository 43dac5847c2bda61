"""Attempts that ``trainguard run --nnodes`` hands this agent: the nodes met at a c10d rendezvous
(in the launcher's process, which imports torch; this agent does not), and each round gives this
node a share of the ranks. The launcher asks, per round, which snapshot steps this node's ranks of
the round hold (``offer``), agrees the newest step all nodes hold through the rendezvous, and hands
the attempt here (``start``); between rounds it stops the ranks here (``hold``). The attempt is
the cluster-wide one all ranks agree on, not a count of this node's starts.

One request, ``POST /v1/jobs/<job>/attempt``, with one of:
``{"offer": BLOCK}`` -> ``{"steps": [...]}``; ``{"start": BLOCK, "spec": SPEC}`` -> the job;
``{"hold": true}`` -> the job. BLOCK: ``rank_offset``, ``nproc``, ``world_size``, ``master_addr``,
``master_port``, ``group_rank``, ``attempt``, ``env``, ``socket_ifname``, ``snapshot_step``.
"""

from __future__ import annotations

from typing import Any

from trainguard.agent.checkpoint.catalog import candidates
from trainguard.agent.checkpoint.errors import CheckpointError
from trainguard.agent.checkpoint.local import LocalDirTier
from trainguard.agent.checkpoint.manager import CheckpointManager
from trainguard.agent.checkpoint.snapshots import SnapshotSet
from trainguard.agent.lifecycle.jobs import JobSpec
from trainguard.agent.lifecycle.ranks import RankBlock

_INTS = ("rank_offset", "nproc", "world_size", "master_port", "group_rank", "attempt")


def block_from(body: Any) -> RankBlock:
    """A round's block from the request; ``ValueError`` with one line when malformed."""
    if not isinstance(body, dict):
        raise ValueError("block: expected an object")
    for key in _INTS:
        if not isinstance(body.get(key), int) or isinstance(body.get(key), bool) or body[key] < 0:
            raise ValueError(f"block.{key}: expected a whole number >= 0")
    if body["nproc"] < 1 or body["rank_offset"] + body["nproc"] > body["world_size"] or body["attempt"] < 1:
        raise ValueError("block: ranks rank_offset..+nproc must lie in world_size, attempt >= 1")
    if not isinstance(body.get("master_addr"), str) or not body["master_addr"]:
        raise ValueError("block.master_addr: expected a host")
    env = body.get("env", {})
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise ValueError("block.env: expected an object of strings")
    for key in ("snapshot_step", "restore_step"):
        step = body.get(key)
        if step is not None and (not isinstance(step, int) or isinstance(step, bool) or step < 0):
            raise ValueError(f"block.{key}: expected a whole number >= 0 or null")
    if not isinstance(body.get("restore_here", False), bool):
        raise ValueError("block.restore_here: expected true or false")
    return RankBlock(body["rank_offset"], body["nproc"], body["world_size"], body["master_addr"],
                     body["master_port"], body["group_rank"], dict(env), body["attempt"],
                     socket_ifname=str(body.get("socket_ifname", "")), rendezvous=True,
                     snapshot_step=body.get("snapshot_step"), restore_step=body.get("restore_step"),
                     restore_here=body.get("restore_here", False))


def offer(memory_root: str, job: str, block: RankBlock) -> list[int]:
    """The steps every rank of ``block`` holds a complete snapshot of, at the block's world size."""
    snapshots = SnapshotSet(memory_root, job)
    common: set[int] | None = None
    for rank in range(block.rank_offset, block.rank_offset + block.nproc):
        steps = snapshots.done_steps(rank, block.world_size)
        common = steps if common is None else common & steps
    return sorted(common or ())


def whole_checkpoint(checkpoints: CheckpointManager, job: str) -> int | None:
    """The newest step of a verified checkpoint in this node's own tiers that holds every rank's
    state (written by one rank for data-parallel replicas), which other nodes' ranks can load once
    it is sent to them; None when there is none. A checkpoint of ranks that each wrote their part
    holds only this node's parts here, and is not offered."""
    for tier, info in candidates(job, checkpoints.local_tiers()):
        if isinstance(tier, LocalDirTier) and _whole(tier, job, info.step) and tier.verify(job, info.step).ok:
            return info.step
    return None


def _whole(tier: LocalDirTier, job: str, step: int) -> bool:
    try:
        return tier.manifest(job, step).extra.get("whole") is True
    except (OSError, CheckpointError):
        return False


def attempt(agent: Any, job: str, body: Any) -> dict[str, Any]:
    """Serve one request (see the module doc); ``ValueError`` when it cannot be served."""
    if not isinstance(body, dict):
        raise ValueError("expected an object with offer, start or hold")
    supervisor = agent.supervisor
    if "offer" in body:
        block = block_from(body["offer"])
        return {"steps": offer(agent.checkpoints.settings.memory_root, job, block),
                "checkpoint": whole_checkpoint(agent.checkpoints, job)}
    if body.get("hold"):
        record = supervisor.hold(job)
        return record.to_dict() if record is not None else {"job": job, "state": "unknown"}
    if "start" not in body:
        raise ValueError("expected an object with offer, start or hold")
    block = block_from(body["start"])
    spec_body = body.get("spec")
    if isinstance(spec_body, dict) and "max_restarts" not in spec_body:
        spec_body = {**spec_body, "max_restarts": agent.cfg.recovery.max_restarts}
    spec = JobSpec.from_dict(spec_body)
    if spec.job != job or spec.nproc != block.nproc:
        raise ValueError(f"spec: job {spec.job} with {spec.nproc} ranks does not match {job} with {block.nproc}")
    unreachable = supervisor.launcher.unreachable(spec, supervisor.context_for(spec))
    if unreachable:
        raise ValueError(unreachable)
    record = supervisor.jobs.get(job)
    if record is None or record.state.finished:
        # A failure here is the launcher's to announce to every node: the supervisor stops the
        # ranks here and the launcher sees the job restarting.
        record = supervisor.submit(spec, block=block, on_failure=lambda _job, _cause: None)
    else:
        supervisor.relaunch(job, block, spec, f"rendezvous round for attempt {block.attempt}")
        record = supervisor.jobs[job]
    result: dict[str, Any] = record.to_dict()
    return result
