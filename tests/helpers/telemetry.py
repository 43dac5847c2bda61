"""Telemetry messages as a rank sends them, with plausible values for every field a test leaves out."""

from __future__ import annotations

from typing import Any

from trainguard.agent.wire import Telemetry


def make_msg(job: str = "job-1", rank: int = 0, step: int = 1, **kw: Any) -> Telemetry:
    """One step's message of ``rank`` of ``job``; ``kw`` sets any other field (``pid=os.getpid()``
    for a datagram the agent checks against its sender)."""
    base: dict[str, Any] = dict(
        job=job, rank=rank, local_rank=rank % 8, pid=1000 + rank, step=step, wall_time=1000.0 + step * 0.1,
        step_s=0.1, data_s=0.01, fwd_bwd_s=0.05, comm_s=0.03, opt_s=0.01, samples=32, tokens=4096,
        loss=2.5, grad_norm=1.0, local_grad_sq=0.25, lr=1e-3, batch_size=32, mem_bytes=1 << 30,
        plan_version=0,
    )
    base.update(kw)
    return Telemetry(**base)
