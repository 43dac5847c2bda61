"""A GPU that fails takes no job down with it for good: the job restarts without it.

A GPU that fell off the bus (NVML: GPU lost, XID 79), reported an XID that needs a GPU reset (48
double-bit ECC, 95 uncontained ECC, 74 NVLink, ...) or a double-bit ECC error will fail the kernels
put on it again. Restarting
the job as it was (what a crash of its rank would do) puts a rank back on the same GPU. Here:
the GPU is marked failed on this node, later launches leave it out of ``CUDA_VISIBLE_DEVICES``, and
a job with a rank on it is restarted through the exclusion path (one data-parallel replica fewer,
the global batch kept by uneven per-rank shares).

The collector reports from its NVML event thread; the actions run on the agent's loop (``tick``),
where the supervisor and the recovery service are driven from.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from trainguard.agent.eventlog import EventLog
from trainguard.agent.heal.exclusion import Exclusion
from trainguard.agent.lifecycle.supervisor import Supervisor

log = logging.getLogger(__name__)

GPU_EVENT_KINDS = frozenset({"gpu_lost", "gpu_xid", "gpu_ecc"})

XIDS_NEEDING_RESET = frozenset({48, 62, 64, 74, 79, 95, 119, 120, 140})
"""XIDs after which NVIDIA's XID catalogue says the GPU needs a reset (or worse) before it computes
right again: double-bit ECC (48), micro-controller halt (62), row-remap failure (64), NVLink
error (74), off the bus (79), uncontained ECC (95), GSP timeout/error (119, 120), unrecovered ECC
(140). Others the collector calls fatal (a contained ECC error, 94) need only the application
restarted, which the rank's own crash does."""


def failure_reason(kind: str, fields: Mapping[str, Any]) -> str | None:
    """Why this collector event means the GPU is unusable, or None when it does not."""
    if kind == "gpu_lost":
        return "GPU lost" + (f" ({fields['detail']})" if fields.get("detail") else "")
    xid = fields.get("xid")
    if kind == "gpu_xid" and xid in XIDS_NEEDING_RESET:
        what = fields.get("description")
        return f"fatal XID {xid}" + (f" ({what})" if what else "")
    if kind == "gpu_ecc" and fields.get("type") == "double_bit":
        return "double-bit ECC error"
    return None


@dataclass(frozen=True)
class _Failure:
    gpu: int
    reason: str
    pids: tuple[int, ...]


class GpuFaults:
    """Failed GPUs of this node and what was done about them."""

    def __init__(self, supervisor: Supervisor, events: EventLog, exclude_rank: Exclusion, exclude: bool = True) -> None:
        self.supervisor = supervisor
        self.events = events
        self.exclude_rank = exclude_rank
        self.exclude = exclude
        """``gpu.exclude_failed``: restart a job on a failed GPU without that rank's replica."""
        self.failed: dict[int, str] = {}
        """GPU index -> why it failed (kept until the agent restarts)."""
        self._pending: deque[_Failure] = deque()
        self._lock = threading.Lock()

    def on_event(self, kind: str, fields: Mapping[str, Any]) -> bool:
        """Collector event (any thread): True when it marks a GPU failed (acted on at the next tick)."""
        if kind not in GPU_EVENT_KINDS:
            return False
        reason = failure_reason(kind, fields)
        gpu = fields.get("gpu")
        if reason is None or not isinstance(gpu, int) or isinstance(gpu, bool):
            return False
        pids = fields.get("pids")
        if not isinstance(pids, list):
            pids = [fields["pid"]] if isinstance(fields.get("pid"), int) else []
        with self._lock:
            self._pending.append(_Failure(gpu, reason, tuple(p for p in pids if isinstance(p, int))))
        return True

    def healthy(self, all_gpus: list[int]) -> tuple[int, ...] | None:
        """The GPUs launches may use; None while none has failed (the environment's choice stands)."""
        with self._lock:
            failed = set(self.failed)
        if not failed:
            return None
        return tuple(g for g in all_gpus if g not in failed)

    def tick(self) -> None:
        while True:
            with self._lock:
                if not self._pending:
                    return
                failure = self._pending.popleft()
                first = failure.gpu not in self.failed
                self.failed.setdefault(failure.gpu, failure.reason)
            self._handle(failure, first)

    def _handle(self, failure: _Failure, first: bool) -> None:
        jobs: dict[str, int] = {}
        for pid in failure.pids:
            found = self.supervisor.find_rank(pid)
            if found is not None:
                jobs.setdefault(found[0].job, found[1].rank)
        if first:
            self.events.emit(
                "gpu_failed",
                f"GPU {failure.gpu} failed ({failure.reason}): left out of later launches on this node",
                severity="error", cause=failure.reason, gpu=failure.gpu, jobs=sorted(jobs),
                action="exclude_gpu")
        for job, rank in sorted(jobs.items()):
            if not self.exclude:
                self.events.emit(
                    "gpu_exclusion_off", f"job {job} rank {rank} is on failed GPU {failure.gpu}; "
                    "gpu.exclude_failed is off: the job is left to restart as it is",
                    severity="warning", job=job, rank=rank, cause=failure.reason, gpu=failure.gpu)
                continue
            record = self.supervisor.jobs.get(job)
            if record is not None and record.state.finished:
                continue
            log.warning("job %s rank %d ran on failed GPU %d: restarting without it", job, rank, failure.gpu)
            self.exclude_rank(job, rank, reason=f"GPU {failure.gpu}: {failure.reason}", kind="gpu_failure")
