"""Recovery benchmark: the same job, the same injected kills, three ways, side by side.

(a) trainguard: warm restart (ranks forked from a zygote) + memory-tier checkpoints;
(b) trainguard: cold restart (fresh interpreters), same memory tier;
(c) torchrun --max-restarts with the store workaround and DCP checkpoints to disk (what a user
    runs today), checkpointing 5x less often (the spec's 100 vs 500 steps).

Per failure: detection latency, kill -> first resumed step, steps lost, lost time (downtime +
recomputing the lost steps); per run: effective training time = useful step time / wall time.
Also the memory-tier save stall against state bytes / measured memcpy bandwidth.

    python bench/recovery.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from trainguard.agent.api.client import ApiClient  # noqa: E402
from trainguard.trainer.testing import tiny_config  # noqa: E402


@dataclass
class Failure:
    kill_step: int
    kill_ts: float
    resume_ts: float
    restored_step: int
    detect_s: float | None = None

    @property
    def resume_s(self) -> float:
        return self.resume_ts - self.kill_ts

    @property
    def steps_lost(self) -> int:
        return self.kill_step - self.restored_step


@dataclass
class RunResult:
    name: str
    failures: list[Failure] = field(default_factory=list)
    median_step_s: float = 0.0
    effective: float = 0.0
    wall_s: float = 0.0
    final_step: int = 0
    stalls: list[tuple[int, float]] = field(default_factory=list)
    ok: bool = True
    note: str = ""

    def lost_s(self, f: Failure) -> float:
        return f.resume_s + f.steps_lost * self.median_step_s

    @property
    def lost_per_failure(self) -> float:
        return statistics.mean(self.lost_s(f) for f in self.failures) if self.failures else float("nan")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def parse_rows(lines: list[str]) -> list[dict[str, Any]]:
    rows = []
    for line in lines:
        i = line.find("{")
        if i < 0:
            continue
        try:
            row = json.loads(line[i:])
        except ValueError:
            continue
        if isinstance(row, dict) and "step" in row and "time" in row:
            rows.append(row)
    return rows


def analyse(name: str, rows: list[dict[str, Any]], kills: list[int], every: int) -> RunResult:
    """Failures are where the step sequence goes back (a restore) or restarts at 1."""
    res = RunResult(name)
    if not rows:
        res.ok, res.note = False, "no step rows"
        return res
    healthy = [r["step_s"] for r in rows if r["step"] > 2]
    res.median_step_s = statistics.median(healthy) if healthy else 0.0
    for prev, row in zip(rows, rows[1:], strict=False):
        if row["step"] <= prev["step"]:
            res.failures.append(Failure(prev["step"], prev["time"], row["time"], row["step"] - 1))
    # Save stalls: the gap after a checkpoint step beyond a normal step.
    by_step: dict[int, dict[str, Any]] = {}
    for prev, row in zip(rows, rows[1:], strict=False):
        if row["step"] == prev["step"] + 1 and prev["step"] % every == 0:
            by_step[prev["step"]] = {"gap": row["time"] - prev["time"] - row["step_s"]}
    res.stalls = [(s, v["gap"]) for s, v in sorted(by_step.items())]
    res.final_step = rows[-1]["step"]
    res.wall_s = rows[-1]["time"] - rows[0]["time"] + rows[0]["step_s"]
    res.effective = res.final_step * res.median_step_s / res.wall_s if res.wall_s > 0 else 0.0
    return res


def wait_for(pred, timeout: float, what: str):  # noqa: ANN001, ANN201
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.1)
    raise TimeoutError(what)


def run_trainguard(name: str, warm: bool, nproc: int, trainer: dict[str, Any], kills: list[int], mem_every: int, work: Path) -> RunResult:
    state = work / f"agent-{name}"
    state.mkdir(parents=True)
    (state / "agent.toml").write_text(
        f"[checkpoint]\nmemory_every = {mem_every}\ndisk_every = 100000\n"
        f"[recovery]\nwarm_launcher = {'true' if warm else 'false'}\nmax_restarts = {len(kills) + 2}\n"
        "[collectors]\ngpu = false\n"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))
    agent = subprocess.Popen(
        [sys.executable, "-m", "trainguard", "agent", "--state-dir", str(state), "--config", str(state / "agent.toml"),
         "--metrics-addr", "127.0.0.1:0"],
        stdout=open(state / "agent.log", "wb"), stderr=subprocess.STDOUT, cwd=REPO, env=env,
    )
    try:
        sock = state / "run" / "agent.sock"
        wait_for(lambda: sock.exists(), 60, "agent socket")
        client = ApiClient.local(str(sock), timeout=30)
        client.submit_job({"job": name, "nproc": nproc, "trainer": trainer, "faults": [f"kill:rank=1,step={k}" for k in kills],
                           "max_restarts": len(kills) + 2})
        wait_for(lambda: client.job(name)["state"] in ("succeeded", "failed", "stopped"), 1800, "job end")
        job = client.job(name)
        events = client.events(since=0, limit=10000)["events"]
        log = state / "jobs" / name / "rank0.log"
        rows = parse_rows(log.read_text(errors="replace").splitlines())
        res = analyse(name, rows, kills, mem_every)
        res.ok = job["state"] == "succeeded"
        # Detection: the supervisor's rank_exit event against the kernel's exit timestamp.
        seen = [e for e in events if e["kind"] == "process_exit_seen" and e.get("fields", {}).get("signal") == 9]
        exits = [e for e in events if e["kind"] == "rank_exit" and e["severity"] == "error"]
        for f, ex in zip(res.failures, exits, strict=False):
            kernel = next((s for s in seen if s["fields"].get("pid") == ex["fields"].get("pid")), None)
            death = kernel["ts"] - kernel["fields"].get("latency_ms", 0) / 1000 if kernel else f.kill_ts
            f.detect_s = max(0.0, ex["ts"] - death)
        return res
    finally:
        agent.send_signal(signal.SIGTERM)
        try:
            agent.wait(60)
        except subprocess.TimeoutExpired:
            agent.kill()


def run_torchrun(nproc: int, trainer: dict[str, Any], kills: list[int], ckpt_every: int, work: Path) -> RunResult:
    ckpt = work / "torchrun-ckpt"
    cfg = {**trainer, "ckpt_dir": str(ckpt), "ckpt_every": ckpt_every, "faults": [f"kill:rank=1,step={k}" for k in kills]}
    env = dict(os.environ, PYTHONPATH=str(REPO), TRAINGUARD_JOB_SPEC=json.dumps(cfg), TRAINGUARD_JSON="1",
               TRAINGUARD_FAULT_MARKER_DIR=str(work / "torchrun-markers"), TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
               OMP_NUM_THREADS="1")
    env.pop("TRAINGUARD_SOCKET", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", f"--max-restarts={len(kills) + 1}",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--monitor-interval=0.1", "-m", "trainguard.trainer.worker"]
    out = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=3600)
    (work / "torchrun.log").write_text(out.stdout + "\n---stderr---\n" + out.stderr)
    rows = parse_rows(out.stdout.splitlines())
    res = analyse("torchrun", rows, kills, ckpt_every)
    res.ok = out.returncode == 0
    if not res.ok:
        res.note = f"torchrun exit {out.returncode}"
    return res


def memcpy_bandwidth(nbytes: int = 256 << 20) -> float:
    import numpy as np

    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    t0 = time.perf_counter()
    for _ in range(3):
        np.copyto(dst, src)
    return 3 * nbytes / (time.perf_counter() - t0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="2 ranks, 70 steps, 2 kills (< 2 min)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    args = ap.parse_args()
    if args.quick:
        nproc, steps, kills, mem_every, disk_every = 2, 70, [27, 57], 10, 50
    else:
        nproc, steps, kills, mem_every, disk_every = 4, 600, [150, 330, 480], 100, 500
    work = Path(tempfile.mkdtemp(prefix="tg-recovery-"))
    cache = str(work / "corpus")
    trainer = tiny_config(cache, steps=steps, parallel={"dp": nproc}, model={"layers": 2, "d_model": 64, "heads": 4, "context": 64}).to_dict()
    # Build the corpus cache once so no run pays for it.
    from trainguard.trainer.data import build_corpus

    build_corpus(cache, trainer["data"]["max_bytes"])
    print(f"recovery benchmark: {nproc} ranks, {steps} steps, kills at {kills}; memory tier every {mem_every}, torchrun DCP every {disk_every}")
    results = [
        run_trainguard("warm", True, nproc, trainer, kills, mem_every, work),
        run_trainguard("cold", False, nproc, trainer, kills, mem_every, work),
        run_torchrun(nproc, trainer, kills, disk_every, work),
    ]
    print()
    print(f"{'run':<10} {'ok':<4} {'fail':>4} {'detect_s':>9} {'resume_s':>9} {'steps_lost':>10} {'lost_s/fail':>11} {'step_s':>7} {'effective':>9}")
    for r in results:
        det = [f.detect_s for f in r.failures if f.detect_s is not None]
        print(
            f"{r.name:<10} {'yes' if r.ok else 'NO':<4} {len(r.failures):>4} "
            f"{(statistics.median(det) if det else float('nan')):>9.3f} "
            f"{(statistics.median([f.resume_s for f in r.failures]) if r.failures else float('nan')):>9.2f} "
            f"{(statistics.mean([f.steps_lost for f in r.failures]) if r.failures else float('nan')):>10.1f} "
            f"{r.lost_per_failure:>11.2f} {r.median_step_s:>7.3f} {r.effective:>9.3f}  {r.note}"
        )
    warm, cold, torchrun = results
    for r in results:
        for f in r.failures:
            print(f"  {r.name:<9} kill after step {f.kill_step:>4}: restored step {f.restored_step:>4}, resumed {f.resume_s:6.2f}s later")
    bw = memcpy_bandwidth()
    state_bytes = 0
    log = work / "agent-warm" / "events" / "events.jsonl"
    if log.exists():
        for line in log.read_text().splitlines():
            e = json.loads(line)
            if e["kind"] == "checkpoint_committed":
                state_bytes = max(state_bytes, int(e.get("fields", {}).get("bytes", 0)))
    stalls = [s for _, s in warm.stalls if s > 0]
    stall = statistics.median(stalls) if stalls else float("nan")
    ideal = state_bytes / bw if bw else float("nan")
    print(f"\nmemory-tier save stall: median {stall * 1000:.1f} ms for {state_bytes / 1e6:.1f} MB of state; "
          f"memcpy at {bw / 1e9:.2f} GB/s would take {ideal * 1000:.1f} ms (stall/memcpy = {stall / ideal if ideal else float('nan'):.1f}x)")
    ratio = torchrun.lost_per_failure / warm.lost_per_failure if warm.failures and torchrun.failures else float("nan")
    cold_ratio = cold.lost_per_failure / warm.lost_per_failure if warm.failures and cold.failures else float("nan")
    print(f"lost time per failure: torchrun / trainguard-warm = {ratio:.1f}x; cold / warm = {cold_ratio:.1f}x")
    det = [f.detect_s for f in warm.failures if f.detect_s is not None]
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    else:
        print(f"work directory kept: {work}")
    print(
        f"RESULT detect_s={statistics.median(det) if det else float('nan'):.3f} "
        f"resume_s={statistics.median([f.resume_s for f in warm.failures]) if warm.failures else float('nan'):.2f} "
        f"cold_resume_s={statistics.median([f.resume_s for f in cold.failures]) if cold.failures else float('nan'):.2f} "
        f"torchrun_resume_s={statistics.median([f.resume_s for f in torchrun.failures]) if torchrun.failures else float('nan'):.2f} "
        f"lost_time_ratio={ratio:.2f} effective_time={warm.effective:.3f} torchrun_effective_time={torchrun.effective:.3f}"
    )
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
