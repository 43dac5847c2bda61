"""Straggler benchmark: a dp job healthy, with one rank slowed by a node-level cause and left alone,
and the same with trainguard's shard migration, side by side in one run, for each cause.

An in-process agent (the real daemon, straggler service installed with its default settings, the
agent's own 1 s tick) launches the embedded trainer:

  healthy-long       no cause; detection in observe-only mode, over --healthy-steps (2,000 by
                     default): every straggler event there is a false positive
  then per cause, back to back (the machine's load drifts; a reference minutes away is not one):
  <cause>-healthy    no cause, observe-only: the throughput reference (and more false-positive steps)
  <cause>-slowed     the cause applied to rank 1 from step S; observe-only (detected, nothing done)
  <cause>-healed     the same cause; detection and shard migration on

Causes, both applied from outside the job as a node would (the trainer injects nothing):
  quota   rank 1's process in a CPU cgroup with a quota of half a CPU (cgroup throttling);
  hog     two CPU-bound processes pinned to rank 1's core (run-queue delay);
  fault   the trainer's own ``slow`` fault (for comparison; not a node-level cause).

Every arm pins rank r to CPU r mod cores, so the hog shares exactly one rank's core and the arms
run alike; nothing gets extra CPU weight (the machine's other load is printed with the figures).

Throughput is samples per second over the same step range (after S and a settle) of each run,
from rank 0's telemetry clock. The headline per cause is measured only: lost throughput recovered
= (healed - slowed) / (healthy - slowed).

    .venv/bin/python bench/straggler.py [--quick] [--causes quota,hog] [--steps N] [--healthy-steps N]
                                        [--dp N] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Protocol

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from trainguard.agent.config import AgentConfig, apply_state_dir  # noqa: E402
from trainguard.agent.daemon import Agent  # noqa: E402
from trainguard.agent.detect import StragglerConfig, install  # noqa: E402
from trainguard.agent.lifecycle.jobs import JobSpec  # noqa: E402
from trainguard.demo.nodefaults import CpuCgroup, cpu_cgroup_unavailable, pin, start_cpu_hog  # noqa: E402

SLOW_RANK = 1
GLOBAL_BATCH = int(os.environ.get("TG_BENCH_BATCH", "128"))
CONTEXT = int(os.environ.get("TG_BENCH_CONTEXT", "128"))
QUOTA_CPU = 0.5
HOGS = 2
"""Two hogs: a rank that sleeps on collectives half the time wins its CPU back from one hog on each
wake-up (the scheduler favours sleepers), less so from two."""


@dataclass
class RunResult:
    name: str
    samples_per_s: float
    steps: int
    detect_step: int | None
    detected_ranks: list[int]
    causes: list[str]
    migrations: int
    final_sizes: list[int] | None
    wall_s: float


def trainer_spec(dp: int, steps: int, faults: list[str], cache: str) -> dict[str, Any]:
    # Long samples on a small model: compute, not the gloo all-reduce, is most of a step, as in real
    # training (a tiny model on CPU is communication-bound and hides any straggler).
    return {
        "model": {"layers": 2, "d_model": 64, "heads": 4, "context": CONTEXT},
        "data": {"cache_dir": cache, "max_bytes": 2_000_000, "val_samples": 16},
        "parallel": {"dp": dp, "dp_mode": "ddp"}, "steps": steps, "global_batch": GLOBAL_BATCH, "device": "cpu",
        "optim": {"warmup": 5}, "faults": faults,
    }


class Slowdown(Protocol):
    def apply(self, pid: int) -> None: ...
    def remove(self) -> None: ...


class Quota:
    """Rank 1's process into a CPU cgroup with a quota (its threads and later children follow)."""

    def __init__(self, fraction: float) -> None:
        self.fraction = fraction
        self.group: CpuCgroup | None = None

    def apply(self, pid: int) -> None:
        self.group = CpuCgroup("tg-bench-quota")
        self.group.quota(self.fraction)
        self.group.add(pid)

    def remove(self) -> None:
        if self.group is not None:
            self.group.remove()
            self.group = None


class Hogs:
    """CPU-bound processes pinned to the core rank 1 is pinned to."""

    def __init__(self, count: int, cpu: int) -> None:
        self.count, self.cpu = count, cpu
        self.procs: list[subprocess.Popen[bytes]] = []

    def apply(self, pid: int) -> None:
        self.procs = [start_cpu_hog(self.cpu) for _ in range(self.count)]

    def remove(self) -> None:
        for p in self.procs:
            p.kill()
            p.wait()
        self.procs = []


def run_job(agent: Agent, name: str, dp: int, steps: int, faults: list[str], measure_from: int, cache: str,
            timeout_s: float, slowdown: Slowdown | None = None, slow_from: int = 0) -> RunResult:
    t0 = time.monotonic()
    applied = False
    pinned: set[int] = set()
    cpus = os.cpu_count() or 1
    agent.supervisor.submit(JobSpec.from_dict({"job": name, "nproc": dp, "trainer": trainer_spec(dp, steps, faults, cache)}))
    interval = agent.cfg.agent.interval_s
    try:
        while time.monotonic() - t0 < timeout_s:
            agent.tick(time.time())
            rec = agent.supervisor.jobs[name]
            views = agent.table.snapshot().jobs.get(name, {})
            for rank, view in views.items():
                if view.pid not in pinned:  # the same placement in every arm: rank r on CPU r mod cores
                    try:
                        pin(view.pid, rank % cpus)
                    except OSError:
                        pass  # the rank just ended
                    pinned.add(view.pid)
            slow = views.get(SLOW_RANK)
            if slowdown is not None and not applied and slow is not None and slow.step >= slow_from:
                slowdown.apply(slow.pid)
                applied = True
            if rec.state.finished:
                break
            time.sleep(interval)
        agent.tick(time.time())
    finally:
        if slowdown is not None:
            slowdown.remove()
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
        detected_ranks=[int(e["rank"]) for e in det], causes=[str(e.get("cause")) for e in slow_det[:1]],
        migrations=len(migs), final_sizes=migs[-1]["fields"]["batch_sizes"] if migs else None,
        wall_s=time.monotonic() - t0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="reduced run (a few minutes)")
    ap.add_argument("--causes", default="", help="comma list of quota, hog, fault (default quota,hog; quick: quota)")
    ap.add_argument("--steps", type=int, default=None, help="steps of each run (default 300, quick 100)")
    ap.add_argument("--healthy-steps", type=int, default=None,
                    help="steps of the long healthy run, where every detection is a false positive (default 2000, quick 0: none)")
    ap.add_argument("--json", action="store_true", help="also print the results as one JSON object")
    ap.add_argument("--dp", type=int, default=min(4, os.cpu_count() or 2),
                    help="ranks (data-parallel degree); default one per core up to 4 (the hog needs a core of its rank's own)")
    args = ap.parse_args(argv)
    # --quick (the suite's smoke test) runs one cause; the full run both.
    causes = [c for c in (args.causes or ("quota" if args.quick else "quota,hog")).split(",") if c]
    bad = [c for c in causes if c not in ("quota", "hog", "fault")]
    if bad or not causes:
        ap.error(f"--causes: unknown {bad or 'empty'}; choose from quota, hog, fault")
    if args.dp < 2:
        ap.error("--dp must be at least 2")
    if "quota" in causes and (why := cpu_cgroup_unavailable()):
        ap.error(f"the quota cause needs a CPU cgroup: {why}")
    if "hog" in causes and args.dp > (os.cpu_count() or 1):
        ap.error(f"the hog cause needs a core per rank: --dp {args.dp} on {os.cpu_count()} cores")
    steps = args.steps or (100 if args.quick else 300)
    # --quick skips the long healthy run: the causes' own healthy runs count the false positives.
    healthy_steps = args.healthy_steps if args.healthy_steps is not None else (0 if args.quick else 2000)
    slow_from = 15 if args.quick else 30
    settle = 55 if args.quick else 90  # detection + migration + settle before throughput is measured
    measure_from = slow_from + settle
    if measure_from + 20 > steps:
        ap.error(f"--steps {steps} is too short: throughput is measured from step {measure_from}")
    cache = os.environ.get("TRAINGUARD_CACHE") or os.path.expanduser("~/.cache/trainguard")
    load_before = os.getloadavg()
    results, defaults = run_all(args.dp, causes, steps, healthy_steps, slow_from, measure_from, cache,
                                120.0 if args.quick else 600.0)
    return report(results, defaults, args.dp, causes, steps, healthy_steps, slow_from, measure_from, load_before,
                  args.json)


def _slowdown(cause: str) -> tuple[list[str], Slowdown | None, str]:
    if cause == "quota":
        return [], Quota(QUOTA_CPU), f"a CPU quota of {QUOTA_CPU:g} CPU on rank {SLOW_RANK}'s cgroup"
    if cause == "hog":
        return [], Hogs(HOGS, SLOW_RANK % (os.cpu_count() or 1)), f"{HOGS} CPU hogs pinned to rank {SLOW_RANK}'s core"
    return [f"slow:rank={SLOW_RANK},factor=2,step={{slow_from}}"], None, "the trainer's slow fault (factor 2)"


def run_all(dp: int, causes: list[str], steps: int, healthy_steps: int, slow_from: int, measure_from: int,
            cache: str, timeout: float) -> tuple[list[tuple[str, RunResult]], dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="tg-bench-straggler-") as tmp:
        cfg = apply_state_dir(AgentConfig(), tmp)
        cfg.metrics.addr = ""
        cfg.collectors.ebpf = False  # the detector needs telemetry and /proc; eBPF adds detail to causes
        cfg.collectors.gpu = False
        # Ranks stay in this process's cgroup, as in the runs bench/results records: a job cgroup
        # would make the two ranks one CPU-weight entity against the rest of the machine.
        cfg.launcher.cgroups = "off"
        cfg.detection = StragglerConfig()  # the defaults, whatever a config file would say
        agent = Agent(cfg)
        agent.start()
        service = install(agent)  # the one the daemon started
        defaults = service.detection_config()
        results: list[tuple[str, RunResult]] = []
        try:
            service.update_detection({"observe_only": True})
            if healthy_steps:
                results.append(("fp", run_job(agent, "healthy-long", dp, healthy_steps, [], measure_from, cache,
                                              timeout * max(1.0, healthy_steps / steps))))
            for cause in causes:
                # Its own healthy reference right before its slowed and healed runs: the machine's
                # load drifts over a long benchmark, and a reference measured minutes apart is not one.
                for arm, observe in (("healthy", True), ("slowed", True), ("healed", False)):
                    faults, slowdown, _ = _slowdown(cause)
                    if arm == "healthy":
                        faults, slowdown = [], None
                    faults = [f.format(slow_from=slow_from) for f in faults]
                    service.update_detection({"observe_only": observe})
                    results.append((cause, run_job(agent, f"{cause}-{arm}", dp, steps, faults, measure_from, cache,
                                                   timeout, slowdown, slow_from)))
        finally:
            agent.shutdown()
    return results, defaults


def report(results: list[tuple[str, RunResult]], defaults: dict[str, Any], dp: int, causes: list[str], steps: int,
           healthy_steps: int, slow_from: int, measure_from: int, load_before: tuple[float, float, float],
           as_json: bool) -> int:
    long_runs = [r for group, r in results if group == "fp"]
    refs = {group: r for group, r in results if r.name.endswith("-healthy")}
    print(f"straggler benchmark: {dp}-rank dp job (gloo, CPU, {os.cpu_count()} cores, rank r pinned to CPU r), "
          f"global batch {GLOBAL_BATCH} x {CONTEXT} tokens; rank {SLOW_RANK} slowed from step {slow_from}; "
          f"throughput over steps {measure_from}..{steps}; no extra CPU weight; load average before "
          f"{load_before[0]:.1f}, after {os.getloadavg()[0]:.1f}; detection defaults {defaults}")
    print(f"{'run':<14} {'samples/s':>10} {'vs healthy':>11} {'detected at':>12} {'cause':>15} {'stragglers':>11} "
          f"{'plans':>6} {'final batch sizes':>20} {'wall s':>7}")
    for group, r in results:
        ref = refs.get(group)
        vs = f"{r.samples_per_s / ref.samples_per_s:>11.3f}" if ref is not None else f"{'-':>11}"
        print(f"{r.name:<14} {r.samples_per_s:>10.1f} {vs} "
              f"{(str(r.detect_step) if r.detect_step is not None else '-'):>12} {','.join(r.causes) or '-':>15} "
              f"{','.join(map(str, r.detected_ranks)) or '-':>11} {r.migrations:>6} "
              f"{str(r.final_sizes or '-'):>20} {r.wall_s:>7.1f}")
    false_positives = sum(len(r.detected_ranks) for r in long_runs) + sum(len(r.detected_ranks) for r in refs.values())
    wrong_rank = sum(1 for group, r in results if group != "fp" and r not in refs.values()
                     for rank in r.detected_ranks if rank != SLOW_RANK)
    fp_steps = healthy_steps + steps * len(refs)
    fields = [f"false_positives={false_positives}", f"healthy_steps={fp_steps}", f"wrong_rank={wrong_rank}"]
    for cause in causes:
        healthy, slowed, healed = (r for group, r in results if group == cause)
        recovered = ((healed.samples_per_s - slowed.samples_per_s) / (healthy.samples_per_s - slowed.samples_per_s)
                     if healthy.samples_per_s > slowed.samples_per_s else float("nan"))
        detect = [r.detect_step - slow_from for r in (slowed, healed) if r.detect_step is not None]
        _, _, how = _slowdown(cause)
        print(f"{cause}: {how}: slowed to {slowed.samples_per_s / healthy.samples_per_s:.3f} of its healthy run, "
              f"healed to {healed.samples_per_s / healthy.samples_per_s:.3f}: {recovered:.1%} of the lost throughput "
              f"recovered; detected {detect or 'never'} steps after the slowdown, cause "
              f"{slowed.causes or healed.causes or '-'}")
        fields += [f"{cause}_recovered_ratio={recovered:.3f}",
                   f"{cause}_slowed_vs_healthy_ratio={slowed.samples_per_s / healthy.samples_per_s:.3f}",
                   f"{cause}_healed_vs_healthy_ratio={healed.samples_per_s / healthy.samples_per_s:.3f}",
                   f"{cause}_detect_steps={max(detect) if detect else -1}",
                   f"{cause}_cause={(slowed.causes or healed.causes or ['-'])[0]}"]
    print(f"false positives: {false_positives} in {fp_steps} healthy steps (the long run and each cause's healthy "
          f"run); detections of another rank in the slowed runs: {wrong_rank}")
    if as_json:
        print(json.dumps({"results": [dict(r.__dict__, group=g) for g, r in results]}))
    print("RESULT " + " ".join(fields))
    return 0


if __name__ == "__main__":
    sys.exit(main())
