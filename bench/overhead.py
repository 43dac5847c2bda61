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

from trainguard.agent.collectors.ebpf import bpfstats  # noqa: E402

STORM_C = r"""
#define _GNU_SOURCE
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/resource.h>
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
    struct rusage me, kid; getrusage(RUSAGE_SELF, &me); getrusage(RUSAGE_CHILDREN, &kid);
    double cpu = me.ru_utime.tv_sec + me.ru_stime.tv_sec + kid.ru_utime.tv_sec + kid.ru_stime.tv_sec
        + 1e-6 * (me.ru_utime.tv_usec + me.ru_stime.tv_usec + kid.ru_utime.tv_usec + kid.ru_stime.tv_usec);
    printf("%.1f %.1f\n", n / (t - t0), n / cpu);
    return 0;
}
"""

PY_STORM = """import os, resource, sys, time
secs, cpu = float(sys.argv[1]), int(sys.argv[2])
os.sched_setaffinity(0, {cpu})
a, b = os.pipe(), os.pipe()
pid = os.fork()
if pid == 0:
    while True:
        os.write(b[1], os.read(a[0], 1))
n, t0 = 0, time.monotonic()
while time.monotonic() - t0 < secs:
    for _ in range(1000):
        os.write(a[1], b"x"); os.read(b[0], 1)
    n += 1000
wall = time.monotonic() - t0
os.kill(pid, 9)
os.waitpid(pid, 0)
me, kid = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
print(n / wall, n / (me.ru_utime + me.ru_stime + kid.ru_utime + kid.ru_stime))
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


def run_storm(cmd: list[str], seconds: float) -> tuple[float, float]:
    """(round trips per second, round trips per CPU-second the storm used), summed over one
    ping-pong pair per CPU. The second is robust to other load on the machine: the eBPF
    programs run in the storm's own context, so their cost lowers it, while CPU taken by
    unrelated processes does not."""
    cpus = sorted(os.sched_getaffinity(0))
    procs = [subprocess.Popen(cmd + [str(seconds), str(c)], stdout=subprocess.PIPE, text=True) for c in cpus]
    outs = [(p.communicate()[0].split() or ["0", "0"]) for p in procs]
    rate = sum(float(o[0]) for o in outs)
    per_cpu = statistics.mean(float(o[1]) for o in outs) * len(outs)
    return rate, per_cpu


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
        self.proc = subprocess.Popen([sys.executable, "-m", "trainguard", "agent", "--state-dir", str(state_dir),
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
    cmd = [sys.executable, "-m", "trainguard", "train", "--nproc", "4", "--steps", str(steps), "--json"]
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
class Figures:
    storm_on: list[float] = field(default_factory=list)
    storm_off: list[float] = field(default_factory=list)
    storm_cpu_on: list[float] = field(default_factory=list)  # round trips per storm CPU-second
    storm_cpu_off: list[float] = field(default_factory=list)
    beside: list[float] = field(default_factory=list)  # standalone job, agent running
    via: list[float] = field(default_factory=list)  # job launched by the agent, ranks tracked
    alone: list[float] = field(default_factory=list)  # standalone job, no agent
    cpu_train: list[float] = field(default_factory=list)
    cpu_storm: list[float] = field(default_factory=list)
    events_per_s: list[float] = field(default_factory=list)
    bpf_share: list[float] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def agent_block(i: int, work: Path, f: Figures, storm_cmd: list[str], storm_s: float, steps: int,
                warmup: int, train: bool, via: bool, stats: bool) -> None:
    """Everything measured with the agent up: storm, then the two job arms in alternating order."""
    sd = work / f"agent{i}"
    sd.mkdir()
    before = {p.prog_id for p in bpfstats.program_stats()} if stats else set()
    agent = Agent(sd)
    try:
        if not agent.ebpf_up and "ebpf down" not in f.notes:
            f.notes.append("ebpf down")
        s0 = new_programs(before) if stats else []
        c0, t0 = agent.cpu(), time.monotonic()
        srate, per_cpu = run_storm(storm_cmd, storm_s)
        f.storm_on.append(srate)
        f.storm_cpu_on.append(per_cpu)
        c1, t1 = agent.cpu(), time.monotonic()
        s1 = new_programs(before) if stats else []
        f.cpu_storm.append((c1 - c0) / (t1 - t0))
        if s1:
            f.events_per_s.append((sum(p.run_cnt for p in s1) - sum(p.run_cnt for p in s0)) / (t1 - t0))
            f.bpf_share.append((sum(p.run_time_ns for p in s1) - sum(p.run_time_ns for p in s0)) * 1e-9 / (t1 - t0))
        if not train:
            return
        arms = ("beside", "via") if via else ("beside",)
        for arm in (arms if i % 2 == 0 else arms[::-1]):
            c0, t0 = agent.cpu(), time.monotonic()
            rate, err = run_job(steps, warmup, sd if arm == "via" else None)
            if rate is None:
                if arm == "beside":
                    raise SystemExit(f"standalone job beside the agent failed: {err}")
                note = f"job through the agent failed ({err})"
                if note not in f.notes:
                    f.notes.append(note)
                continue
            f.cpu_train.append((agent.cpu() - c0) / (time.monotonic() - t0))
            (f.via if arm == "via" else f.beside).append(rate)
    finally:
        agent.stop()  # stops whatever it launched (on_stop=stop_ranks)


def machine_load() -> str:
    """Load average and CPU pressure: other work on the machine skews wall-clock ratios."""
    text = f"load average {os.getloadavg()[0]:.1f}"
    try:
        some = Path("/proc/pressure/cpu").read_text().split("\n")[0]
        text += ", CPU pressure " + some.split()[1].replace("=", " ")
    except (OSError, IndexError):
        pass
    return text


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def ratio(on: list[float], off: list[float]) -> float:
    return med([a / b for a, b in zip(on, off, strict=False)])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="2 pairs, 12 steps, 3 s storms, no agent-launched arm (< 2 min on an idle machine)")
    ap.add_argument("--pairs", type=int)
    ap.add_argument("--steps", type=int)
    ap.add_argument("--storm-s", type=float)
    ap.add_argument("--no-train", action="store_true", help="storm only")
    args = ap.parse_args()
    pairs = args.pairs or (2 if args.quick else 5)
    steps = args.steps or (12 if args.quick else 60)
    storm_s = args.storm_s or (3.0 if args.quick else 10.0)
    warmup = min(5, steps // 4)
    train = not args.no_train
    if os.geteuid() != 0:
        print("note: not root: the agent runs without eBPF; kernel events cannot be counted")

    work = Path(tempfile.mkdtemp(prefix="tg-overhead-"))
    storm_cmd, storm_kind = build_storm(work)
    stats_fd = None
    try:
        stats_fd = bpfstats.enable_stats()
    except OSError as exc:
        print(f"note: BPF run-time stats unavailable ({exc.strerror}): kernel events not counted")
    f = Figures()
    try:
        for i in range(pairs):
            for mode in (("on", "off") if i % 2 == 0 else ("off", "on")):
                if mode == "on":
                    agent_block(i, work, f, storm_cmd, storm_s, steps, warmup, train, not args.quick,
                                stats_fd is not None)
                    continue
                srate, per_cpu = run_storm(storm_cmd, storm_s)
                f.storm_off.append(srate)
                f.storm_cpu_off.append(per_cpu)
                if train:
                    rate, err = run_job(steps, warmup, None)
                    if rate is None:
                        raise SystemExit(f"baseline job failed: {err}")
                    f.alone.append(rate)
            print(f"pair {i + 1}/{pairs} done", flush=True)
    finally:
        if stats_fd is not None:
            os.close(stats_fd)
        shutil.rmtree(work, ignore_errors=True)

    storm_ratio = ratio(f.storm_on, f.storm_off)
    storm_cpu_ratio = ratio(f.storm_cpu_on, f.storm_cpu_off)
    beside_ratio = ratio(f.beside, f.alone)
    via_ratio = ratio(f.via, f.alone)
    print()
    print(f"{'':40}{'agent on':>12}{'no agent':>12}{'ratio':>9}")
    if train:
        print(f"{'job tokens/s, standalone (same launch)':40}{med(f.beside):12.1f}{med(f.alone):12.1f}{beside_ratio:9.4f}")
        if f.via:
            print(f"{'job tokens/s, launched by the agent':40}{med(f.via):12.1f}{med(f.alone):12.1f}{via_ratio:9.4f}")
    print(f"{'storm round trips/s':40}{med(f.storm_on):12.0f}{med(f.storm_off):12.0f}{storm_ratio:9.4f}")
    print(f"{'storm round trips per storm CPU-s':40}{med(f.storm_cpu_on):12.0f}{med(f.storm_cpu_off):12.0f}"
          f"{storm_cpu_ratio:9.4f}")
    if train:
        print(f"{'agent CPU share during jobs (1 s)':40}{med(f.cpu_train):12.4f}{'-':>12}")
    print(f"{'agent CPU share during storm (1 s)':40}{med(f.cpu_storm):12.4f}{'-':>12}")
    print(f"{'eBPF program runs/s during storm':40}{med(f.events_per_s):12.0f}{'-':>12}")
    print(f"{'eBPF kernel time during storm (cores)':40}{med(f.bpf_share):12.4f}{'-':>12}")
    print(f"\n{pairs} alternating pairs (medians of per-pair ratios); job: 4 ranks x {steps} steps, median "
          f"tokens/s after step {warmup}; storm: {storm_kind}, {storm_s:g} s, one pair per CPU, "
          f"{os.cpu_count()} CPUs; {machine_load()} at the end")
    if train:
        print("throughput_ratio: the same standalone job with the agent (all collectors, eBPF attached, "
              "1 s interval) running vs not"
              + ("; the job launched by the agent also has its ranks tracked, but its launcher differs "
                 "from --standalone, so that row mixes in launch-path effects" if f.via else
                 " (--quick skips the agent-launched arm)"))
    else:
        print("no training job (--no-train): throughput_ratio below is the storm's rate ratio")
    for note in f.notes:
        print("note: " + ("eBPF collector was DOWN in the agent (see its log)" if note == "ebpf down" else note))
    headline = beside_ratio if train else storm_ratio
    share = med(f.cpu_train) if train else med(f.cpu_storm)
    print(f"RESULT throughput_ratio={headline:.4f} agent_cpu_share={share:.4f} "
          f"kernel_events_per_s={med(f.events_per_s):.0f} storm_throughput_ratio={storm_ratio:.4f} "
          f"storm_cpu_efficiency_ratio={storm_cpu_ratio:.4f} ebpf_kernel_cpu_share={med(f.bpf_share):.4f}"
          + (f" agent_launch_throughput_ratio={via_ratio:.4f}" if f.via else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
