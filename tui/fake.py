"""A deterministic :class:`~tui.source.DataSource` with a fixed scene: a 4-rank job with a straggler,
a 2-rank job with a dead rank, two GPUs (one throttling, with an XID), kernel histograms,
checkpoints in three tiers, and an event log. No clock, no pids of real processes.

For snapshot tests and for trying the dashboard without an agent
(``python -m trainguard.tui.fake`` runs it).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from typing import Any

from trainguard.agent.api.client import ApiClientError
from trainguard.tui.source import AgentSnapshot

T0 = 1_800_000_000.0  # the scene's "now" (pass clock=lambda: T0 to create_app)


def _tel(job: str, rank: int, step: int, step_s: float, compute_s: float, batch: int, loss: float,
         lr: float, **extra: Any) -> dict[str, Any]:
    return {
        "job": job, "rank": rank, "local_rank": rank, "pid": 4100 + rank, "step": step, "plan_version": 3,
        "wall_time": T0 - 0.5, "last_seen": T0 - 0.5, "step_s": step_s, "data_s": 0.004,
        "compute_s": compute_s, "comm_s": step_s - compute_s - 0.004, "loss": loss, "lr": lr,
        "batch_size": batch, "median_step_s": step_s, "median_compute_s": compute_s,
        "median_comm_s": step_s - compute_s - 0.004, "median_data_s": 0.004, "steps_per_s": 1 / step_s,
        "tokens_per_s": batch * 256 / step_s, **extra,
    }


def _hist(peak: int, width: int, total: int) -> dict[str, Any]:
    slots = [0] * 32
    for i in range(-width, width + 1):
        if 0 <= peak + i < 32:
            slots[peak + i] = max(1, total >> (2 * abs(i)))
    return {"slots": slots, "sum_ns": sum(n * (1 << s) * 1000 for s, n in enumerate(slots))}


def scene_status(node: str = "node-a", tick: int = 30) -> dict[str, Any]:
    """The scene after ``tick`` polls: 20 steps per poll; the controller halves the LR at tick 10 and
    the healer moves part of rank 2's shard to the others at tick 15."""
    step = 600 + 20 * tick
    lr = 1.2e-3 if tick < 10 else 6e-4
    batches = [32, 32, 32, 32] if tick < 15 else [40, 40, 24, 40]
    gpt_ranks = []
    for r in range(4):
        slow = r == 2
        loss = 1.5 + 2.0 * math.exp(-step / 600) + 0.01 * r
        tel = _tel("gpt-small", r, step - (1 if slow else 0), 0.412, 0.395 if slow else 0.300, batches[r], loss, lr,
                   straggler_score=0.76 if slow else 1.0 - r * 0.01,
                   straggler_cause="cpu contention (run-queue p99 8ms)" if slow else "")
        gpt_ranks.append({"rank": r, "pid": 4100 + r, "alive": True, "exit_code": None, "exit_signal": None,
                          "telemetry": tel})
    mlp_ranks = [
        {"rank": 0, "pid": 4200, "alive": True, "exit_code": None, "exit_signal": None,
         "telemetry": _tel("mlp", 0, 310, 0.050, 0.030, 64, 0.91, 1e-3)},
        {"rank": 1, "pid": 4201, "alive": False, "exit_code": -9, "exit_signal": "SIGKILL",
         "telemetry": _tel("mlp", 1, 302, 0.050, 0.031, 64, 0.93, 1e-3)},
    ]
    return {
        "node": node, "hostname": node, "version": "0.1.0", "pid": 4000, "uptime_s": 3725.0, "leader": node,
        "collectors": {"host": {"up": True, "reason": None}, "ebpf": {"up": True, "reason": None},
                       "gpu": {"up": True, "reason": None}},
        "jobs": [
            {"job": "gpt-small", "state": "running", "attempt": 2, "restarts": 1, "nproc": 4, "progress_step": step,
             "ranks": gpt_ranks,
             "plan": {"version": 3, "lr_scale": 0.5, "lr": None, "batch_sizes": [40, 40, 24, 40],
                      "checkpoint_id": 4, "stop": False, "reason": "shard migration off rank 2", "extra": {}}},
            {"job": "mlp", "state": "restarting", "attempt": 1, "restarts": 0, "nproc": 2, "progress_step": 310,
             "ranks": mlp_ranks,
             "plan": {"version": 1, "lr_scale": 1.0, "lr": None, "batch_sizes": None, "checkpoint_id": 0,
                      "stop": False, "reason": "", "extra": {}}},
        ],
        "gpus": [
            {"index": 0, "name": "NVIDIA H100", "utilization_gpu_pct": 97.0, "memory_used_bytes": 61.2e9,
             "memory_total_bytes": 80e9, "temperature_c": 71.0, "power_w": 612.0, "power_limit_w": 700.0,
             "throttle_reasons": [], "xids": 0, "ecc_uncorrected": 0},
            {"index": 1, "name": "NVIDIA H100", "utilization_gpu_pct": 58.0, "memory_used_bytes": 60.8e9,
             "memory_total_bytes": 80e9, "temperature_c": 88.0, "power_w": 455.0, "power_limit_w": 700.0,
             "throttle_reasons": ["hw_thermal"], "xids": 1, "last_xid": 79, "ecc_uncorrected": 0},
        ],
        "kernel": {
            "runq_latency": {"node": _hist(4, 2, 4000), "gpt-small/2": _hist(13, 2, 300), "gpt-small/0": _hist(3, 1, 900)},
            "block_io_latency": {"nvme0n1": _hist(7, 2, 1200)},
        },
        "metrics_port": 9478, "api_tcp_port": None,
    }


def scene_events() -> list[dict[str, Any]]:
    rows = [
        ("info", "agent_started", "agent 0.1.0 started on node-a", None, None, None, {}),
        ("info", "job_submitted", "job gpt-small submitted with 4 ranks", "gpt-small", None, None, {}),
        ("error", "rank_exited", "rank 1 of gpt-small exited with SIGKILL", "gpt-small", 1, "oom_kill", {}),
        ("warning", "job_restarted", "gpt-small attempt 2 from step 1000 (memory tier)", "gpt-small", None, "rank_exited",
         {"action": "restart+restore"}),
        ("warning", "straggler_detected", "rank 2 of gpt-small is slow: score 0.76", "gpt-small", 2,
         "cpu contention", {"action": "shard migration"}),
        ("info", "plan_updated", "plan v3 for job gpt-small", "gpt-small", None, "controller", {"action": "lr x0.5"}),
        ("info", "checkpoint_committed", "gpt-small step 1100 in disk tier", "gpt-small", None, None, {}),
        ("error", "rank_exited", "rank 1 of mlp killed by SIGKILL", "mlp", 1, "signal", {}),
    ]
    return [{"seq": i + 1, "ts": T0 - 600 + 60 * i, "kind": kind, "severity": sev, "node": "node-a",
             "message": msg, "job": job, "rank": rank, "cause": cause, "fields": fields}
            for i, (sev, kind, msg, job, rank, cause, fields) in enumerate(rows)]


def scene_checkpoints() -> list[dict[str, Any]]:
    return [
        {"tier": "memory", "job": "gpt-small", "step": 1100, "location": "/dev/shm/x", "size": 220_000_000,
         "created": T0 - 35},
        {"tier": "memory", "job": "gpt-small", "step": 1000, "location": "/dev/shm/y", "size": 220_000_000,
         "created": T0 - 75},
        {"tier": "disk", "job": "gpt-small", "step": 1000, "location": "/var/lib/x", "size": 220_000_000,
         "created": T0 - 70},
        {"tier": "object", "job": "gpt-small", "error": "s3://bucket: connection refused"},
    ]


class FakeSource:
    """The fixed scene, with knobs for tests: ``down`` (no agent answers), ``refusals`` (action name
    -> ApiClientError to raise), and ``calls`` (the actions asked for, in order)."""

    def __init__(self, agents: Sequence[str] = ("/run/trainguard/agent.sock",)) -> None:
        self._agents = list(agents)
        self.down = False
        self.refusals: dict[str, ApiClientError] = {}
        self.calls: list[tuple[str, str, str, dict[str, Any]]] = []
        self._events_sent: set[str] = set()
        self.ticks = 0

    def agents(self) -> Sequence[str]:
        return self._agents

    def poll(self) -> list[AgentSnapshot]:
        if self.down:
            return [AgentSnapshot(a, error=f"no agent at {a}: is `trainguard agent` running?") for a in self._agents]
        out = []
        tick, self.ticks = self.ticks, self.ticks + 1
        for i, a in enumerate(self._agents):
            node = "node-a" if i == 0 else f"node-{chr(ord('a') + i)}"
            events = [] if a in self._events_sent else scene_events()
            self._events_sent.add(a)
            out.append(AgentSnapshot(a, status=copy.deepcopy(scene_status(node, tick)), events=events,
                                     checkpoints=scene_checkpoints()))
        return out

    def _act(self, name: str, agent: str, job: str, **kw: Any) -> dict[str, Any]:
        self.calls.append((name, agent, job, kw))
        if name in self.refusals:
            raise self.refusals[name]
        return {"job": job, "checkpoint_id": 5, "plan_version": 4, "message": "ok"}

    def checkpoint_now(self, agent: str, job: str) -> dict[str, Any]:
        return self._act("checkpoint", agent, job)

    def drain(self, agent: str, job: str, *, rank: int | None = None, node: str | None = None) -> dict[str, Any]:
        return self._act("drain", agent, job, rank=rank, node=node)


def screen_text(app: Any) -> str:
    """What a running app shows, as plain text lines (for tests and for looking at it in a log)."""
    import io

    from rich.console import Console

    width, height = app.size
    console = Console(width=width, height=height, file=io.StringIO(), force_terminal=True, color_system=None,
                      record=True, legacy_windows=False, safe_box=False)
    console.print(app.screen._compositor.render_update(full=True, screen_stack=app._background_screens))
    return console.export_text()


if __name__ == "__main__":
    import time

    from trainguard.tui.app import create_app

    create_app(FakeSource(), clock=lambda: T0, clock_text=lambda ts: time.strftime("%H:%M:%S", time.gmtime(ts))).run()
