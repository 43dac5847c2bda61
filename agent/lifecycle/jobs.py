"""Jobs as the agent sees them: the submitted spec and the lifecycle state machine.

The trainer's own configuration travels as an opaque JSON object (the agent never imports the
trainer, which imports torch); the agent only needs the process layout.
"""

from __future__ import annotations

import enum
import re
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from trainguard.agent.lifecycle.unitprops import check_unit_property
from trainguard.agent.wire import valid_job_id

_UID = re.compile(r"^[0-9a-f]{8,64}$")


class JobSpecError(ValueError):
    def __init__(self, key: str, why: str) -> None:
        super().__init__(f"{key}: {why}")
        self.key = key


@dataclass
class JobSpec:
    job: str
    nproc: int
    trainer: dict[str, Any] = field(default_factory=dict)
    """TrainConfig as a dict (trainer/config.py), handed to every rank in $TRAINGUARD_JOB_SPEC."""
    command: list[str] = field(default_factory=list)
    """Rank command (empty: the embedded trainer, `python -m trainguard.trainer.worker`)."""
    env: dict[str, str] = field(default_factory=dict)
    faults: list[str] = field(default_factory=list)
    """Fault specs injected into the ranks (tests and the demo)."""
    max_restarts: int = 3
    nodes: int = 1
    """Spread the ranks over this many nodes (the cluster leader places them; needs etcd)."""
    cwd: str = ""
    """Working directory of a command's ranks (absolute; empty: the job's log directory)."""
    hang_timeout_s: float = 0.0
    """A command job is hung when none of its ranks used the CPU for this long (0: hangs of a job
    that does not report steps are never judged; see ``agent.detect.activity``)."""
    cpus: float = 0.0
    """CPU quota of the job's cgroup, in CPUs (0: the agent's ``launcher.job_cpus``)."""
    memory_max: int = 0
    """Memory ceiling of the job's cgroup in bytes (0: the agent's ``launcher.job_memory_max``)."""
    unit_properties: list[str] = field(default_factory=list)
    """When ranks run as systemd units: properties of their units that tighten the sandbox or
    limit resources (``["ProtectHome=read-only", "MemoryHigh=8G"]``; ``agent.lifecycle.unitprops``
    says which); none by default."""
    uid: str = ""
    """Unique per submission (32 hex digits, drawn at submit and kept in the job's records on disk
    and in etcd): the object tier keys the job's checkpoints by it, so a job submitted again under
    the same name, or another cluster's job of that name, never restores or prunes these."""

    @property
    def is_command(self) -> bool:
        """A user's command (not the embedded trainer): it may never report a step."""
        return bool(self.command)

    @classmethod
    def from_dict(cls, body: Any) -> JobSpec:
        if not isinstance(body, dict):
            raise JobSpecError("job", "spec must be an object")
        known = {"job", "nproc", "trainer", "command", "env", "faults", "max_restarts", "nodes", "cwd",
                 "hang_timeout_s", "cpus", "memory_max", "unit_properties", "uid"}
        for key in body:
            if key not in known:
                raise JobSpecError(key, "unknown key")
        job = body.get("job") or f"job-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"
        if not valid_job_id(job):
            raise JobSpecError("job", "1-64 characters of [A-Za-z0-9._-], not starting with '.'")
        nproc = body.get("nproc")
        if isinstance(nproc, bool) or not isinstance(nproc, int) or not (1 <= nproc <= 1024):
            raise JobSpecError("nproc", "an integer in [1, 1024]")
        trainer = body.get("trainer", {})
        if not isinstance(trainer, dict):
            raise JobSpecError("trainer", "must be an object")
        command = body.get("command", [])
        if not isinstance(command, list) or not all(isinstance(c, str) for c in command):
            raise JobSpecError("command", "must be a list of strings")
        env = body.get("env", {})
        if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
            raise JobSpecError("env", "must map strings to strings")
        for k, v in env.items():
            # What execve can pass: a shell's environment (``trainguard run`` sends it whole) may
            # hold names like BASH_FUNC_f%%, so only '=' and NUL are refused.
            if not k or "=" in k or "\x00" in k:
                raise JobSpecError("env", f"{k!r} is not a variable name (empty, or holds '=' or NUL)")
            if "\x00" in v:
                raise JobSpecError("env", f"{k}: a value may not hold a NUL byte")
        faults = body.get("faults", [])
        if not isinstance(faults, list) or not all(isinstance(f, str) for f in faults):
            raise JobSpecError("faults", "must be a list of strings")
        max_restarts = body.get("max_restarts", 3)
        if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
            raise JobSpecError("max_restarts", "an integer >= 0")
        nodes = body.get("nodes", 1)
        if isinstance(nodes, bool) or not isinstance(nodes, int) or not (1 <= nodes <= 256):
            raise JobSpecError("nodes", "an integer in [1, 256] (the job uses at most nproc of them)")
        cwd = body.get("cwd", "")
        if not isinstance(cwd, str) or (cwd and not cwd.startswith("/")):
            raise JobSpecError("cwd", "an absolute path")
        hang = body.get("hang_timeout_s", 0.0)
        if isinstance(hang, bool) or not isinstance(hang, int | float) or not (0 <= hang <= 7 * 86400):
            raise JobSpecError("hang_timeout_s", "seconds in [0, 604800] (0: off)")
        cpus = body.get("cpus", 0.0)
        if isinstance(cpus, bool) or not isinstance(cpus, int | float) or not (0 <= cpus <= 4096):
            raise JobSpecError("cpus", "a number of CPUs in [0, 4096] (0: the agent's default)")
        memory_max = body.get("memory_max", 0)
        if isinstance(memory_max, bool) or not isinstance(memory_max, int) or not (
                memory_max == 0 or memory_max >= 16 << 20):
            raise JobSpecError("memory_max", "bytes, at least 16 MiB (0: the agent's default)")
        props = body.get("unit_properties", [])
        if not isinstance(props, list) or not all(isinstance(p, str) and "=" in p and "\n" not in p for p in props):
            raise JobSpecError("unit_properties", 'a list of systemd properties like "ReadWritePaths=/data"')
        for prop in props:
            why = check_unit_property(prop)
            if why is not None:
                raise JobSpecError("unit_properties", why)
        uid = body.get("uid") or secrets.token_hex(16)
        if not isinstance(uid, str) or not _UID.match(uid):
            raise JobSpecError("uid", "8-64 lowercase hex digits (left out: drawn at submit)")
        return cls(job, nproc, trainer, command, env, faults, max_restarts, nodes, cwd, float(hang),
                   float(cpus), memory_max, list(props), uid)

    def to_dict(self) -> dict[str, Any]:
        return {
            "job": self.job,
            "nproc": self.nproc,
            "trainer": self.trainer,
            "command": self.command,
            "env": self.env,
            "faults": self.faults,
            "max_restarts": self.max_restarts,
            "nodes": self.nodes,
            "cwd": self.cwd,
            "hang_timeout_s": self.hang_timeout_s,
            "cpus": self.cpus,
            "memory_max": self.memory_max,
            "unit_properties": self.unit_properties,
            "uid": self.uid,
        }


class JobState(enum.Enum):
    STARTING = "starting"
    RUNNING = "running"
    RESTARTING = "restarting"
    STOPPING = "stopping"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"

    @property
    def finished(self) -> bool:
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.STOPPED)


_ALLOWED: dict[JobState, set[JobState]] = {
    JobState.STARTING: {JobState.RUNNING, JobState.FAILED, JobState.STOPPING, JobState.RESTARTING},
    JobState.RUNNING: {JobState.SUCCEEDED, JobState.FAILED, JobState.STOPPING, JobState.RESTARTING},
    JobState.RESTARTING: {JobState.STARTING, JobState.FAILED, JobState.STOPPING},
    JobState.STOPPING: {JobState.STOPPED, JobState.FAILED, JobState.SUCCEEDED},
    JobState.SUCCEEDED: set(),
    JobState.FAILED: set(),
    JobState.STOPPED: set(),
}


class InvalidTransition(RuntimeError):
    pass


def check_transition(old: JobState, new: JobState) -> None:
    if new not in _ALLOWED[old]:
        raise InvalidTransition(f"job cannot go from {old.value} to {new.value}")
