"""Your own script under trainguard vs under torchrun: lost time per failure and API overhead.

One small DDP job (``examples/``: a 2-layer MLP regression, gloo, 2 ranks), the same steps, the same
checkpoint interval K, the same kills sent from outside (SIGKILL of rank 1 at seeded random steps):

(a) torchrun --max-restarts, the tutorial script ``ddp_plain.py`` saving its own ``torch.save``
    checkpoint to disk every K steps and resuming from it (with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``,
    which gloo restarts need, monitor interval 0.1 s);
(b) ``trainguard run`` with the agent, the same script with the Python API (``ddp_api.py``): memory
    tier every K steps, the agent's warm restart.

Lost time per failure = from the kill until training is back at the step it was killed at
(detection + restart + restore + recomputing the steps since the last checkpoint; a resume at the
killed step itself counts until its first step is done), read from the script's own step counter and
start record; measured, never modelled. Overhead: steps/s of ``ddp_api.py`` (telemetry,
plan sync, snapshots, memory checkpoints every K) over ``ddp_plain.py`` without checkpoints, both
under ``trainguard run`` with no faults, alternating runs: the median over rounds of each round's
own ratio (the arms of one round run back to back), with the rounds' lowest and highest. Beside it
(not the headline): the same API arm over ``ddp_plain.py`` saving its own ``torch.save`` every K
steps, as arm (a) does -- what adopting the API costs a script that checkpoints already.

    python bench/integration.py [--quick] [--width W --steps N --rounds R]
"""

from __future__ import annotations

import argparse
import math
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from trainguard.agent.lifecycle.launcher import free_port  # noqa: E402
from trainguard.agent.recovery.service import default_memory_root  # noqa: E402

PLAIN = str(REPO / "examples" / "ddp_plain.py")
API = str(REPO / "examples" / "ddp_api.py")


@dataclass
class Failure:
    kill_step: int
    kill_ts: float
    restored_step: int = -1
    back_ts: float = float("nan")

    @property
    def lost_s(self) -> float:
        return self.back_ts - self.kill_ts


@dataclass
class Arm:
    name: str
    failures: list[Failure] = field(default_factory=list)
    wall_s: float = 0.0
    rc: int | None = None
    marks: list[tuple[float, int]] = field(default_factory=list)
    """(time, steps done) whenever rank 0's count changed."""

    def steps_per_s(self, after: int) -> float:
        """Training rate after step ``after`` (start-up excluded), to the last step seen."""
        later = [(t, s) for t, s in self.marks if s >= after]
        if len(later) < 2 or later[-1][0] <= later[0][0]:
            return float("nan")
        return (later[-1][1] - later[0][1]) / (later[-1][0] - later[0][0])

    @property
    def lost_per_failure(self) -> float:
        done = [f.lost_s for f in self.failures if f.back_ts == f.back_ts]
        return statistics.mean(done) if done else float("nan")


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
        return int(text) if text else None
    except (OSError, ValueError):
        return None


def _read_started(path: Path) -> tuple[int, int] | None:
    """(start step, pid) of the running rank 0, as the script records it when it starts."""
    try:
        start, pid = path.read_text().split()
        return int(start), int(pid)
    except (OSError, ValueError):
        return None


def drive(name: str, cmd: list[str], env: dict[str, str], progress: Path, kills: list[int], cwd: Path,
          timeout_s: float) -> Arm:
    """Run ``cmd``; SIGKILL rank 1 when rank 0 has done each step in ``kills``; time the way back."""
    arm = Arm(name)
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    pending = list(kills)
    current: Failure | None = None
    killed_pid = -1
    started_before: tuple[int, int] | None = None
    try:
        while proc.poll() is None and time.monotonic() - t0 < timeout_s:
            step = _read_int(progress / "step")
            pid = _read_int(progress / "rank1.pid")
            started = _read_started(progress / "started")
            now = time.monotonic()
            if step is not None and (not arm.marks or arm.marks[-1][1] != step):
                arm.marks.append((now, step))
            if current is not None and started is not None and started != started_before:
                # A new rank 0 recorded its start: that is where the job resumed, even when no step
                # was lost and the step count never went back.
                current.restored_step = started[0]
            if current is not None and pid is not None and pid != killed_pid and step is not None:
                # At least one step done by the new processes: a resume at the killed step itself
                # counts until that step is done (its first step pays the warm-up).
                if current.restored_step >= 0 and step >= current.kill_step and step > current.restored_step:
                    current.back_ts = now
                    arm.failures.append(current)
                    current = None
            if current is None and pending and step is not None and step >= pending[0] and pid is not None:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    time.sleep(0.005)
                    continue
                current = Failure(step, now)
                killed_pid = pid
                started_before = started
                pending.pop(0)
            time.sleep(0.005)
        proc.wait(max(1.0, timeout_s - (time.monotonic() - t0)))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if current is not None:
        arm.failures.append(current)
    arm.rc = proc.returncode
    arm.wall_s = time.monotonic() - t0
    return arm


class Agent:
    def __init__(self, state: Path, memory_every: int) -> None:
        state.mkdir(parents=True, exist_ok=True)
        (state / "agent.toml").write_text(f"[agent]\ninterval_s = 0.5\n[collectors]\ngpu = false\n"
                                          f"[checkpoint]\nmemory_every = {memory_every}\n")
        self.state = state
        self.proc = subprocess.Popen([sys.executable, "-m", "trainguard", "agent", "--state-dir", str(state),
                                      "--config", str(state / "agent.toml"), "--metrics-addr", ""],
                                     stdout=open(state / "agent.log", "wb"), stderr=subprocess.STDOUT, cwd=REPO,
                                     env={**os.environ, "PYTHONPATH": str(REPO)})
        deadline = time.monotonic() + 60
        while not (state / "run" / "agent.json").exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError((state / "agent.log").read_text())
            time.sleep(0.05)

    def run_cmd(self, job: str, *script: str) -> list[str]:
        return [sys.executable, "-m", "trainguard", "run", "--state-dir", str(self.state), "--nproc", "2",
                "--job", job, "--max-restarts", "10", "--", sys.executable, *script]

    def close(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        # An agent keeps its memory tier in RAM across its own restarts; this one is done with it.
        shutil.rmtree(default_memory_root(str(self.state)), ignore_errors=True)


def fresh(path: Path) -> Path:
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def median_interval(values: list[float], coverage: float = 0.9) -> tuple[float, float]:
    """A distribution-free interval for the median of what ``values`` sample: the order statistics
    x(k) and x(n+1-k) with the largest k whose binomial coverage is at least ``coverage`` (for nine
    rounds, the 2nd lowest and 2nd highest: 96 %). NaNs when there are too few values for it."""
    xs, n = sorted(values), len(values)
    best = 0
    for k in range(1, n // 2 + 1):
        below = sum(math.comb(n, i) for i in range(k)) / 2 ** n  # P(Binomial(n, 1/2) <= k - 1)
        if 1 - 2 * below >= coverage:
            best = k
    return (xs[best - 1], xs[n - best]) if best else (float("nan"), float("nan"))


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _round_ratios(arm: list[float], base: list[float]) -> list[float]:
    """``arm / base`` of each round where both rates were measured."""
    return [a / b for a, b in zip(arm, base, strict=True) if a == a and b == b and b > 0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="600 steps, 2 kills, 1 overhead pair (< 2 min)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--steps", type=int, help="override the number of steps")
    ap.add_argument("--width", type=int, default=1024, help="hidden units of the MLP (step time grows with it)")
    ap.add_argument("--batch", type=int, default=64, help="samples per rank per step")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--rounds", type=int, help="override the number of overhead rounds")
    args = ap.parse_args()
    # Nine rounds: single rounds of this 2-core machine spread +-0.1 around their median.
    steps, n_kills, every, pairs = (600, 2, 50, 1) if args.quick else (3000, 4, 100, 9)
    steps = args.steps or steps
    pairs = args.rounds or pairs
    rng = random.Random(args.seed)
    # Kills spread over the run, each at a random step in its own stretch (never the same as K's grid).
    span = (steps - 2 * every) // n_kills
    kills = sorted(every + i * span + rng.randrange(every // 2, span - every // 2) for i in range(n_kills))
    work = Path(tempfile.mkdtemp(prefix="tg-integration-"))
    model = ["--steps", str(steps), "--width", str(args.width), "--batch", str(args.batch), "--lr", str(args.lr)]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    print(f"integration benchmark: 2 ranks, MLP width {args.width}, batch {args.batch}/rank, {steps} steps, checkpoint "
          f"every {every} steps, kills of rank 1 after steps {kills}")
    agent = Agent(work / "agent", every)
    # A second agent whose memory tier is never due: the API's own per-step cost alone.
    no_ckpt = Agent(work / "agent-nockpt", 10**9)
    try:
        ckpt = fresh(work / "torchrun-ckpt")
        torchrun = drive("torchrun", [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                                      f"--max-restarts={n_kills + 2}", "--rdzv-backend=c10d",
                                      f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--monitor-interval=0.1", PLAIN,
                                      *model, "--ckpt-dir", str(ckpt), "--ckpt-every", str(every),
                                      "--progress", str(fresh(work / "p-torchrun"))],
                         {**env, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}, work / "p-torchrun", kills, work, 900)
        ours = drive("trainguard", agent.run_cmd("faulted", API, *model, "--progress", str(fresh(work / "p-tg"))),
                     env, work / "p-tg", kills, work, 900)
        plain_tp: list[float] = []
        own_tp: list[float] = []
        api_tp: list[float] = []
        bare_tp: list[float] = []
        arms = [("plain", agent, PLAIN, plain_tp), ("plain-ckpt", agent, PLAIN, own_tp), ("api", agent, API, api_tp),
                ("api-nockpt", no_ckpt, API, bare_tp)]
        for i in range(pairs):
            # The order rotates each round, so no arm always runs first (or right after another).
            for name, who, script, sink in arms[i % len(arms):] + arms[:i % len(arms)]:
                d = fresh(work / f"p-{name}-{i}")
                own = ["--ckpt-dir", str(fresh(work / f"ckpt-{i}")), "--ckpt-every", str(every)] if name == "plain-ckpt" else []
                arm = drive(name, who.run_cmd(f"{name}-{i}", script, *model, *own, "--progress", str(d)), env, d, [],
                            work, 900)
                sink.append(arm.steps_per_s(steps // 10))
            print(f"  round {i + 1}: steps/s plain {plain_tp[-1]:.1f}, plain + own torch.save {own_tp[-1]:.1f}, "
                  f"API + checkpoints {api_tp[-1]:.1f}, API without checkpoints {bare_tp[-1]:.1f}", flush=True)
    finally:
        agent.close()
        no_ckpt.close()
    print()
    print(f"{'arm':<11} {'rc':>3} {'kills':>5} {'restored':>22} {'lost_s/failure':>15} {'wall_s':>7}")
    for arm in (torchrun, ours):
        restored = ",".join(str(f.restored_step) for f in arm.failures)
        print(f"{arm.name:<11} {arm.rc!s:>3} {len(arm.failures):>5} {restored:>22} {arm.lost_per_failure:>15.2f} "
              f"{arm.wall_s:>7.1f}")
        for f in arm.failures:
            print(f"    killed after step {f.kill_step:>5}: restored at {f.restored_step:>5}, back at the kill step "
                  f"{f.lost_s:6.2f}s later")
    lost_ratio = torchrun.lost_per_failure / ours.lost_per_failure
    # Each round's arms ran back to back, so a ratio within one round is free of the drift between
    # rounds (this machine's plain rate moved 310-390 steps/s from one round to the next): the
    # headline is the median of the rounds' own ratios, and their range is printed beside it.
    paired = _round_ratios(api_tp, plain_tp)
    overhead = _median(paired)
    ci_lo, ci_hi = median_interval(paired)
    bare_paired = _round_ratios(bare_tp, plain_tp)
    bare = _median(bare_paired)
    own_paired = _round_ratios(api_tp, own_tp)
    own = _median(own_paired)
    print(f"\nthroughput without faults (steps/s after the first 10% of steps, {pairs} alternating round(s)): "
          f"plain script {statistics.median(plain_tp):.1f}; with the API and memory checkpoints every {every} steps "
          f"{statistics.median(api_tp):.1f}; with the API, no checkpoint due {statistics.median(bare_tp):.1f}")
    print(f"lost time per failure: torchrun / trainguard = {lost_ratio:.2f}x; API throughput / plain = {overhead:.3f} "
          f"(median of the rounds' own ratios: {', '.join(f'{r:.3f}' for r in paired)}; without checkpoints: "
          f"{', '.join(f'{r:.3f}' for r in bare_paired)})")
    print(f"the rounds bound the median ratio within {ci_lo:.3f}-{ci_hi:.3f} (order statistics, >= 90 % coverage): "
          f"the resolution of this run")
    print(f"API + memory checkpoints / plain + its own torch.save every {every} steps = {own:.3f} "
          f"(rounds: {', '.join(f'{r:.3f}' for r in own_paired)}; plain + torch.save {statistics.median(own_tp):.1f} "
          f"steps/s)")
    # The same throughputs as seconds added to each step: the ratio depends on how long a step is.
    cost_ms = 1e3 * (1 / statistics.median(api_tp) - 1 / statistics.median(plain_tp))
    bare_ms = 1e3 * (1 / statistics.median(bare_tp) - 1 / statistics.median(plain_tp))
    print(f"added per step: {cost_ms:.2f} ms with checkpoints every {every} steps, {bare_ms:.2f} ms without "
          f"(plain step {1e3 / statistics.median(plain_tp):.2f} ms)")
    shutil.rmtree(work, ignore_errors=True)
    print(f"RESULT lost_time_ratio={lost_ratio:.2f} overhead_ratio={overhead:.3f} api_only_ratio={bare:.3f} "
          f"own_ckpt_ratio={own:.3f} overhead_ci_lo={ci_lo:.3f} overhead_ci_hi={ci_hi:.3f} "
          f"overhead_lo={min(paired, default=float('nan')):.3f} overhead_hi={max(paired, default=float('nan')):.3f} "
          f"torchrun_lost_s={torchrun.lost_per_failure:.2f} trainguard_lost_s={ours.lost_per_failure:.2f}")
    return 0 if torchrun.rc == 0 and ours.rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
