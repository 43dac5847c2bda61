"""Scale: the leader's detectors and controller under a simulated 1,024-rank job.

The leader's job-wide work, fed the way it would be at 1,024 ranks x 10 steps/s (10,240 telemetry
messages a second), in real time, in one process:

* ingest: decode every message (``agent.wire.decode_telemetry``) and store it (``RankTable``);
* detect: the real ``StragglerService`` (robust per-rank scores, hysteresis, shard migration
  plans) once a second, as the daemon ticks;
* control: the real ``Controller`` (goodput strategy: gradient-noise-scale batch size) once a
  second.

Side by side: ``ingest`` (the baseline: only decode + store), ``leader`` (ingest + detect +
control) and ``forwarded`` (the same as ``leader``, but the messages arrive the way a job spanning
nodes delivers them to its rank-0 node: batched per node of 8 ranks every 0.25 s, one JSON body
per node, unpacked by ``agent.cluster.gang.decode_forwarded``; HTTP parsing and auth not counted). The simulator that builds and encodes the messages runs in the same thread but is not
counted: each phase is timed with ``time.thread_time()`` (CPU seconds of this thread, so a busy
shared machine does not inflate it). At ``--slow-at`` seconds rank 517 becomes 2x slower in
compute; *decision latency* is the wall time from its first slow step to the leader's
``straggler_detected`` decision, and *tick* figures are the CPU time of one detect + control pass.

    python bench/scale.py [--quick] [--ranks N] [--rate STEPS_PER_S] [--seconds S] [--json]

Ends with ``RESULT leader_cpu_cores=... decision_latency_s=... ...``; ``leader_cpu_cores`` is scaled to
the full offered load (ingest CPU per message x offered rate + tick CPU per second), because on a
busy 2-core machine the simulator may fall behind real time; the measured figure is printed too.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from trainguard.agent.cluster.gang import decode_forwarded  # noqa: E402
from trainguard.agent.controller import ControllerConfig  # noqa: E402
from trainguard.agent.controller.controller import Controller  # noqa: E402
from trainguard.agent.detect import StragglerConfig  # noqa: E402
from trainguard.agent.detect.service import StragglerService  # noqa: E402
from trainguard.agent.lifecycle.jobs import JobState  # noqa: E402
from trainguard.agent.lifecycle.plans import PlanStore  # noqa: E402
from trainguard.agent.ranktable import RankTable, RankTableConfig  # noqa: E402
from trainguard.agent.wire import Telemetry, decode_telemetry  # noqa: E402

JOB = "scale"
SLOW_RANK = 517
PER_RANK_BATCH = 8


class Events:
    """The leader's event sink: keeps (wall time, kind, fields) of every decision."""

    def __init__(self) -> None:
        self.items: list[tuple[float, str, dict[str, Any]]] = []

    def emit(self, kind: str, message: str, **fields: Any) -> None:
        self.items.append((time.time(), kind, fields))

    def first(self, kind: str, rank: int | None = None) -> float | None:
        for t, k, f in self.items:
            if k == kind and (rank is None or f.get("rank") == rank):
                return t
        return None


@dataclass
class Result:
    mode: str
    ranks: int
    rate: float
    seconds: float
    msgs: int
    ingest_cpu_s: float
    tick_cpu_s: float
    ticks: list[float] = field(default_factory=list)
    decision_latency_s: float | None = None
    detected_ranks: list[int] = field(default_factory=list)
    false_positives: int = 0
    plans_published: int = 0

    @property
    def cpu_cores(self) -> float:
        return (self.ingest_cpu_s + self.tick_cpu_s) / self.seconds

    def cores_at(self, offered_msgs_per_s: float) -> float:
        """CPU cores at the full offered load: per-message ingest cost x offered rate + tick CPU
        per second (a loaded machine may not let the simulator keep up in real time)."""
        return self.us_per_msg * 1e-6 * offered_msgs_per_s + self.tick_cpu_s / self.seconds

    @property
    def us_per_msg(self) -> float:
        return 1e6 * self.ingest_cpu_s / max(1, self.msgs)

    def tick_p(self, q: float) -> float:
        if not self.ticks:
            return float("nan")
        s = sorted(self.ticks)
        return s[min(len(s) - 1, int(q * len(s)))]


def leader_for(ranks: int, tmp: str) -> SimpleNamespace:
    trainer = {"parallel": {"dp": ranks, "tp": 1, "pp": 1}, "global_batch": ranks * PER_RANK_BATCH}
    # JobSpec caps one agent's ranks at 1,024; the leader only reads the trainer layout.
    spec = SimpleNamespace(job=JOB, nproc=ranks, trainer=trainer)
    return SimpleNamespace(
        table=RankTable(RankTableConfig(ring=64, window=32)),
        supervisor=SimpleNamespace(jobs={JOB: SimpleNamespace(spec=spec, state=JobState.RUNNING, decides_here=True,
                                                              attempt=0, block=None)}),
        plans=PlanStore(os.path.join(tmp, "plans")),
        events=Events(),
        exclude_rank=lambda job, rank, reason: False,  # the bench times detection: no restarts
        rollback=None,
        tick_hooks=[],
    )


def run(mode: str, ranks: int, rate: float, seconds: float, slow_at: float, seed: int = 0) -> Result:
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory(prefix="tg-scale-") as tmp:
        agent = leader_for(ranks, tmp)
        hooks: list[Any] = []
        if mode in ("leader", "forwarded"):
            # No /proc evidence for simulated pids: point the readers at an empty tree.
            empty = os.path.join(tmp, "proc")
            os.makedirs(empty)
            from pathlib import Path

            straggler = StragglerService(StragglerConfig(include_run_delay=False), events=agent.events,  # type: ignore[arg-type]
                                         table=agent.table, supervisor=agent.supervisor, plans=agent.plans,
                                         exclude_rank=agent.exclude_rank, proc_root=Path(empty), sys_root=Path(empty))
            controller = Controller(ControllerConfig(strategy="goodput", every_steps=50, warmup_steps=20))
            hooks = [straggler.tick, lambda now: controller.tick(agent, now)]
        period = 1.0 / rate
        base_fwd = [0.055 + 0.01 * rng.random() for _ in range(ranks)]
        t_start = time.time()
        next_tick = t_start + 1.0
        slow_from_step: int | None = None
        slow_wall: float | None = None
        ingest_cpu = tick_cpu = 0.0
        msgs = 0
        ticks: list[float] = []
        step = 0
        per_node = 8
        outbox: dict[int, list[str]] = {}
        next_flush = t_start + 0.25
        while True:
            now = time.time()
            if now - t_start >= seconds:
                break
            slow = now - t_start >= slow_at
            if slow and slow_from_step is None:
                slow_from_step, slow_wall = step, now
            # simulator (not counted): one step of every rank, encoded as the trainer sends it
            payloads = []
            for r in range(ranks):
                fwd = base_fwd[r] * (1.0 + 0.03 * rng.random()) * (2.0 if slow and r == SLOW_RANK else 1.0)
                payloads.append(Telemetry(
                    job=JOB, rank=r, local_rank=r % 8, pid=100000 + r, step=step, wall_time=now, step_s=period,
                    data_s=0.002, fwd_bwd_s=fwd, comm_s=max(0.0, period - fwd - 0.006), opt_s=0.006,
                    samples=PER_RANK_BATCH, tokens=PER_RANK_BATCH * 512, loss=3.0 / (1 + 0.01 * step),
                    grad_norm=1.0, local_grad_sq=1.0 + 0.1 * rng.random(), lr=3e-4, batch_size=PER_RANK_BATCH,
                    mem_bytes=1 << 30, plan_version=0, dp_rank=r, world_size=ranks,
                ).encode())
            if mode == "forwarded":
                for r, p in enumerate(payloads):
                    outbox.setdefault(r // per_node, []).append(p.decode())
                if now >= next_flush:
                    # the sending nodes' work (not counted): one body per node per 0.25 s
                    bodies = [json.dumps({"node": f"n{n}", "messages": m}) for n, m in outbox.items()]
                    outbox.clear()
                    next_flush += 0.25
                    c0 = time.thread_time()
                    for body in bodies:
                        doc = json.loads(body)
                        good, _ = decode_forwarded(JOB, doc["messages"])
                        agent.table.add_many(good, now)
                        msgs += len(good)
                    ingest_cpu += time.thread_time() - c0
            else:
                # leader: decode + store
                c0 = time.thread_time()
                agent.table.add_many([decode_telemetry(p) for p in payloads], now)
                ingest_cpu += time.thread_time() - c0
                msgs += len(payloads)
            if hooks and now >= next_tick:
                c0 = time.thread_time()
                for hook in hooks:
                    hook(now)
                dt = time.thread_time() - c0
                ticks.append(dt)
                tick_cpu += dt
                next_tick += 1.0
            step += 1
            delay = t_start + step * period - time.time()
            if delay > 0:
                time.sleep(delay)
        wall = time.time() - t_start
        ev: Events = agent.events
        detected = sorted({int(f["rank"]) for _, k, f in ev.items if k == "straggler_detected" and "rank" in f})
        first = ev.first("straggler_detected", SLOW_RANK)
        return Result(
            mode=mode, ranks=ranks, rate=rate, seconds=wall, msgs=msgs, ingest_cpu_s=ingest_cpu, tick_cpu_s=tick_cpu,
            ticks=ticks, decision_latency_s=(first - slow_wall) if first is not None and slow_wall is not None else None,
            detected_ranks=detected, false_positives=len([r for r in detected if r != SLOW_RANK]),
            plans_published=agent.plans.get(JOB).version,
        )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="20 s per mode instead of 60 s")
    p.add_argument("--ranks", type=int, default=1024)
    p.add_argument("--rate", type=float, default=10.0, help="steps per second per rank")
    p.add_argument("--seconds", type=float, default=0.0)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    seconds = args.seconds or (20.0 if args.quick else 60.0)
    slow_at = seconds * 0.4
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = float("nan")
    print(f"scale: {args.ranks} simulated ranks x {args.rate:g} steps/s = {args.ranks * args.rate:,.0f} msg/s to the "
          f"leader; {seconds:g} s per mode; rank {SLOW_RANK} 2x slower from t={slow_at:g} s; "
          f"{os.cpu_count()} CPUs, load average {load:.1f}")
    results = [run(m, args.ranks, args.rate, seconds, slow_at) for m in ("ingest", "leader", "forwarded")]
    print(f"{'mode':8} {'msgs/s':>9} {'ingest us/msg':>14} {'tick CPU p50 ms':>16} {'tick CPU p99 ms':>16} "
          f"{'CPU cores':>10} {'at offered':>10} {'decision latency s':>19} {'false pos.':>10} {'plans':>6}")
    offered = args.ranks * args.rate
    for r in results:
        lat = f"{r.decision_latency_s:.2f}" if r.decision_latency_s is not None else "-"
        p50 = f"{1e3 * r.tick_p(0.5):.1f}" if r.ticks else "-"
        p99 = f"{1e3 * r.tick_p(0.99):.1f}" if r.ticks else "-"
        print(f"{r.mode:8} {r.msgs / r.seconds:>9,.0f} {r.us_per_msg:>14.1f} {p50:>16} {p99:>16} {r.cpu_cores:>10.3f} "
              f"{r.cores_at(offered):>10.3f} {lat:>19} {r.false_positives if r.mode != 'ingest' else '-':>10} {r.plans_published:>6}")
    base, lead, fwd = results
    overhead = lead.cpu_cores / base.cpu_cores if base.cpu_cores > 0 else float("nan")
    achieved = lead.msgs / lead.seconds / offered
    full = lead.cores_at(offered)
    print(f"leader vs ingest-only CPU: {overhead:.2f}x; detectors + controller per tick: "
          f"{1e3 * statistics.median(lead.ticks) if lead.ticks else float('nan'):.1f} ms CPU (median); "
          f"offered load achieved: {achieved:.0%}; leader at the full offered load: {full:.3f} cores, goal <= 1 core: {'met' if full <= 1.0 else 'NOT met'}")
    if args.json:
        print(json.dumps([asdict(r) | {"cpu_cores": r.cpu_cores} for r in results]))
    fwd_full = fwd.cores_at(offered)
    print(f"forwarded (batched per node, rank-0 node as judge) vs direct: {fwd_full / full if full > 0 else float('nan'):.2f}x CPU "
          f"({fwd.us_per_msg:.1f} vs {lead.us_per_msg:.1f} us/msg ingest); decision latency "
          f"{fwd.decision_latency_s if fwd.decision_latency_s is not None else float('nan'):.2f} s; false positives {fwd.false_positives}")
    lat = lead.decision_latency_s
    print(f"RESULT leader_cpu_cores={full:.3f} measured_cpu_cores={lead.cpu_cores:.3f} decision_latency_s={lat if lat is not None else float('nan'):.2f} "
          f"ingest_cpu_cores={base.cores_at(offered):.3f} leader_overhead_ratio={overhead:.2f} "
          f"tick_cpu_ms_p50={1e3 * lead.tick_p(0.5):.1f} tick_cpu_ms_p99={1e3 * lead.tick_p(0.99):.1f} "
          f"load_achieved_ratio={achieved:.3f} false_positives={lead.false_positives} "
          f"forwarded_cpu_cores={fwd_full:.3f} forwarded_ratio={fwd_full / full if full > 0 else float('nan'):.2f} "
          f"forwarded_decision_latency_s={fwd.decision_latency_s if fwd.decision_latency_s is not None else float('nan'):.2f} "
          f"forwarded_false_positives={fwd.false_positives}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
