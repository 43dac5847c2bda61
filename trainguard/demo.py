"""`trainguard demo`: an agent and a 4-rank training job of the bundled GPT, with a rank killed
and a rank made slow, healed live, and a summary at the end. Everything runs under one temporary
state directory (printed, so `trainguard top --state-dir DIR` can watch it from another terminal).
"""

from __future__ import annotations

import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

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
    "straggler_detected", "straggler_recovered", "shard_migration", "rank_excluded", "controller_decision",
    "checkpoint_write_failed", "crash_loop", "oom_kill",
}


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


def _job_spec(quick: bool) -> dict[str, Any]:
    from trainguard.trainer.config import config_from_cli

    steps = 160 if quick else 300
    faults = ["slow:rank=2,factor=2.5,step=30", f"kill:rank=1,step={steps // 2}"]
    trainer = config_from_cli(
        nproc=4,
        steps=steps,
        faults=faults,
        overrides=["model.layers=2", "model.d_model=64", "model.context=64", "global_batch=16", "data.max_bytes=4000000", "val_every=50"],
    )
    return {"job": "demo", "nproc": 4, "trainer": trainer, "faults": faults, "max_restarts": 3}


def _fmt_score(score: Any) -> str:
    return f"{score:.2f}" if isinstance(score, int | float) else "n/a"


def _describe(e: dict[str, Any]) -> str:
    stamp = time.strftime("%H:%M:%S", time.localtime(e["ts"]))
    cause = f"  (cause: {e['cause']})" if e.get("cause") else ""
    return f"  {stamp} {e['kind']:<20} {e['message']}{cause}"


def _summary(client: Any, job: str, started: float, out: Any, kernel: dict[str, Any] | None = None) -> dict[str, Any]:
    info = client.job(job)
    status = client.status()
    events = client.events(since=0, limit=10000)["events"]
    rows = {j["job"]: j for j in status["jobs"]}.get(job, {}).get("ranks", [])
    print("\n=== summary ===", file=out)
    print(f"job {job}: {info['state']} at step {info['progress_step']} in {time.time() - started:.0f}s, "
          f"{info['restarts']} restart(s), {info['nproc']} ranks", file=out)
    for r in sorted(rows, key=lambda r: r["rank"]):
        tel = r.get("telemetry") or {}
        tps = tel.get("tokens_per_s")
        share = tel.get("batch_size")
        print(f"  rank {r['rank']}: {tps if tps is None else round(tps):>7} tokens/s  batch {share}  "
              f"median compute {1000 * (tel.get('median_compute_s') or 0):.0f} ms/step  "
              f"straggler score {_fmt_score(tel.get('straggler_score'))}", file=out)
    # Per-rank series exist while the ranks are tracked: use the last view taken during the run.
    runq = (kernel or status.get("kernel", {})).get("runqueue", {})
    if runq:
        from trainguard.agent.collectors.ebpf.hist import log2_quantile

        print("  kernel (eBPF) run-queue latency, cumulative:", file=out)
        for name, h in sorted(runq.items()):
            if name == "node" or name.startswith(f"{job} rank"):
                n = sum(h["slots"])
                print(f"    {name:<14} p50 {1e6 * log2_quantile(h['slots'], 0.5):8.0f} us  p99 "
                      f"{1e6 * log2_quantile(h['slots'], 0.99):8.0f} us  ({n} waits)", file=out)
    resumed = [e for e in events if e["kind"] == "job_resumed"]
    for e in resumed:
        print(f"  recovered in {e['fields'].get('recovery_s', float('nan')):.2f}s from {e['fields'].get('restored_from')}", file=out)
    strag = [e for e in events if e["kind"] == "straggler_detected"]
    for e in strag:
        print(f"  straggler: rank {e.get('rank')} cause {e.get('cause')}", file=out)
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
    return {"state": info["state"], "restarts": info["restarts"], "resumed": len(resumed), "stragglers": len(strag),
            "migrations": len(migr), "step": info["progress_step"]}


def run_demo(tui: bool = False, quick: bool = False, out: Any = None, keep: bool = False) -> int:
    from trainguard.agent.api.client import ApiClient

    out = out or sys.stdout
    state = Path(tempfile.mkdtemp(prefix="trainguard-demo-"))
    print(f"trainguard demo: agent state in {state}", file=out)
    print(f"  watch live from another terminal:  .venv/bin/trainguard top --state-dir {state}", file=out)
    agent = _start_agent(state)
    sock = state / "run" / "agent.sock"
    try:
        if not _wait(lambda: sock.exists() or agent.poll() is not None, 60) or agent.poll() is not None:
            print((state / "agent.log").read_text(errors="replace"), file=out)
            print("trainguard demo: the agent did not start", file=out)
            return 1
        client = ApiClient.local(str(sock), timeout=30)
        st = client.status()
        for name, c in sorted(st["collectors"].items()):
            print(f"  collector {name:<5} {'up' if c['up'] else 'off: ' + str(c['reason'])}", file=out)
        spec = _job_spec(quick)
        print(f"submitting job 'demo': 4 ranks (dp=4), {spec['trainer']['steps']} steps, faults: {', '.join(spec['faults'])}", file=out)
        started = time.time()
        job = client.submit_job(spec)
        if tui:
            import argparse

            from trainguard.tui.app import run_dashboard

            run_dashboard(argparse.Namespace(state_dir=str(state), agent=None, token_file=None, json=False))
        seen = 0
        last_line = 0.0
        kernel: dict[str, Any] | None = None
        while True:
            info = client.job(job)
            batch = client.events(since=seen, limit=1000)
            for e in batch["events"]:
                if e["kind"] in HEAL_KINDS and (e["severity"] != "info" or e["kind"] != "rank_exit"):
                    print(_describe(e), file=out, flush=True)
            seen = batch["next"]
            if info["state"] in ("succeeded", "failed", "stopped"):
                break
            if time.monotonic() - last_line > 5:
                st = client.status()
                if any(k.startswith(f"{job} rank") for k in st.get("kernel", {}).get("runqueue", {})):
                    kernel = st["kernel"]
                ranks = {j["job"]: j for j in st["jobs"]}.get(job, {}).get("ranks", [])
                steps = [r["telemetry"]["step"] for r in ranks if r.get("telemetry")]
                times = [r["telemetry"]["step_s"] for r in ranks if r.get("telemetry")]
                timing = f", step time {statistics.median(times):.3f}s" if times else " (starting ranks)"
                print(f"  ... {info['state']}, step {max(steps) if steps else '-'}{timing}", file=out, flush=True)
                last_line = time.monotonic()
            time.sleep(0.5)
        result = _summary(client, job, started, out, kernel)
        ok = result["state"] == "succeeded" and result["resumed"] >= 1
        print(f"demo {'passed' if ok else 'FAILED'}: the kill was {'healed' if result['resumed'] else 'NOT healed'}", file=out)
        return 0 if ok else 1
    finally:
        agent.send_signal(signal.SIGTERM)
        try:
            agent.wait(30)
        except subprocess.TimeoutExpired:
            agent.kill()
        if not keep and not tui:
            shutil.rmtree(state, ignore_errors=True)
