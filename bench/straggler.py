"""Straggler benchmark: a 4-rank dp job healthy, with one rank 2x slower and no mitigation, and the
same with trainguard's shard migration, side by side in one run.

An in-process agent (the real daemon, straggler service installed with its default settings, the
agent's own 1 s tick) launches the embedded trainer three times:

  healthy     no fault; detection in observe-only mode: every straggler event is a false positive
  slow        ``slow:rank=1,factor=2`` from step S; observe-only (detected, nothing done)
  migrated    the same fault; detection and shard migration on

The machine is shared (other processes come and go), so by default the benchmark moves itself, and
with it the agent and every rank it starts, into a CPU cgroup with 20x the default weight: the runs
then compete with each other's configuration, not with whatever else happens to run (--no-cgroup
to measure without it).

Throughput is samples per second over the same step range (after S + settle) of each run, from
rank 0's telemetry clock. With three ranks at speed 1 and one at 1/2 the ideal rebalanced
throughput is 3.5/4 of healthy; "slowdown removed" is the share of the gap between the slow run and
that ideal that migration closes.

With ``--slow-by quota`` rank 1 is made slow by a CPU quota instead of the trainer's fault (the
fault burns its extra time after the gradient all-reduce; a quota slows the compute itself).

    .venv/bin/python bench/straggler.py [--quick] [--steps N] [--dp N] [--slow-by fault|quota] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from trainguard.agent.config import AgentConfig, apply_state_dir  # noqa: E402
from trainguard.agent.daemon import Agent  # noqa: E402
from trainguard.agent.detect import StragglerConfig, install  # noqa: E402
from trainguard.agent.jobs import JobSpec  # noqa: E402

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


GLOBAL_BATCH = int(os.environ.get("TG_BENCH_BATCH", "128"))
CONTEXT = int(os.environ.get("TG_BENCH_CONTEXT", "128"))


DP = 4


def trainer_spec(steps: int, faults: list[str], cache: str) -> dict[str, Any]:
    # Long samples on a small model: compute, not the gloo all-reduce, is most of a step, as in real
    # training (a tiny model on CPU is communication-bound and hides any straggler).
    return {
        "model": {"layers": 2, "d_model": 64, "heads": 4, "context": CONTEXT},
        "data": {"cache_dir": cache, "max_bytes": 2_000_000, "val_samples": 16},
        "parallel": {"dp": DP, "dp_mode": "ddp"}, "steps": steps, "global_batch": GLOBAL_BATCH, "device": "cpu",
        "optim": {"warmup": 5}, "faults": faults,
    }


class Throttle:
    """The other way to make a rank 2x slower: a CPU quota of half its share of the cores (a child
    cgroup of the benchmark's), applied from a given step. Unlike the trainer's ``slow`` fault, which
    burns its extra time after the gradient all-reduce, a throttled rank is slow in its compute."""

    def __init__(self, group: WeightedCgroup, fraction: float = 0.5) -> None:
        self.group = group
        self.fraction = fraction
        self.path: Path | None = None

    def apply(self, pid: int) -> None:
        self.path = self.group.path / f"slow-{pid}"
        self.path.mkdir()
        period = 100_000
        if self.group.version == "v2":
            (self.path / "cpu.max").write_text(f"{int(self.fraction * period)} {period}\n")
        else:
            (self.path / "cpu.cfs_period_us").write_text(f"{period}\n")
            (self.path / "cpu.cfs_quota_us").write_text(f"{int(self.fraction * period)}\n")
        (self.path / "cgroup.procs").write_text(f"{pid}\n")

    def remove(self) -> None:
        if self.path is not None:
            for _ in range(50):
                try:
                    self.path.rmdir()
                    break
                except OSError:
                    time.sleep(0.1)
            self.path = None


def run_job(agent: Agent, name: str, steps: int, faults: list[str], measure_from: int, cache: str,
            timeout_s: float, throttle: Throttle | None = None, slow_from: int = 0) -> RunResult:
    t0 = time.monotonic()
    throttled = False
    agent.supervisor.submit(JobSpec.from_dict({"job": name, "nproc": DP, "trainer": trainer_spec(steps, faults, cache)}))
    interval = agent.cfg.agent.interval_s
    while time.monotonic() - t0 < timeout_s:
        agent.tick(time.time())
        rec = agent.supervisor.jobs[name]
        if throttle is not None and not throttled:
            view = agent.table.snapshot().jobs.get(name, {}).get(SLOW_RANK)
            if view is not None and view.step >= slow_from:
                throttle.apply(view.pid)
                throttled = True
        if rec.state.finished:
            break
        time.sleep(interval)
    agent.tick(time.time())
    if throttle is not None:
        throttle.remove()
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
        samples = GLOBAL_BATCH * (len(steps_in) - 1)
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


class WeightedCgroup:
    """Move this process (and so its future children) into a CPU cgroup with more weight."""

    def __init__(self, times: int = 20) -> None:
        v2 = Path("/sys/fs/cgroup")
        if (v2 / "cgroup.controllers").exists() and "cpu" in (v2 / "cgroup.controllers").read_text().split():
            self.parent, knob, value = v2, "cpu.weight", str(min(10000, 100 * times))
            self.version = "v2"
        elif Path("/sys/fs/cgroup/cpu/cpu.shares").exists():
            self.parent, knob, value = Path("/sys/fs/cgroup/cpu"), "cpu.shares", str(1024 * times)
            self.version = "v1"
        else:
            raise OSError("no CPU cgroup controller")
        self.path = self.parent / f"tg-bench-straggler-{os.getpid()}"
        self.path.mkdir()
        (self.path / knob).write_text(value + "\n")
        (self.path / "cgroup.procs").write_text(f"{os.getpid()}\n")

    def close(self) -> None:
        try:
            (self.parent / "cgroup.procs").write_text(f"{os.getpid()}\n")
        except OSError:
            pass
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="reduced run (< 2 minutes)")
    ap.add_argument("--steps", type=int, default=None, help="steps per run (default 300, quick 120)")
    ap.add_argument("--json", action="store_true", help="also print the results as one JSON object")
    ap.add_argument("--dp", type=int, default=4,
                    help="ranks (data-parallel degree); 4 is the benchmark, 2 fits this machine's 2 cores")
    ap.add_argument("--slow-by", choices=("fault", "quota"), default="fault",
                    help="how rank 1 is made 2x slower: the trainer's slow fault, or a CPU quota of half its share of the cores")
    ap.add_argument("--no-cgroup", action="store_true", help="do not isolate the runs in a weighted CPU cgroup")
    args = ap.parse_args(argv)
    global DP
    DP = args.dp
    if DP < 2:
        ap.error("--dp must be at least 2")
    steps = args.steps or (120 if args.quick else 300)
    slow_from = 15 if args.quick else 30
    settle = 55 if args.quick else 90  # detection + migration + settle before throughput is measured
    measure_from = slow_from + settle
    if measure_from + 20 > steps:
        ap.error(f"--steps {steps} is too short: throughput is measured from step {measure_from}")
    cache = os.environ.get("TRAINGUARD_CACHE") or os.path.expanduser("~/.cache/trainguard")
    fault = f"slow:rank={SLOW_RANK},factor={FACTOR:g},step={slow_from}"

    group: WeightedCgroup | None = None
    if not args.no_cgroup or args.slow_by == "quota":
        try:
            group = WeightedCgroup()
        except OSError as exc:
            print(f"note: running without a weighted CPU cgroup ({exc})", file=sys.stderr)
    try:
        if args.slow_by == "quota" and group is None:
            ap.error("--slow-by quota needs a CPU cgroup controller")
        # Half of the CPU a rank gets when every rank computes (a core each, or a share of one).
        share = min(1.0, (os.cpu_count() or 1) / DP) / FACTOR
        throttle = Throttle(group, share) if args.slow_by == "quota" and group is not None else None
        results, defaults = run_all(steps, [] if throttle else [fault], measure_from, cache,
                                    90.0 if args.quick else 300.0, throttle, slow_from)
    finally:
        if group is not None:
            group.close()
    share = min(1.0, (os.cpu_count() or 1) / DP) / FACTOR
    how = f"a CPU quota of {share:.2f} core" if args.slow_by == "quota" else f"the trainer's fault {fault}"
    return report(results, defaults, steps, slow_from, measure_from, group is not None, args.json, how)


def run_all(steps: int, faults: list[str], measure_from: int, cache: str, timeout: float, throttle: Throttle | None,
            slow_from: int) -> tuple[list[RunResult], dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="tg-bench-straggler-") as tmp:
        cfg = apply_state_dir(AgentConfig(), tmp)
        cfg.metrics.addr = ""
        cfg.collectors.ebpf = False  # the detector needs telemetry and /proc; eBPF only names causes
        cfg.collectors.gpu = False
        cfg.detection = StragglerConfig()  # the defaults, whatever a config file would say
        agent = Agent(cfg)
        agent.start()
        service = install(agent)  # the one the daemon started
        defaults = service.detection_config()
        results = []
        try:
            service.update_detection({"observe_only": True})
            results.append(run_job(agent, "healthy", steps, [], measure_from, cache, timeout))
            results.append(run_job(agent, "slow", steps, faults, measure_from, cache, timeout, throttle, slow_from))
            service.update_detection({"observe_only": False})
            results.append(run_job(agent, "migrated", steps, faults, measure_from, cache, timeout, throttle, slow_from))
        finally:
            agent.shutdown()
    return results, defaults


def report(results: list[RunResult], defaults: dict[str, Any], steps: int, slow_from: int, measure_from: int,
           isolated: bool, as_json: bool, how: str) -> int:
    healthy, slow, mig = results
    ideal = healthy.samples_per_s * (DP - 1 + 1 / FACTOR) / DP
    removed = (mig.samples_per_s - slow.samples_per_s) / (ideal - slow.samples_per_s) \
        if ideal > slow.samples_per_s else float("nan")
    # The same with the slow rank's factor measured (slow/healthy throughput) instead of nominal:
    # a quota or a fault is never exactly 2x in effect.
    measured_ideal = healthy.samples_per_s * (DP - 1 + slow.samples_per_s / healthy.samples_per_s) / DP
    lost_recovered = (mig.samples_per_s - slow.samples_per_s) / (healthy.samples_per_s - slow.samples_per_s) \
        if healthy.samples_per_s > slow.samples_per_s else float("nan")
    false_positives = len(healthy.detected_ranks) + len([r for r in slow.detected_ranks + mig.detected_ranks
                                                          if r != SLOW_RANK])
    detect_steps = [r.detect_step - slow_from for r in (slow, mig) if r.detect_step is not None]

    print(f"straggler benchmark: {DP}-rank dp job (gloo, CPU, {os.cpu_count()} cores), global batch {GLOBAL_BATCH} x {CONTEXT} tokens, rank {SLOW_RANK} {FACTOR:g}x slower "
          f"from step {slow_from} by {how}; throughput over steps {measure_from}..{steps}; "
          f"{'in a weighted CPU cgroup' if isolated else 'not isolated'}; detection defaults {defaults}")
    print(f"{'run':<10} {'samples/s':>10} {'vs healthy':>11} {'detected at':>12} {'stragglers':>11} "
          f"{'plans':>6} {'final batch sizes':>20} {'wall s':>7}")
    for r in results:
        print(f"{r.name:<10} {r.samples_per_s:>10.1f} {r.samples_per_s / healthy.samples_per_s:>11.3f} "
              f"{(str(r.detect_step) if r.detect_step is not None else '-'):>12} "
              f"{','.join(map(str, r.detected_ranks)) or '-':>11} {r.migrations:>6} "
              f"{str(r.final_sizes or '-'):>20} {r.wall_s:>7.1f}")
    print(f"{'ideal':<10} {ideal:>10.1f} {ideal / healthy.samples_per_s:>11.3f}   ({DP - 1} ranks at 1, one at 1/{FACTOR:g})")
    print(f"{'ideal*':<10} {measured_ideal:>10.1f} {measured_ideal / healthy.samples_per_s:>11.3f}   "
          f"(slow rank at the measured slow/healthy ratio)")
    print(f"lost throughput recovered by migration: {lost_recovered:.1%} of (healthy - slow)")
    print(f"steps to detection after the slowdown: {detect_steps or 'not detected'}; "
          f"slowdown removed: {removed:.1%} (goal >= 80%); migrated/ideal: {mig.samples_per_s / ideal:.3f}; "
          f"false positives: {false_positives}")
    if as_json:
        print(json.dumps({"results": [r.__dict__ for r in results], "ideal": ideal, "removed": removed}))
    detect = max(detect_steps) if detect_steps else -1
    print(f"RESULT detect_steps={detect} slowdown_removed={removed:.3f} false_positives={false_positives} "
          f"slow_vs_healthy_ratio={slow.samples_per_s / healthy.samples_per_s:.3f} "
          f"migrated_vs_healthy_ratio={mig.samples_per_s / healthy.samples_per_s:.3f} "
          f"migrated_vs_ideal_ratio={mig.samples_per_s / ideal:.3f} lost_recovered_ratio={lost_recovered:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
