"""`trainguard demo`: an agent and a 4-rank training job of the bundled GPT, hit from outside the
way a node hits a job, healed live, and a verdict that checks each heal.

The demo plays the node (nothing is injected by the trainer itself):
  0. every rank runs in a CPU slice of its own (a cgroup with a CPU quota, as a container's CPU
     limit gives each rank of a real job); the slice follows its rank across the restart;
  1. once the job runs, rank 2's slice is cut (a node-level cause the collectors see as cgroup
     throttling), as a node's slow slot would be;
  2. once the agent has migrated samples away from rank 2 and the job has run on a while, rank 1
     gets SIGKILL.
"demo passed" needs all of: the kill healed (job resumed from a checkpoint and finished), the
straggler detected on rank 2 with the cause the collectors saw, samples migrated off it, the
migration kept across the restart, and the job's step rate regained (measured: healthy, slowed,
migrated). Without root or a CPU cgroup the trainer's own slow fault stands in and the cause
check is left out, saying so.

Everything runs under one temporary state directory (printed, so `trainguard top --state-dir DIR`
can watch it from another terminal).
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainguard.demo.nodefaults import CpuCgroup, cpu_cgroup_unavailable, own_cpu_cgroup

REPO = Path(__file__).resolve().parents[1]

DEMO_CONFIG = """\
[agent]
interval_s = 0.5
[checkpoint]
memory_every = 20
disk_every = 60
[recovery]
hang_floor_s = 20.0
[collectors]
gpu = true
"""

HEAL_KINDS = {
    "rank_exit", "job_restart", "restore_selected", "job_resumed", "hang_detected", "loss_diverged", "rollback",
    "straggler_detected", "straggler_cause", "straggler_recovered", "shard_migration", "rank_excluded", "controller_decision",
    "checkpoint_write_failed", "crash_loop", "oom_kill",
}

SLOW_RANK, KILL_RANK, NPROC = 2, 1, 4
GLOBAL_BATCH = 256
"""Per-sample work large against each step's fixed cost (optimizer, all-reduce, the loop), as in
real training: a throttled rank then gets faster when samples move off it. At 128 the throttled
rank's fixed cost alone held the step to ~3.5 steps/s and migration won back only a quarter to a
half of the loss (a CI run: 24%); at 256 about three quarters."""
SLICE_CPU = 0.45
"""Each rank's CPU slice: 4 ranks on this machine's 2 cores, with room left for the agent. Without
slices the scheduler shares the 2 cores among the 4 ranks unevenly for seconds at a time, and a
CI run saw a healthy rank that waited twice as long for a CPU as its peers flagged a straggler."""
QUOTA_CPU = 0.15
"""rank 2's slice once it is cut: a third of its peers', so it is ~3x slower."""
SLOW_AT = 40
"""First step under the quota (after the detector's warm-up and a healthy stretch to measure)."""
SETTLE_STEPS = 12
"""Steps after a change before its step rate counts (the plan applies, the windows refill)."""
REGAINED_MIN = 0.25
"""Share of the step rate lost to the quota that migration must win back for the verdict."""


def _wait(pred: Any, timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.1)
    return None


def _start_agent(state: Path) -> subprocess.Popen[bytes]:
    (state / "agent.toml").write_text(DEMO_CONFIG)
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    log = open(state / "agent.log", "wb")
    return subprocess.Popen(
        [sys.executable, "-m", "trainguard", "agent", "--state-dir", str(state), "--config", str(state / "agent.toml"),
         "--metrics-addr", "127.0.0.1:0"],
        stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env,
    )


def _steps(quick: bool) -> int:
    return 200 if quick else 320


def _job_spec(quick: bool, faults: list[str]) -> dict[str, Any]:
    # Function-local: keeps torch (the trainer config imports it) out of `trainguard --help`.
    from trainguard.trainer.config import config_from_cli

    trainer = config_from_cli(
        nproc=NPROC,
        steps=_steps(quick),
        faults=faults,
        overrides=["model.layers=2", "model.d_model=64", "model.context=64", f"global_batch={GLOBAL_BATCH}",
                   "data.max_bytes=4000000", "val_every=50"],
    )
    return {"job": "demo", "nproc": NPROC, "trainer": trainer, "faults": faults, "max_restarts": 3}


def _fmt_score(score: Any) -> str:
    return f"{score:.2f}" if isinstance(score, int | float) else "n/a"


def _describe(e: dict[str, Any]) -> str:
    stamp = time.strftime("%H:%M:%S", time.localtime(e["ts"]))
    cause = f"  (cause: {e['cause']})" if e.get("cause") else ""
    return f"  {stamp} {e['kind']:<20} {e['message']}{cause}"


@dataclass
class NodeLog:
    """What the node did and saw, for the verdict: (time, job step) samples and the moments that
    bound the phases the step rate is measured over."""

    samples: list[tuple[float, int]] = field(default_factory=list)
    slowed: tuple[float, int] | None = None
    killed: tuple[float, int] | None = None
    lines: list[str] = field(default_factory=list)
    ranks: list[dict[str, Any]] = field(default_factory=list)
    """The job's ranks as last seen while it ran with straggler scores (they go when it ends)."""
    kernel: dict[str, Any] | None = None
    error: str | None = None


class Node(threading.Thread):
    """Plays the node: throttles rank 2 (and its replacement after the restart), kills rank 1 once
    the migration has run a while, and samples the job's progress."""

    def __init__(self, client: Any, job: str, steps: int, throttle: bool) -> None:
        super().__init__(daemon=True, name="demo-node")
        self.client, self.job, self.steps = client, job, steps
        self.throttle = throttle
        self.log = NodeLog()
        self.slices: dict[int, CpuCgroup] = {}
        """rank -> its CPU slice (made inside the demo's own CPU cgroup: the ranks keep the share of
        the machine the demo was given)."""
        self.placed_pids: set[int] = set()
        self.cut = False
        self.migrated_at: int | None = None
        """Step of the agent's first shard migration, once seen."""
        self.done = threading.Event()

    def say(self, text: str) -> None:
        self.log.lines.append(f"  {time.strftime('%H:%M:%S')} node: {text}")

    def run(self) -> None:
        try:
            while not self.done.is_set():
                self._tick()
                self.done.wait(0.25)
        except Exception as exc:  # the demo's verdict reports it; the agent and job are not ours to crash
            self.log.error = f"{type(exc).__name__}: {exc}"

    def _tick(self) -> None:
        st = self.client.status()
        job = {j["job"]: j for j in st["jobs"]}.get(self.job)
        if job is None or job["state"] in ("succeeded", "failed", "stopped"):
            return
        ranks = {r["rank"]: r for r in job["ranks"]}
        steps = [r["telemetry"]["step"] for r in ranks.values() if r.get("telemetry")]
        if len(steps) < NPROC:
            return
        now, step = time.time(), min(steps)
        self.log.samples.append((now, step))
        if any("straggler_score" in (r.get("telemetry") or {}) for r in ranks.values()):
            self.log.ranks = [dict(r) for r in job["ranks"]]
        if any(k.startswith(f"{self.job} rank") for k in st.get("kernel", {}).get("runqueue", {})):
            self.log.kernel = st["kernel"]
        if not self.throttle and self.log.slowed is None and step >= SLOW_AT:
            self.log.slowed = (now, step)  # the trainer's own slow fault starts there
        if self.throttle:
            self._place(ranks, step)
        if self.throttle and not self.cut and step >= SLOW_AT - 1:
            self.slices[SLOW_RANK].quota(QUOTA_CPU)
            self.cut = True
            self.log.slowed = (now, step)
            self.say(f"rank {SLOW_RANK}'s CPU slice {self.slices[SLOW_RANK].path.name} cut from {SLICE_CPU} "
                     f"to {QUOTA_CPU} CPU, at step {step}")
        if self.log.killed is None and ranks.get(KILL_RANK) and self._kill_due(step):
            pid = ranks[KILL_RANK]["pid"]
            os.kill(pid, signal.SIGKILL)
            self.log.killed = (now, step)
            self.say(f"SIGKILL to rank {KILL_RANK} (pid {pid}) at step {step}")

    def _place(self, ranks: dict[int, Any], step: int) -> None:
        """Every rank's process into its rank's slice (a restarted rank's new process too)."""
        new = {r: info["pid"] for r, info in ranks.items() if info.get("pid") and info["pid"] not in self.placed_pids}
        if not new:
            return
        first = not self.slices
        for rank, pid in sorted(new.items()):
            if rank not in self.slices:
                self.slices[rank] = CpuCgroup("trainguard-demo", parent=own_cpu_cgroup())
                self.slices[rank].quota(SLICE_CPU)
            self.slices[rank].add(pid)
            self.placed_pids.add(pid)
        if first:
            self.say(f"ranks {sorted(new)} put in CPU slices of {SLICE_CPU} CPU each, at step {step}")
        else:
            self.say(f"ranks {sorted(new)} (new processes) back in their CPU slices, at step {step}")

    def _kill_due(self, step: int) -> bool:
        if self.migrated_at is None:
            migrated = self.client.events(since=0, limit=1000, kind="shard_migration")["events"]
            self.migrated_at = int(migrated[0]["fields"].get("step", step)) if migrated else None
        # Long enough after the migration to measure its step rate; never later than 3/4 of the run.
        return (self.migrated_at is not None and step - self.migrated_at >= 4 * SETTLE_STEPS) \
            or step >= 3 * self.steps // 4

    def close(self) -> None:
        self.done.set()
        self.join(10)
        for group in self.slices.values():
            group.remove()


def _rate(samples: list[tuple[float, int]], lo: int, hi: int, before: float = math.inf) -> float:
    """Job steps per second between steps ``lo`` and ``hi`` from the node's samples taken before
    ``before`` (a restart goes back to a checkpoint's step), NaN when unmeasured."""
    inside = [(t, s) for t, s in samples if lo <= s <= hi and t < before]
    if len(inside) < 2 or inside[-1][1] - inside[0][1] < 3:
        return float("nan")
    (t0, s0), (t1, s1) = inside[0], inside[-1]
    return (s1 - s0) / (t1 - t0) if t1 > t0 else float("nan")


@dataclass
class Verdict:
    checks: list[tuple[str, bool, str]] = field(default_factory=list)

    def check(self, name: str, ok: bool, detail: str) -> None:
        self.checks.append((name, ok, detail))

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(ok for _, ok, _ in self.checks)


def _judge(client: Any, job: str, node: Node, cause_expected: str | None, out: Any) -> Verdict:
    info = client.job(job)
    events = [e for e in client.events(since=0, limit=10000)["events"] if e.get("job") in (job, None)]
    log = node.log
    v = Verdict()
    resumed = [e for e in events if e["kind"] == "job_resumed"]
    v.check("kill healed", info["state"] == "succeeded" and bool(resumed) and log.killed is not None,
            f"job {info['state']}, resumed {len(resumed)}x" +
            (f", last from {resumed[-1]['fields'].get('restored_from')} in "
             f"{resumed[-1]['fields'].get('recovery_s', float('nan')):.2f}s" if resumed else ""))
    found = [e for e in events if e["kind"] == "straggler_detected" and e.get("rank") == SLOW_RANK]
    blamed = [e for e in events if e["kind"] == "straggler_detected" and e.get("rank") != SLOW_RANK]
    wrong = sorted({e.get("rank") for e in blamed})
    detail = f"rank {SLOW_RANK}: {'cause ' + str(found[0].get('cause')) if found else 'not detected'}"
    if wrong:
        detail += f"; also blamed: ranks {wrong} ({'; '.join(_why_blamed(e) for e in blamed)})"
    ok = bool(found) and not wrong and (cause_expected is None or found[0].get("cause") == cause_expected)
    v.check("straggler found" + (f" with cause {cause_expected}" if cause_expected else " (cause not checked)"), ok, detail)
    migrations = [e for e in events if e["kind"] == "shard_migration"]
    sizes: list[int] = migrations[0]["fields"].get("batch_sizes") or [] if migrations else []
    off = bool(sizes) and sizes[SLOW_RANK] < min(s for r, s in enumerate(sizes) if r != SLOW_RANK)
    v.check("samples migrated off it", off, f"batch shares {sizes}" if sizes else "no migration")
    # Across the restart: the plan the job ended with still gives rank 2 the smallest share.
    after = [e for e in migrations if log.killed is not None and e["ts"] > log.killed[0]]
    undone = [e for e in after if e["fields"].get("action") == "undo"]
    recovered = [e for e in events if e["kind"] == "straggler_recovered" and e.get("rank") == SLOW_RANK
                 and log.killed is not None and e["ts"] > log.killed[0]]
    v.check("migration kept across the restart", off and not undone and not recovered,
            "undone after the restart" if undone or recovered else "kept")
    if log.slowed is not None:
        slow_step = log.slowed[1]
        first_mig = int(migrations[0]["fields"].get("step", 0)) if migrations else None
        kill_t, kill_step = log.killed if log.killed else (math.inf, log.samples[-1][1])
        healthy = _rate(log.samples, 10, slow_step)
        slowed = _rate(log.samples, slow_step + 3, first_mig) if first_mig else math.nan
        healed = _rate(log.samples, first_mig + SETTLE_STEPS, kill_step, kill_t) if first_mig else math.nan
        regained = (healed - slowed) / (healthy - slowed) if healthy > slowed else float("nan")
        v.check("step rate regained", regained >= REGAINED_MIN,
                f"healthy {healthy:.2f} steps/s, throttled {slowed:.2f}, migrated {healed:.2f}: "
                f"{100 * regained:.0f}% of the loss won back (needs {100 * REGAINED_MIN:.0f}%)")
    if log.error:
        v.check("node script ran", False, log.error)
    return v


def _why_blamed(e: dict[str, Any]) -> str:
    """What the detector saw when it flagged a rank: enough to tell noise from a real slowdown."""
    f = e.get("fields", {})

    def ms(key: str) -> str:
        v = f.get(key)
        return f"{1000 * v:.2f} ms" if isinstance(v, int | float) else "n/a"

    return (f"rank {e.get('rank')} at step {f.get('step')}: score {f.get('score')}, cause {e.get('cause')}, "
            f"{ms('per_sample_s')}/sample vs fastest {ms('fastest_per_sample_s')}, "
            f"run delay {ms('run_delay_s')}/step")


def _summary(client: Any, job: str, started: float, node: Node, out: Any) -> None:
    info = client.job(job)
    events = client.events(since=0, limit=10000)["events"]
    print("\n=== summary ===", file=out)
    print(f"job {job}: {info['state']} at step {info['progress_step']} in {time.time() - started:.0f}s, "
          f"{info['restarts']} restart(s), {info['nproc']} ranks", file=out)
    print("  ranks as last seen while training:", file=out)
    for r in sorted(node.log.ranks, key=lambda r: r["rank"]):
        tel = r.get("telemetry") or {}
        tps = tel.get("tokens_per_s")
        cause = tel.get("straggler_cause")
        print(f"  rank {r['rank']}: {tps if tps is None else round(tps):>7} tokens/s  batch {tel.get('batch_size')}  "
              f"median compute {1000 * (tel.get('median_compute_s') or 0):.0f} ms/step  "
              f"straggler score {_fmt_score(tel.get('straggler_score'))}"
              f"{'  ' + str(tel.get('straggler_state')) if tel.get('straggler_state') else ''}"
              f"{'  cause ' + str(cause) if cause else ''}", file=out)
    runq = (node.log.kernel or {}).get("runqueue", {})
    if runq:
        from trainguard.agent.collectors.ebpf.hist import log2_quantile

        print("  kernel (eBPF) run-queue latency, cumulative:", file=out)
        for name, h in sorted(runq.items()):
            if name == "node" or name.startswith(f"{job} rank"):
                n = sum(h["slots"])
                print(f"    {name:<14} p50 {1e6 * log2_quantile(h['slots'], 0.5):8.0f} us  p99 "
                      f"{1e6 * log2_quantile(h['slots'], 0.99):8.0f} us  ({n} waits)", file=out)
    for e in events:
        if e["kind"] == "straggler_detected":
            print(f"  straggler: rank {e.get('rank')} cause {e.get('cause')} ({e['message']})", file=out)
    migr = [e for e in events if e["kind"] == "shard_migration"]
    if migr:
        print(f"  shard migrations: {len(migr)}; last: {migr[-1]['message']}", file=out)
    ckpts = [c for c in client.checkpoints(job) if "step" in c]
    by_tier: dict[str, list[int]] = {}
    for c in ckpts:
        by_tier.setdefault(c["tier"], []).append(c["step"])
    for tier, steps in sorted(by_tier.items()):
        print(f"  checkpoints in {tier:<6}: steps {sorted(steps)}", file=out)
    kinds = Counter(e["kind"] for e in events if e["kind"] in HEAL_KINDS)
    print("  events: " + ", ".join(f"{k} x{n}" for k, n in sorted(kinds.items())), file=out)


def run_demo(tui: bool = False, quick: bool = False, out: Any = None, keep: bool = False) -> int:
    # Function-local: the API client is only needed once the demo runs.
    from trainguard.agent.api.client import ApiClient

    out = out or sys.stdout
    state = Path(tempfile.mkdtemp(prefix="trainguard-demo-"))
    print(f"trainguard demo: agent state in {state}", file=out)
    print(f"  watch live from another terminal:  .venv/bin/trainguard top --state-dir {state}", file=out)
    agent = _start_agent(state)
    sock = state / "run" / "agent.sock"
    node: Node | None = None
    try:
        if not _wait(lambda: sock.exists() or agent.poll() is not None, 60) or agent.poll() is not None:
            print((state / "agent.log").read_text(errors="replace"), file=out)
            print("trainguard demo: the agent did not start", file=out)
            return 1
        client = ApiClient.local(str(sock), timeout=30)
        st = client.status()
        for name, c in sorted(st["collectors"].items()):
            print(f"  collector {name:<5} {'up' if c['up'] else 'off: ' + str(c['reason'])}", file=out)
        no_cgroup = cpu_cgroup_unavailable()
        faults: list[str] = []
        if no_cgroup:
            faults = [f"slow:rank={SLOW_RANK},factor=2.5,step={SLOW_AT}"]
            print(f"  no node-level cause here ({no_cgroup}): the trainer's own slow fault stands in, "
                  "and the cause is not checked", file=out)
        spec = _job_spec(quick, faults)
        steps = spec["trainer"]["steps"]
        print(f"submitting job 'demo': {NPROC} ranks (dp={NPROC}), {steps} steps; the node will cut rank "
              f"{SLOW_RANK}'s CPU slice from step {SLOW_AT} and SIGKILL rank {KILL_RANK} after the migration", file=out)
        started = time.time()
        job = client.submit_job(spec)
        node = Node(ApiClient.local(str(sock), timeout=30), job, steps, throttle=not no_cgroup)
        node.start()
        if tui:
            import argparse

            from trainguard.tui.app import run_dashboard

            run_dashboard(argparse.Namespace(state_dir=str(state), agent=None, token_file=None, json=False))
        _follow(client, job, node, out)
        node.close()
        _summary(client, job, started, node, out)
        verdict = _judge(client, job, node, None if no_cgroup else "cpu_quota", out)
        print("\n=== verdict ===", file=out)
        for name, ok, detail in verdict.checks:
            print(f"  [{'ok' if ok else 'FAILED'}] {name}: {detail}", file=out)
        print(f"demo {'passed' if verdict.passed else 'FAILED'}", file=out)
        return 0 if verdict.passed else 1
    finally:
        if node is not None:
            node.close()
        agent.send_signal(signal.SIGTERM)
        try:
            agent.wait(30)
        except subprocess.TimeoutExpired:
            agent.kill()
        if not keep and not tui:
            shutil.rmtree(state, ignore_errors=True)


def _follow(client: Any, job: str, node: Node, out: Any) -> None:
    """Live output until the job ends: the agent's heal events, the node's actions, progress."""
    seen, shown, last_line = 0, 0, 0.0
    while True:
        info = client.job(job)
        batch = client.events(since=seen, limit=1000)
        for e in batch["events"]:
            if e["kind"] in HEAL_KINDS and (e["severity"] != "info" or e["kind"] != "rank_exit"):
                print(_describe(e), file=out, flush=True)
        seen = batch["next"]
        for line in node.log.lines[shown:]:
            print(line, file=out, flush=True)
        shown = len(node.log.lines)
        if info["state"] in ("succeeded", "failed", "stopped"):
            return
        if time.monotonic() - last_line > 5 and node.log.samples:
            t, step = node.log.samples[-1]
            recent = [s for s in node.log.samples if s[0] >= t - 5]
            rate = (step - recent[0][1]) / (t - recent[0][0]) if t > recent[0][0] else 0.0
            print(f"  ... {info['state']}, step {step}, {rate:.1f} steps/s", file=out, flush=True)
            last_line = time.monotonic()
        time.sleep(0.5)
