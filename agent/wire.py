"""Message formats shared by the agent and the trainer.

This module is the whole contract between a training rank and its node agent, so it must stay
small and free of torch (the agent never imports torch) and of anything else heavy.

* Telemetry, rank -> agent: one JSON object per rank per step, sent in datagrams (one message, or
  a few steps' worth one per line) on the unix socket named by ``$TRAINGUARD_SOCKET``.
  Fire-and-forget; the agent validates every message and drops (and counts) what does not fit.
* Plan, agent -> ranks: a versioned JSON object per job, written atomically by the agent to the
  file named by ``$TRAINGUARD_PLAN``. Rank 0 reads it at sync points and passes it on through the
  job's store (``trainguard.run.plansync``), so every rank applies one version at one step.
* Exit status, warm launcher -> agent: how a rank the launcher forked ended, in a small JSON file
  beside the rank's log (``exit_status_path``), written when the launcher reaps it. An agent that
  was away when the rank ended (killed, restarted) reads it there instead of guessing.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1
MAX_MESSAGE_BYTES = 4096
MAX_DATAGRAM_BYTES = 32768
"""A datagram holds one telemetry message or several, one per line (compact JSON has no raw
newline): a rank whose steps are a few milliseconds long sends a few steps at a time, so the agent
is woken ~20 times a second per rank instead of once per step."""

ENV_SOCKET = "TRAINGUARD_SOCKET"
ENV_PLAN = "TRAINGUARD_PLAN"
ENV_JOB = "TRAINGUARD_JOB"
ENV_JOB_SPEC = "TRAINGUARD_JOB_SPEC"
ENV_HOST_STORE = "TRAINGUARD_HOST_STORE"
"""Set for a warm-launched job's rank 0: it hosts the job's rendezvous store (trainer/zygote.py)."""
ENV_STARTED_AT = "TRAINGUARD_STARTED_AT"
"""When a rank forked ahead of need (a warm launcher's spare) was given its work: its start, for a
recovery's timeline, where its process's own start time tells when it was forked."""


class WireError(ValueError):
    """A message that does not fit the contract. ``reason`` is a short label used as a metric label."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


APPLIES_BATCH_SIZES = 1
APPLIES_LR = 2
APPLIES_STOP = 4
APPLIES_ALL = APPLIES_BATCH_SIZES | APPLIES_LR | APPLIES_STOP
APPLIES_NAMES = {"batch_sizes": APPLIES_BATCH_SIZES, "lr": APPLIES_LR, "stop": APPLIES_STOP}
"""What of the plan a rank applies (``Telemetry.applies``, a bit mask): the agent moves samples
only between ranks that take the plan's batch sizes."""


def applies_mask(names: object) -> int:
    """The bit mask of plan parts named in ``names`` (e.g. ``("lr", "stop")``); ValueError names an unknown one."""
    if isinstance(names, str):
        names = (names,)
    mask = 0
    for name in names:  # type: ignore[attr-defined]  # an iterable of names
        if name not in APPLIES_NAMES:
            raise ValueError(f"applies: unknown plan part {name!r} (known: {', '.join(APPLIES_NAMES)})")
        mask |= APPLIES_NAMES[name]
    return mask


def applies_names(mask: int | None) -> list[str]:
    """The plan parts in ``mask`` (none for a rank that declared nothing)."""
    return [name for name, bit in APPLIES_NAMES.items() if mask and mask & bit]


# name -> (type, lower bound, upper bound); None means unbounded on that side.
_NUM = (int, float)
_TELEMETRY_FIELDS: dict[str, tuple[tuple[type, ...], float | None, float | None]] = {
    "rank": ((int,), 0, 1 << 20),
    "local_rank": ((int,), 0, 1 << 16),
    "pid": ((int,), 1, 1 << 31),
    "step": ((int,), 0, 1 << 53),
    "wall_time": (_NUM, 0, None),
    "step_s": (_NUM, 0, 86400),
    "data_s": (_NUM, 0, 86400),
    "fwd_bwd_s": (_NUM, 0, 86400),
    "comm_s": (_NUM, 0, 86400),
    "opt_s": (_NUM, 0, 86400),
    "samples": ((int,), 0, 1 << 40),
    "tokens": ((int,), 0, 1 << 50),
    "grad_norm": (_NUM, None, None),
    "local_grad_sq": (_NUM, None, None),
    "lr": (_NUM, 0, 1e3),
    "batch_size": ((int,), 0, 1 << 30),
    "mem_bytes": ((int,), 0, 1 << 60),
    "plan_version": ((int,), 0, 1 << 53),
}
_OPTIONAL_FIELDS: dict[str, tuple[tuple[type, ...], float | None, float | None]] = {
    # NaN/inf allowed: the agent must see a diverging loss. Absent: the script reports none (a
    # user's script need not), which is not a divergence.
    "loss": (_NUM, None, None),
    "flops_per_s": (_NUM, 0, None),
    "mfu": (_NUM, 0, 1.5),
    "comm_bytes": ((int,), 0, 1 << 60),
    "bubble_frac": (_NUM, 0, 1),
    "mem_frag": (_NUM, 0, 1),
    "val_loss": (_NUM, None, None),
    "dp_rank": ((int,), 0, 1 << 20),
    "world_size": ((int,), 1, 1 << 20),
    "compress_ratio": (_NUM, 0, None),
    "ckpt_failed": ((int,), 0, 1 << 53),
    "snapshot_s": (_NUM, 0, None),
    "proc_start": (_NUM, 0, None),
    "group_ready": (_NUM, 0, None),
    "restore_begin": (_NUM, 0, None),
    "restore_end": (_NUM, 0, None),
    "init_at": (_NUM, 0, None),
    "rdzv_begin": (_NUM, 0, None),
    "attempt": ((int,), 0, 1 << 31),
    "applies": ((int,), 0, APPLIES_ALL),
    "update_cos": (_NUM, -1.0, 1.0),
    "traj_cos": (_NUM, -1.0, 1.0),
    "steps": ((int,), 1, 1 << 20),
}
MAX_PARTS = 32
# Free-text fields: name -> longest accepted length.
_TEXT_FIELDS = {"ckpt_error": 300}
CKPT_FAILED_ELSEWHERE = "another rank could not write its shard"
"""The ``ckpt_error`` of a rank whose own part of a save was fine: the cause is another rank's."""
_NONFINITE_OK = {"loss", "grad_norm", "local_grad_sq", "val_loss"}


@dataclass(slots=True)
class Telemetry:
    """One step of one rank. Times are seconds; ``comm_s`` is time spent waiting on collectives,
    so compute time is ``fwd_bwd_s + opt_s`` (what straggler detection compares)."""

    job: str
    rank: int
    local_rank: int
    pid: int
    step: int
    wall_time: float
    step_s: float
    data_s: float
    fwd_bwd_s: float
    comm_s: float
    opt_s: float
    samples: int
    tokens: int
    loss: float
    grad_norm: float
    local_grad_sq: float
    lr: float
    batch_size: int
    mem_bytes: int
    plan_version: int
    flops_per_s: float | None = None
    mfu: float | None = None
    comm_bytes: int | None = None
    bubble_frac: float | None = None
    mem_frag: float | None = None
    val_loss: float | None = None
    dp_rank: int | None = None
    world_size: int | None = None
    compress_ratio: float | None = None
    ckpt_failed: int | None = None
    """A checkpoint (of that many steps done) this rank could not write since its last message."""
    ckpt_error: str | None = None
    """Why (one line: the error of the first rank that failed)."""
    snapshot_s: float | None = None
    """Training time the last per-step snapshot took."""
    proc_start: float | None = None
    """When this rank's process started (Unix time), sent with the first steps of an attempt ..."""
    group_ready: float | None = None
    """... with when its ``init_process_group`` returned (where the rank timed it) ..."""
    restore_begin: float | None = None
    """... with when its restore began ..."""
    restore_end: float | None = None
    """... and ended: the recovery timeline of the job_resumed event ..."""
    init_at: float | None = None
    """... with when the script entered ``trainguard.init`` (its own start-up ends there at the
    latest) ..."""
    rdzv_begin: float | None = None
    """... and when it entered ``init_process_group``, where the rank timed its rendezvous (which
    then ends at ``group_ready``)."""
    attempt: int | None = None
    """The rank's attempt (restarts before it, ``RunEnvironment.attempt``): the agent judges ranks
    only on telemetry of their job's current attempt."""
    applies: int | None = None
    """What of the plan the rank applies (``APPLIES_*`` bits; None: not declared)."""
    update_cos: float | None = None
    """Cosine between this step's gradient and the previous step's parameter update, reversed
    (trainguard.run.alignment): persistently positive means the LR is too low (hypergradient sign)."""
    traj_cos: float | None = None
    """Cosine between this step's gradient and the way back to the evidence controller's reference
    parameters, cos(g, -(theta - theta_ref)) (trainer/evidence.py): the mean over the steps that
    measured it (the plan's ``extra["evidence"]`` says which)."""
    steps: int = 1
    """How many steps this message sums up (a sender may gather short steps): ``step`` is the
    last of them, ``samples``/``tokens`` their total, the times and the loss, gradient and
    alignment figures their mean per step, ``batch_size`` the last step's."""
    parts: list[list[Any]] | None = None
    """The steps in consecutive parts, oldest first: ``[steps, fwd_bwd_s, opt_s, samples, loss]``
    each (times and loss their mean per step, a non-finite loss if one step had it, null when no
    step reported one; samples their total); their steps add up to ``steps``. Straggler detection
    and the controller take each part as one sample (``trainguard.run.stepwindow``)."""
    has_loss: bool = True
    """False when the sender reported no loss (``loss`` is then NaN and means nothing)."""

    @property
    def samples_per_step(self) -> float:
        return self.samples / self.steps

    @property
    def compute_s(self) -> float:
        return self.fwd_bwd_s + self.opt_s

    def part_rows(self) -> list[tuple[int, int, float, float, int, float | None]]:
        """(last step, steps, fwd_bwd_s, opt_s, samples, loss or None) of each part, oldest first;
        a message without parts is one part."""
        if not self.parts:
            return [(self.step, self.steps, self.fwd_bwd_s, self.opt_s, self.samples, self.loss if self.has_loss else None)]
        rows = []
        end = self.step - self.steps
        for steps, fwd_bwd_s, opt_s, samples, loss in self.parts:
            end += int(steps)
            rows.append((end, int(steps), fwd_bwd_s, opt_s, int(samples), None if loss is None else float(loss)))
        return rows

    def encode(self) -> bytes:
        # Field by field, not dataclasses.asdict: that deep-copies every value (~5x the cost, and
        # this runs once per step in every rank).
        body = {k: v for k in _WIRE_NAMES if (v := getattr(self, k)) is not None}
        if not self.has_loss:
            body.pop("loss", None)
        body["v"] = SCHEMA_VERSION
        # allow_nan: a NaN loss is information, not an encoding error.
        return json.dumps(body, separators=(",", ":"), allow_nan=True).encode()


PART_MARK = ".part-"


def part_key(job: str, node: str) -> str:
    """The checkpoint-tier key of ``node``'s part of a job that spans nodes (each node commits the
    ranks it runs under this key; the agents assemble the parts before a restart)."""
    return f"{job}{PART_MARK}{node}"


_WIRE_NAMES = tuple(f.name for f in fields(Telemetry) if f.name != "has_loss")
_JOB_ID_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.")


def valid_job_id(job: object) -> bool:
    return isinstance(job, str) and 0 < len(job) <= 64 and set(job) <= _JOB_ID_CHARS and job[0] != "."


def _check_number(name: str, value: Any, spec: tuple[tuple[type, ...], float | None, float | None]) -> None:
    types, lo, hi = spec
    # bool is an int subclass; a True step number is a bug in the sender, not a step.
    if isinstance(value, bool) or not isinstance(value, types):
        if float in types and isinstance(value, int) and not isinstance(value, bool):
            return
        raise WireError("type", f"{name} must be {'/'.join(t.__name__ for t in types)}")
    if isinstance(value, float) and not math.isfinite(value):
        if name in _NONFINITE_OK:
            return
        raise WireError("range", f"{name} is not finite")
    # Compare ints as ints: float(2**53 + 1) rounds down to 2**53 and would slip past the bound.
    number = value if isinstance(value, int) else float(value)  # type: ignore[arg-type]  # numeric
    if (lo is not None and number < lo) or (hi is not None and number > hi):
        raise WireError("range", f"{name}={value} outside [{lo}, {hi}]")


_PART_SPECS = (((int,), 1, 1 << 20), _TELEMETRY_FIELDS["fwd_bwd_s"], _TELEMETRY_FIELDS["opt_s"], _TELEMETRY_FIELDS["samples"],
               _OPTIONAL_FIELDS["loss"])
_PART_NAMES = ("part steps", "part fwd_bwd_s", "part opt_s", "part samples", "loss")  # loss: non-finite allowed


def _check_parts(parts: Any, steps: int, samples: int) -> list[list[Any]]:
    if not isinstance(parts, list) or not 0 < len(parts) <= MAX_PARTS:
        raise WireError("schema", f"parts must be a list of 1 to {MAX_PARTS} parts")
    for part in parts:
        if not isinstance(part, list) or len(part) != 5:
            raise WireError("schema", "a part is [steps, fwd_bwd_s, opt_s, samples, loss]")
        for name, value, spec in zip(_PART_NAMES, part, _PART_SPECS, strict=True):
            if value is not None or name != "loss":
                _check_number(name, value, spec)
    if sum(p[0] for p in parts) != steps or sum(p[3] for p in parts) != samples:
        raise WireError("range", "parts do not add up to the message's steps and samples")
    return parts


def split_datagram(data: bytes) -> list[bytes]:
    """The messages of one datagram (one per line; a datagram of one message has no newline)."""
    if b"\n" not in data:
        return [data]
    # Nothing but newlines is still one (bad) message: every datagram is stored or counted as a drop.
    return [part for part in data.split(b"\n") if part] or [data]


def decode_telemetry(data: bytes) -> Telemetry:
    """Parse and validate one message. Raises WireError with a reason label on any defect."""
    if len(data) > MAX_MESSAGE_BYTES:
        raise WireError("size", f"{len(data)} bytes > {MAX_MESSAGE_BYTES}")
    try:
        body = json.loads(data)
    except (UnicodeDecodeError, ValueError) as exc:
        raise WireError("json", str(exc)[:80]) from None
    if not isinstance(body, dict):
        raise WireError("schema", "not an object")
    if body.get("v") != SCHEMA_VERSION:
        raise WireError("version", f"schema version {body.get('v')!r}")
    job = body.get("job")
    if not valid_job_id(job):
        raise WireError("schema", "job id missing or malformed")
    values: dict[str, Any] = {"job": job}
    for name, spec in _TELEMETRY_FIELDS.items():
        if name not in body:
            raise WireError("schema", f"missing {name}")
        _check_number(name, body[name], spec)
        values[name] = body[name]
    for name, spec in _OPTIONAL_FIELDS.items():
        value = body.get(name)
        if value is not None:
            _check_number(name, value, spec)
            values[name] = value
    if "loss" not in values:
        values["loss"], values["has_loss"] = math.nan, False
    for name, limit in _TEXT_FIELDS.items():
        text = body.get(name)
        if text is None:
            continue
        if not isinstance(text, str) or len(text) > limit:
            raise WireError("type", f"{name} must be a string of at most {limit} characters")
        values[name] = text
    parts = body.get("parts")
    if parts is not None:
        values["parts"] = _check_parts(parts, values.get("steps", 1), values["samples"])
    unknown = set(body) - set(values) - {"v"}
    if unknown:
        raise WireError("schema", f"unknown field {sorted(unknown)[0]}")
    return Telemetry(**values)


@dataclass(slots=True)
class Plan:
    """What the agent wants the ranks of one job to do from the step they apply it.

    ``lr_scale`` multiplies the trainer's own schedule; ``lr`` (when set) overrides it.
    ``batch_sizes`` maps dp rank -> samples per step (None: the trainer's even split).
    ``checkpoint_id`` asks for a checkpoint when it grows; ``stop`` asks the ranks to exit cleanly.
    """

    version: int = 0
    lr_scale: float = 1.0
    lr: float | None = None
    batch_sizes: list[int] | None = None
    checkpoint_id: int = 0
    stop: bool = False
    reason: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def encode(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":"), sort_keys=True).encode()

    @classmethod
    def from_dict(cls, body: object) -> Plan:
        if not isinstance(body, dict):
            raise WireError("schema", "plan must be an object")
        known = {f.name for f in fields(cls)}
        unknown = set(body) - known
        if unknown:
            raise WireError("schema", f"unknown plan field {sorted(unknown)[0]}")
        plan = cls(**body)
        plan.validate()
        return plan

    @classmethod
    def decode(cls, data: bytes) -> Plan:
        try:
            body = json.loads(data)
        except (UnicodeDecodeError, ValueError) as exc:
            raise WireError("json", str(exc)[:80]) from None
        return cls.from_dict(body)

    def validate(self) -> None:
        if isinstance(self.version, bool) or not isinstance(self.version, int) or self.version < 0:
            raise WireError("schema", "version must be an integer >= 0")
        if not isinstance(self.lr_scale, (int, float)) or not (0 < self.lr_scale <= 1e3):
            raise WireError("range", "lr_scale must be in (0, 1000]")
        if self.lr is not None and (not isinstance(self.lr, (int, float)) or not (0 < self.lr <= 1e3)):
            raise WireError("range", "lr must be in (0, 1000]")
        if self.batch_sizes is not None:
            if not isinstance(self.batch_sizes, list) or not self.batch_sizes:
                raise WireError("schema", "batch_sizes must be a non-empty list")
            for b in self.batch_sizes:
                if isinstance(b, bool) or not isinstance(b, int) or b < 0:
                    raise WireError("range", "batch_sizes entries must be integers >= 0")
            if sum(self.batch_sizes) == 0:
                raise WireError("range", "batch_sizes must not all be zero")
        if isinstance(self.checkpoint_id, bool) or not isinstance(self.checkpoint_id, int):
            raise WireError("schema", "checkpoint_id must be an integer")
        if not isinstance(self.stop, bool):
            raise WireError("schema", "stop must be a boolean")
        if not isinstance(self.extra, dict):
            raise WireError("schema", "extra must be an object")


def write_plan_file(path: str, plan: Plan) -> None:
    """Atomically replace the plan file, so a reader never sees half a plan. It is 0644 whatever
    the umask: ranks of ``launcher.user`` read it, and a plan holds no secret."""
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "wb") as fh:
        os.fchmod(fh.fileno(), 0o644)
        fh.write(plan.encode())
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def read_plan_file(path: str) -> Plan | None:
    """The plan in ``path``, or None when there is none or it does not parse."""
    try:
        with open(path, "rb") as fh:
            return Plan.decode(fh.read())
    except (OSError, WireError, TypeError):
        return None


def process_start_ticks(pid: int, proc_root: Path = Path("/proc")) -> int | None:
    """The process's start time in clock ticks since boot; None when it is gone (or a zombie)."""
    try:
        text = (proc_root / str(pid) / "stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its last ')'.
    fields = text[text.rfind(")") + 2:].split()
    if not fields or fields[0] in ("Z", "X"):
        return None
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def exit_status_path(log_path: str) -> str:
    """Where the warm launcher writes how the rank logging to ``log_path`` ended."""
    return log_path + ".exit"


def write_exit_status(path: str, pid: int, start_ticks: int | None, code: int, signal: int | None) -> None:
    """Atomically record that process ``pid`` (started at ``start_ticks``) ended with ``code``, or by
    ``signal``. Best effort: an OSError (a full disk) leaves the agent to judge the end without it."""
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "w") as fh:
            json.dump({"pid": pid, "start_ticks": start_ticks, "code": code, "signal": signal}, fh)
        os.replace(tmp, path)
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass


def read_exit_status(path: str, pid: int, start_ticks: int | None) -> int | None:
    """How process ``pid`` (started at ``start_ticks``, when known) ended, in ``subprocess.Popen``'s
    convention (-N for signal N); None when ``path`` is missing, unreadable or of another process
    (a pid used again: the start times differ)."""
    try:
        with open(path) as fh:
            doc = json.load(fh)
        same = doc["pid"] == pid and (start_ticks is None or doc["start_ticks"] in (None, start_ticks))
        code, signal = int(doc["code"]), doc["signal"]
        return (-int(signal) if signal else code) if same else None
    except (OSError, ValueError, KeyError, TypeError):
        return None
