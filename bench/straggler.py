"""Straggler benchmark: a 4-rank dp job healthy, with one rank 2x slower and no mitigation, and the
same with trainguard's shard migration, side by side in one run.

An in-process agent (the real daemon, straggler service installed with its default settings, the
agent's own 1 s tick) launches the embedded trainer three times:

  healthy     no fault; detection in observe-only mode: every straggler event is a false positive
  slow        ``slow:rank=1,factor=2`` from step S; observe-only (detected, nothing done)
  migrated    the same fault; detection and shard migration on

Throughput is samples per second over the same step range (after S + settle) of each run, from
rank 0's telemetry clock. With three ranks at speed 1 and one at 1/2 the ideal rebalanced
throughput is 3.5/4 of healthy; "slowdown removed" is the share of the gap between the slow run and
that ideal that migration closes.

    .venv/bin/python bench/straggler.py [--quick] [--steps N] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from agent.config import AgentConfig, apply_state_dir  # noqa: E402
from agent.daemon import Agent  # noqa: E402
from agent.detect import StragglerConfig, install  # noqa: E402
from agent.jobs import JobSpec  # noqa: E402

FACTOR = 2.0
SLOW_RANK = 1


@dataclass
class RunResult:
    name: str
    samples_per_s: float
    steps: int
    detect_step: int | None
    detected_ranks: list[int]
    migrations: int
    final_sizes: list[int] | None
    wall_s: float


def trainer_spec(steps: int, faults: list[str], cache: str) -> dict[str, Any]:
    return {
        "model": {"layers": 2, "d_model": 64, "heads": 4, "context": 64},
        "data": {"cache_dir": cache, "max_bytes": 2_000_000, "val_samples": 16},
        "parallel": {"dp": 4, "dp_mode": "ddp"}, "steps": steps, "global_batch": 64, "device": "cpu",
        "optim": {"warmup": 5}, "faults": faults,
    }


def run_job(agent: Agent, name: str, steps: int, faults: list[str], measure_from: int, cache: str,
            timeout_s: float) -> RunResult:
    t0 = time.monotonic()
    agent.supervisor.submit(JobSpec.from_dict({"job": name, "nproc": 4, "trainer": trainer_spec(steps, faults, cache)}))
    interval = agent.cfg.agent.interval_s
    while time.monotonic() - t0 < timeout_s:
        agent.tick(time.time())
        rec = agent.supervisor.jobs[name]
        if rec.state.finished:
            break
        time.sleep(interval)
    agent.tick(time.time())
    rec = agent.supervisor.jobs[name]
    if not rec.state.finished:
        agent.supervisor.stop(name, "benchmark timeout", hard=True)
    window = [m for m in agent.table.window(name, 0) if m.step >= measure_from]
    rate = float("nan")
    if len(window) >= 2:
        # Samples of the steps after the first one in the range, over the time they took (rank 0's
        # clock at each step end): the whole job's throughput, since every rank finishes each step.
        per_step = {m.step: m for m in window}
        steps_in = sorted(per_step)
        span = per_step[steps_in[-1]].wall_time - per_step[steps_in[0]].wall_time
        samples = 64 * (len(steps_in) - 1)
        rate = samples / span if span > 0 else float("nan")
    events = agent.events.since(0, 100000)
    det = [e for e in events if e["kind"] == "straggler_detected" and e.get("job") == name]
    migs = [e for e in events if e["kind"] == "shard_migration" and e.get("job") == name]
    slow_det = [e for e in det if e.get("rank") == SLOW_RANK]
    return RunResult(
        name=name, samples_per_s=rate, steps=max((m.step for m in window), default=0),
        detect_step=slow_det[0]["fields"].get("step") if slow_det else None,
        detected_ranks=[int(e["rank"]) for e in det], migrations=len(migs),
        final_sizes=migs[-1]["fields"]["batch_sizes"] if migs else None,
        wall_s=time.monotonic() - t0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="reduced run (< 2 minutes)")
    ap.add_argument("--steps", type=int, default=None, help="steps per run (default 400, quick 150)")
    ap.add_argument("--json", action="store_true", help="also print the results as one JSON object")
    args = ap.parse_args(argv)
    steps = args.steps or (150 if args.quick else 400)
    slow_from = 25 if args.quick else 40
    settle = 45 if args.quick else 80  # detection + migration + settle before throughput is measured
    measure_from = slow_from + settle
    if measure_from + 20 > steps:
        ap.error(f"--steps {steps} is too short: throughput is measured from step {measure_from}")
    cache = os.environ.get("TRAINGUARD_CACHE") or os.path.expanduser("~/.cache/trainguard")
    fault = f"slow:rank={SLOW_RANK},factor={FACTOR:g},step={slow_from}"

    with tempfile.TemporaryDirectory(prefix="tg-bench-straggler-") as tmp:
        cfg = apply_state_dir(AgentConfig(), tmp)
        cfg.metrics.addr = ""
        cfg.collectors.ebpf = False  # the detector needs telemetry and /proc; eBPF only names causes
        cfg.collectors.gpu = False
        agent = Agent(cfg)
        agent.start()
        service = install(agent, StragglerConfig())
        defaults = service.detection_config()
        results = []
        try:
            timeout = 90.0 if args.quick else 300.0
            service.update_detection({"observe_only": True})
            results.append(run_job(agent, "healthy", steps, [], measure_from, cache, timeout))
            results.append(run_job(agent, "slow", steps, [fault], measure_from, cache, timeout))
            service.update_detection({"observe_only": False})
            results.append(run_job(agent, "migrated", steps, [fault], measure_from, cache, timeout))
        finally:
            agent.shutdown()

    healthy, slow, mig = results
    ideal = healthy.samples_per_s * (3 + 1 / FACTOR) / 4
    removed = (mig.samples_per_s - slow.samples_per_s) / (ideal - slow.samples_per_s) \
        if ideal > slow.samples_per_s else float("nan")
    false_positives = len(healthy.detected_ranks) + len([r for r in slow.detected_ranks + mig.detected_ranks
                                                          if r != SLOW_RANK])
    detect_steps = [r.detect_step - slow_from for r in (slow, mig) if r.detect_step is not None]

    print(f"straggler benchmark: 4-rank dp job (gloo, CPU), global batch 64, rank {SLOW_RANK} {FACTOR:g}x slower "
          f"from step {slow_from}; throughput over steps {measure_from}..{steps}; detection defaults {defaults}")
    print(f"{'run':<10} {'samples/s':>10} {'vs healthy':>11} {'detected at':>12} {'stragglers':>11} "
          f"{'plans':>6} {'final batch sizes':>20} {'wall s':>7}")
    for r in results:
        print(f"{r.name:<10} {r.samples_per_s:>10.1f} {r.samples_per_s / healthy.samples_per_s:>11.3f} "
              f"{(str(r.detect_step) if r.detect_step is not None else '-'):>12} "
              f"{','.join(map(str, r.detected_ranks)) or '-':>11} {r.migrations:>6} "
              f"{str(r.final_sizes or '-'):>20} {r.wall_s:>7.1f}")
    print(f"{'ideal':<10} {ideal:>10.1f} {ideal / healthy.samples_per_s:>11.3f}   (3 ranks at 1, one at 1/{FACTOR:g})")
    print(f"steps to detection after the slowdown: {detect_steps or 'not detected'}; "
          f"slowdown removed: {removed:.1%} (goal >= 80%); migrated/ideal: {mig.samples_per_s / ideal:.3f}; "
          f"false positives: {false_positives}")
    if args.json:
        print(json.dumps({"results": [r.__dict__ for r in results], "ideal": ideal, "removed": removed}))
    detect = max(detect_steps) if detect_steps else -1
    print(f"RESULT detect_steps={detect} slowdown_removed={removed:.3f} false_positives={false_positives} "
          f"slow_vs_healthy_ratio={slow.samples_per_s / healthy.samples_per_s:.3f} "
          f"migrated_vs_healthy_ratio={mig.samples_per_s / healthy.samples_per_s:.3f} "
          f"migrated_vs_ideal_ratio={mig.samples_per_s / ideal:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
