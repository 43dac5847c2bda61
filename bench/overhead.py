#!/usr/bin/env python3
"""What the agent costs: training throughput, agent CPU, and kernel-side eBPF work under a storm.

In one run, alternating pairs (on/off, then off/on, to cancel drift):
  * a 4-rank training job with the agent (all collectors, 1 s interval) running, against the same
    job with no agent: median tokens/s after warm-up, ratio per pair, median of the ratios;
  * the agent's CPU share (of one core) while the job runs;
  * a context-switch storm (pairs of processes ping-ponging one byte over pipes, one pair per
    CPU) with the agent's eBPF programs attached and not: the storm's rate ratio, and the kernel
    events the programs aggregated per second (program runs counted by the kernel's BPF stats).

The job goes through the agent (`trainguard train --state-dir`) when the agent can launch it, so
its ranks are tracked; otherwise it runs standalone beside the agent (node-wide programs still
see every switch, the per-rank paths do not run) and the output says so.

    python bench/overhead.py [--quick] [--pairs N] [--steps N] [--storm-s S]
Needs root for eBPF; ends with `RESULT throughput_ratio=... agent_cpu_share=... kernel_events_per_s=...`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from agent.collectors.ebpf import bpfstats  # noqa: E402

STORM_C = r"""
#define _GNU_SOURCE
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
int main(int argc, char **argv) {
    double secs = atof(argv[1]);
    cpu_set_t set; CPU_ZERO(&set); CPU_SET(atoi(argv[2]), &set); sched_setaffinity(0, sizeof set, &set);
    int a[2], b[2];
    if (pipe(a) || pipe(b)) return 1;
    pid_t child = fork();
    if (child == 0) {
        char x;
        for (;;) { if (read(a[0], &x, 1) != 1 || write(b[1], &x, 1) != 1) _exit(0); }
    }
    char x = 'x'; long n = 0; double t0 = now(), t;
    do {
        for (int i = 0; i < 1000; i++) { if (write(a[1], &x, 1) != 1 || read(b[0], &x, 1) != 1) return 1; }
        n += 1000; t = now();
    } while (t - t0 < secs);
    kill(child, SIGKILL); waitpid(child, 0, 0);
    printf("%.1f\n", n / (t - t0));
    return 0;
}
"""

PY_STORM = """import os, sys, time
secs, cpu = float(sys.argv[1]), int(sys.argv[2])
os.sched_setaffinity(0, {cpu})
a, b = os.pipe(), os.pipe()
if os.fork() == 0:
    while True:
        os.write(b[1], os.read(a[0], 1))
n, t0 = 0, time.monotonic()
while time.monotonic() - t0 < secs:
    for _ in range(1000):
        os.write(a[1], b"x"); os.read(b[0], 1)
    n += 1000
print(n / (time.monotonic() - t0))
os._exit(0)
"""


def build_storm(workdir: Path) -> tuple[list[str], str]:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc:
        src, exe = workdir / "storm.c", workdir / "storm"
        src.write_text(STORM_C)
        if subprocess.run([cc, "-O2", "-o", str(exe), str(src)], capture_output=True).returncode == 0:
            return [str(exe)], "C pipe ping-pong"
    return [sys.executable, "-c", PY_STORM], "Python pipe ping-pong (no C compiler)"


def run_storm(cmd: list[str], seconds: float) -> float:
    """Round trips per second, summed over one ping-pong pair per CPU."""
    cpus = sorted(os.sched_getaffinity(0))
    procs = [subprocess.Popen(cmd + [str(seconds), str(c)], stdout=subprocess.PIPE, text=True) for c in cpus]
    return sum(float(p.communicate()[0].strip() or 0) for p in procs)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def env() -> dict[str, str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = str(REPO)
    return e


class Agent:
    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        self.log = open(state_dir / "agent.log", "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen([sys.executable, "-m", "agent.cli", "agent", "--state-dir", str(state_dir),
                                      "--metrics-addr", "127.0.0.1:0"], cwd=REPO, env=env(),
                                     stdout=self.log, stderr=subprocess.STDOUT)
        self.ebpf_up, self.metrics_url = False, ""
        addr = state_dir / "run" / "metrics.addr"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and self.proc.poll() is None:
            if addr.exists() and (state_dir / "run" / "agent.sock").exists():
                port = addr.read_text().strip().rsplit(":", 1)[1]
                self.metrics_url = f"http://127.0.0.1:{port}/metrics"
                text = urllib.request.urlopen(self.metrics_url, timeout=5).read().decode()
                self.ebpf_up = 'trainguard_collector_up{collector="ebpf"} 1.0' in text
                return
            time.sleep(0.1)
        raise RuntimeError(f"agent did not come up: {(state_dir / 'agent.log').read_text()[-2000:]}")

    def cpu(self) -> float:
        return cpu_seconds(self.proc.pid)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def tokens_per_s(lines: list[str], warmup: int) -> float | None:
    rates = []
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and "tokens_per_s" in rec and rec.get("step", 0) > warmup:
            rates.append(float(rec["tokens_per_s"]))
    return statistics.median(rates) if rates else None


def run_job(steps: int, warmup: int, state_dir: Path | None) -> tuple[float | None, str]:
    cmd = [sys.executable, "-m", "agent.cli", "train", "--nproc", "4", "--steps", str(steps), "--json"]
    cmd += ["--state-dir", str(state_dir)] if state_dir else ["--standalone"]
    p = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=900)
    rate = tokens_per_s(p.stdout.splitlines(), warmup)
    if p.returncode != 0 or rate is None:
        tail = (p.stderr.strip().splitlines() or ["no output"])[-1]
        return None, f"rc={p.returncode}: {tail[:160]}"
    return rate, ""


def new_programs(before: set[int]) -> list[bpfstats.ProgStats]:
    """The agent's programs: loaded after it started (other tests may have their own loaded)."""
    return [p for p in bpfstats.program_stats() if p.prog_id not in before]


@dataclass
class Side:
    storm: list[float] = field(default_factory=list)
    train: list[float] = field(default_factory=list)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="2 pairs, 20 steps, 4 s storms (< 2 min)")
    ap.add_argument("--pairs", type=int)
    ap.add_argument("--steps", type=int)
    ap.add_argument("--storm-s", type=float)
    ap.add_argument("--no-train", action="store_true", help="storm only")
    args = ap.parse_args()
    pairs = args.pairs or (2 if args.quick else 5)
    steps = args.steps or (20 if args.quick else 60)
    storm_s = args.storm_s or (4.0 if args.quick else 10.0)
    warmup = min(5, steps // 4)
    if os.geteuid() != 0:
        print("note: not root: the agent runs without eBPF; kernel events cannot be counted")

    work = Path(tempfile.mkdtemp(prefix="tg-overhead-"))
    storm_cmd, storm_kind = build_storm(work)
    stats_fd = None
    try:
        stats_fd = bpfstats.enable_stats()
    except OSError as exc:
        print(f"note: BPF run-time stats unavailable ({exc.strerror}): kernel events not counted")
    on, off = Side(), Side()
    agent_cpu_train, agent_cpu_storm, events_per_s, bpf_share = [], [], [], []
    via_agent, job_note, ebpf_note = True, "", ""
    try:
        for i in range(pairs):
            for mode in (("on", "off") if i % 2 == 0 else ("off", "on")):
                if mode == "off":
                    off.storm.append(run_storm(storm_cmd, storm_s))
                    if not args.no_train:
                        rate, err = run_job(steps, warmup, None)
                        if rate is None:
                            raise SystemExit(f"baseline job failed: {err}")
                        off.train.append(rate)
                    continue
                sd = work / f"agent{i}"
                sd.mkdir()
                before = {p.prog_id for p in bpfstats.program_stats()} if stats_fd is not None else set()
                agent = Agent(sd)
                try:
                    if not agent.ebpf_up:
                        ebpf_note = "eBPF collector was DOWN in the agent (see its log)"
                    s0 = new_programs(before) if stats_fd is not None else []
                    c0, t0 = agent.cpu(), time.monotonic()
                    on.storm.append(run_storm(storm_cmd, storm_s))
                    c1, t1 = agent.cpu(), time.monotonic()
                    s1 = new_programs(before) if stats_fd is not None else []
                    agent_cpu_storm.append((c1 - c0) / (t1 - t0))
                    if s1:
                        runs = sum(p.run_cnt for p in s1) - sum(p.run_cnt for p in s0)
                        ns = sum(p.run_time_ns for p in s1) - sum(p.run_time_ns for p in s0)
                        events_per_s.append(runs / (t1 - t0))
                        bpf_share.append(ns * 1e-9 / (t1 - t0))
                    if not args.no_train:
                        c0, t0 = agent.cpu(), time.monotonic()
                        rate, err = run_job(steps, warmup, sd if via_agent else None)
                        if rate is None and via_agent:
                            via_agent = False
                            job_note = f"job through the agent failed ({err}); ran standalone beside it"
                            agent.stop()  # stops whatever it launched (on_stop=stop_ranks)
                            sd = work / f"agent{i}-fresh"
                            sd.mkdir()
                            agent = Agent(sd)
                            c0, t0 = agent.cpu(), time.monotonic()
                            rate, err = run_job(steps, warmup, None)
                        if rate is None:
                            raise SystemExit(f"job with agent failed: {err}")
                        agent_cpu_train.append((agent.cpu() - c0) / (time.monotonic() - t0))
                        on.train.append(rate)
                finally:
                    agent.stop()
                print(f"pair {i + 1}/{pairs} done", flush=True)
    finally:
        if stats_fd is not None:
            os.close(stats_fd)
        shutil.rmtree(work, ignore_errors=True)

    def med(xs: list[float]) -> float:
        return statistics.median(xs) if xs else float("nan")

    storm_ratio = med([a / b for a, b in zip(on.storm, off.storm, strict=True)])
    train_ratio = med([a / b for a, b in zip(on.train, off.train, strict=True)]) if on.train else float("nan")
    print()
    print(f"{'':34}{'agent on':>14}{'no agent':>14}{'ratio':>9}")
    if on.train:
        print(f"{'training tokens/s (median)':34}{med(on.train):14.1f}{med(off.train):14.1f}{train_ratio:9.4f}")
    print(f"{'storm round trips/s (median)':34}{med(on.storm):14.0f}{med(off.storm):14.0f}{storm_ratio:9.4f}")
    if on.train:
        print(f"{'agent CPU share, training (1 s)':34}{med(agent_cpu_train):14.4f}{'-':>14}")
    print(f"{'agent CPU share, storm (1 s)':34}{med(agent_cpu_storm):14.4f}{'-':>14}")
    print(f"{'eBPF program runs/s, storm':34}{med(events_per_s):14.0f}{'-':>14}")
    print(f"{'eBPF kernel time, storm (cores)':34}{med(bpf_share):14.4f}{'-':>14}")
    print(f"\n{pairs} alternating pairs; job: 4 ranks x {steps} steps (median tokens/s after step {warmup}); "
          f"storm: {storm_kind}, {storm_s:g} s, one pair per CPU")
    if on.train:
        print("job: " + ("through the agent (ranks tracked)" if via_agent else job_note))
    else:
        print("no training job (--no-train): throughput_ratio below is the storm's rate ratio")
    if ebpf_note:
        print("note: " + ebpf_note)
    headline = train_ratio if on.train else storm_ratio
    share = med(agent_cpu_train) if on.train else med(agent_cpu_storm)
    print(f"RESULT throughput_ratio={headline:.4f} agent_cpu_share={share:.4f} "
          f"kernel_events_per_s={med(events_per_s):.0f} storm_throughput_ratio={storm_ratio:.4f} "
          f"ebpf_kernel_cpu_share={med(bpf_share):.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
