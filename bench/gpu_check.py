"""Compare trainguard's NVML collector with ``nvidia-smi --query-gpu`` on a real GPU, under load.

Run through ``bench/gpu_check.sh`` (which finds or makes a Python environment). Per GPU and field
it prints nvidia-smi's value, the collector's, the median delta over a few rounds, the tolerance
and PASS/FAIL; then checks the collector end to end (process attribution by pid, Prometheus
export without NaN, XID event registration) and runs one NCCL training step of the trainguard
trainer if one is available, and checks that the compute time stragglers are judged on leaves out
a collective wait on CUDA (``bench/gpu_clock_check.py``). Ends with
``RESULT fields_ok=… fields_total=… train_step=… compute_clock=…``.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from trainguard.agent.collectors.base import TrackedProcess, noop_emit  # noqa: E402
from trainguard.agent.collectors.gpu import GpuCollector, GpuCollectorConfig, GpuReading  # noqa: E402
from trainguard.agent.lifecycle.launcher import free_port  # noqa: E402

MIB = 1024**2
SMI_FIELDS = [
    "index",
    "uuid",
    "utilization.gpu",
    "memory.used",
    "memory.total",
    "temperature.gpu",
    "power.draw",
    "clocks.sm",
    "clocks_throttle_reasons.active",
]
# Newer drivers renamed the throttle field; the old name is tried first as the task asks.
SMI_RENAMES = {"clocks_throttle_reasons.active": "clocks_event_reasons.active"}

LOAD = r"""
import sys, time, torch
dev, secs = int(sys.argv[1]), float(sys.argv[2])
torch.cuda.set_device(dev)
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
b = torch.randn_like(a)
c = a @ b
torch.cuda.synchronize()
print("ready", flush=True)
end = time.time() + secs
while time.time() < end:
    for _ in range(10):
        c = a @ b
    torch.cuda.synchronize()
"""


def na(x: Any) -> bool:
    return x is None or (isinstance(x, float) and math.isnan(x))


def smi_number(text: str) -> float:
    text = text.strip()
    if not text or text.startswith("[") or text in ("N/A", "Not Supported"):
        return float("nan")
    try:
        return float(int(text, 16)) if text.startswith("0x") else float(text)
    except ValueError:
        return float("nan")


def query_smi() -> list[dict[str, str]]:
    fields = list(SMI_FIELDS)
    for attempt in range(2):
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        if out.returncode == 0:
            rows = []
            for line in out.stdout.strip().splitlines():
                vals = [v.strip() for v in line.split(",")]
                rows.append(dict(zip(SMI_FIELDS, vals, strict=False)))
            return rows
        if attempt == 0 and "not a valid field" in (out.stdout + out.stderr).lower():
            fields = [SMI_RENAMES.get(f, f) for f in fields]
            continue
        raise RuntimeError(
            f"nvidia-smi failed (rc {out.returncode}): {(out.stdout + out.stderr).strip()[:300]}"
        )
    raise RuntimeError("unreachable")


def query_smi_pids() -> dict[str, set[int]]:
    out = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=gpu_uuid,pid", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    pids: dict[str, set[int]] = {}
    for line in out.stdout.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[1].isdigit():
            pids.setdefault(parts[0], set()).add(int(parts[1]))
    return pids


# field -> (nvidia-smi column, collector value, delta, within tolerance?, tolerance text)
Check = tuple[
    str, Callable[[GpuReading], float], Callable[[float, float], float], Callable[[float, float], bool], str
]


def _rel(smi: float, col: float) -> float:
    return (col - smi) / smi if smi else col - smi


CHECKS: list[Check] = [
    (
        "utilization.gpu",
        lambda r: r.utilization_gpu_pct,
        lambda s, c: c - s,
        lambda s, c: abs(c - s) <= 10,
        "±10 pts",
    ),
    (
        "memory.used",
        lambda r: r.memory_used_bytes / MIB,
        lambda s, c: c - s,
        lambda s, c: abs(c - s) <= 64,
        "±64 MiB",
    ),
    (
        "memory.total",
        lambda r: r.memory_total_bytes / MIB,
        lambda s, c: c - s,
        lambda s, c: abs(c - s) <= 64,
        "±64 MiB",
    ),
    ("temperature.gpu", lambda r: r.temperature_c, lambda s, c: c - s, lambda s, c: abs(c - s) <= 3, "±3 C"),
    ("power.draw", lambda r: r.power_w, _rel, lambda s, c: abs(c - s) <= max(0.15 * s, 5.0), "±15%"),
    ("clocks.sm", lambda r: r.sm_clock_mhz, _rel, lambda s, c: abs(c - s) <= 0.10 * s, "±10%"),
    (
        "clocks_throttle_reasons.active",
        lambda r: float("nan") if r.throttle_mask is None else float(r.throttle_mask),
        lambda s, c: 0.0 if s == c else 1.0,
        lambda s, c: s == c,
        "equal mask",
    ),
]


def cuda_devices(py: str) -> tuple[int, str]:
    """(CUDA devices torch sees in a child process, why none) - the child keeps CUDA out of this one."""
    probe = subprocess.run(
        [py, "-c", "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)"],
        capture_output=True,
        text=True,
        env=dict(os.environ, CUDA_DEVICE_ORDER="PCI_BUS_ID"),
    )
    out = probe.stdout.strip()
    return (int(out), "") if out.isdigit() else (0, (out or probe.stderr.strip())[-200:])


def start_load(gpus: int, seconds: float, py: str) -> list[subprocess.Popen[str]]:
    if importlib.util.find_spec("torch") is None:
        print("load: torch not installed -> comparing an idle GPU")
        return []
    env = dict(os.environ, CUDA_DEVICE_ORDER="PCI_BUS_ID")  # same order as NVML's indices
    visible, why = cuda_devices(py)
    if visible == 0:
        print(f"load: torch without CUDA ({why}) -> idle GPU")
        return []
    procs = []
    for dev in range(min(gpus, visible)):
        p = subprocess.Popen(
            [py, "-c", LOAD, str(dev), str(seconds)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        procs.append(p)
    for dev, p in enumerate(procs):
        assert p.stdout is not None
        line = p.stdout.readline().strip()
        if line != "ready":
            err = p.stderr.read()[-300:] if p.stderr else ""
            print(f"load on GPU {dev} failed to start: {err}")
    print(f"load: bf16 8192x8192 matmul loop on {len(procs)} GPU(s), pids {[p.pid for p in procs]}")
    time.sleep(3.0)  # let utilization, clocks and power settle under the load
    return procs


def fmt(x: float, digits: int = 1) -> str:
    if na(x):
        return "N/A"
    if x == int(x):
        return str(int(x))
    return f"{x:.{digits}f}"


def compare(col: GpuCollector, rounds: int) -> tuple[int, int, list[list[str]]]:
    """(fields ok, fields total, table rows) over ``rounds`` rounds of nvidia-smi vs collector."""
    samples: dict[tuple[int, str], list[tuple[float, float]]] = {}
    uuids_ok: dict[int, bool] = {}
    t_last = 0.0
    for round_no in range(rounds):
        smi = query_smi()
        now = time.monotonic()
        col.poll(now)
        readings = col.readings()
        for row in smi:
            idx = int(row["index"])
            r = readings.get(idx)
            if r is None:
                continue
            uuids_ok[idx] = r.uuid == row["uuid"]
            for name, getter, _, _, _ in CHECKS:
                samples.setdefault((idx, name), []).append((smi_number(row[name]), getter(r)))
        t_last = now
        if round_no + 1 < rounds:  # NVML utilization is a ~1 s average: space rounds out
            time.sleep(max(0.0, 1.0 - (time.monotonic() - t_last)))
    rows: list[list[str]] = []
    ok = total = 0
    for idx in sorted(uuids_ok):
        total += 1
        ok += uuids_ok[idx]
        rows.append([str(idx), "uuid", "", "", "", "equal", "PASS" if uuids_ok[idx] else "FAIL"])
        for name, _, delta, within, tol in CHECKS:
            pairs = samples.get((idx, name), [])
            total += 1
            if not pairs:
                rows.append([str(idx), name, "-", "-", "-", tol, "FAIL"])
                continue
            both_na = all(na(s) and na(c) for s, c in pairs)
            good = [not na(s) and not na(c) and within(s, c) for s, c in pairs]
            deltas = [delta(s, c) for s, c in pairs if not na(s) and not na(c)]
            passed = both_na or sum(good) * 2 > len(good)  # most rounds within tolerance
            ok += passed
            s_last, c_last = pairs[-1]
            if name.startswith("clocks_throttle"):
                shown_s = "N/A" if na(s_last) else f"0x{int(s_last):x}"
                shown_c = "N/A" if na(c_last) else f"0x{int(c_last):x}"
                d = "N/A" if not deltas else f"{sum(1 for x in deltas if x == 0)}/{len(deltas)} eq"
            else:
                shown_s, shown_c = fmt(s_last), fmt(c_last)
                med = statistics.median(deltas) if deltas else float("nan")
                d = "N/A" if na(med) else (f"{med * 100:+.1f}%" if tol.endswith("%") else f"{med:+.1f}")
            rows.append(
                [
                    str(idx),
                    name,
                    shown_s,
                    shown_c,
                    d,
                    tol,
                    "PASS (both N/A)" if both_na else ("PASS" if passed else "FAIL"),
                ]
            )
    return ok, total, rows


def print_table(rows: list[list[str]]) -> None:
    head = ["gpu", "field", "nvidia-smi", "collector", "median delta", "tolerance", "result"]
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    for r in [head, ["-" * w for w in widths], *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)))


def end_to_end(col: GpuCollector, load: list[subprocess.Popen[str]]) -> tuple[int, int]:
    """Attribution by pid, export, extra fields; returns (ok, total)."""
    ok = total = 0
    smi_pids = query_smi_pids()
    readings = col.readings()
    for idx, r in sorted(readings.items()):
        total += 1
        want = smi_pids.get(r.uuid, set())
        same = set(r.processes) == want
        ok += same
        print(
            f"gpu {idx}: compute pids nvidia-smi={sorted(want)} collector={sorted(r.processes)} -> {'PASS' if same else 'FAIL'}"
        )
        print(
            f"gpu {idx}: {r.name} throttle={list(r.throttle_reasons)} ecc(corr/uncorr)={fmt(r.ecc_corrected)}/"
            f"{fmt(r.ecc_uncorrected)} remapped(c/u/pend/fail)={fmt(r.remapped_correctable)}/{fmt(r.remapped_uncorrectable)}/"
            f"{fmt(r.remap_pending)}/{fmt(r.remap_failure)} pcie tx/rx B/s={fmt(r.pcie_tx_bytes_per_s, 0)}/"
            f"{fmt(r.pcie_rx_bytes_per_s, 0)} nvlink tx/rx B/s={fmt(r.nvlink_tx_bytes_per_s, 0)}/"
            f"{fmt(r.nvlink_rx_bytes_per_s, 0)} power limit W={fmt(r.power_limit_w)} sm max MHz={fmt(r.sm_clock_max_mhz)}"
        )
    if load:
        col.track({p.pid: TrackedProcess(p.pid, "gpucheck", i, i) for i, p in enumerate(load)})
        col.poll(time.monotonic())
        readings = col.readings()
        for i, p in enumerate(load):
            total += 1
            want_uuid = next((u for u, pids in smi_pids.items() if p.pid in pids), None)
            got = col.gpu_for_pid(p.pid)
            got_uuid = readings[got].uuid if got is not None and got in readings else None
            stats = col.gpu_stats_for_pid(p.pid)
            good = got_uuid is not None and got_uuid == want_uuid and stats is not None
            ok += good
            print(
                f"load pid {p.pid} (rank {i}): collector gpu {got} {got_uuid}, nvidia-smi {want_uuid}; "
                f"stats={stats} -> {'PASS' if good else 'FAIL'}"
            )
    from prometheus_client import CollectorRegistry
    from prometheus_client.exposition import generate_latest

    reg = CollectorRegistry()
    reg.register(type("Adapter", (), {"collect": lambda self: col.metrics()})())
    text = generate_latest(reg).decode()
    samples = [ln for ln in text.splitlines() if ln and not ln.startswith("#")]
    util_lines = [ln for ln in samples if ln.startswith("trainguard_gpu_utilization_ratio{")]
    good = bool(samples) and "NaN" not in text and len(util_lines) == len(readings)
    total += 1
    ok += good
    print(
        f"prometheus export: {len(samples)} samples, NaN={'NaN' in text}, utilization series={len(util_lines)} -> {'PASS' if good else 'FAIL'}"
    )
    watcher = getattr(col, "_watcher", None)
    print(f"xid events: {'registered ' + str(watcher.registered) if watcher else 'not available'} (info)")
    return ok, total


def _tree(pid: int) -> set[int]:
    """pid and its descendants, from /proc (no psutil needed)."""
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        out.add(p)
        for task in Path(f"/proc/{p}/task").glob("*/children"):
            try:
                todo += [int(c) for c in task.read_text().split()]
            except OSError:
                pass
    return out


def train_commands(py: str, state_dir: str) -> list[tuple[str, list[str], dict[str, str]]]:
    override = os.environ.get("GPU_CHECK_TRAIN_CMD")
    if override:
        return [("GPU_CHECK_TRAIN_CMD", ["bash", "-c", override], {})]
    cmds = []
    if importlib.util.find_spec("trainguard.trainer.worker") is not None:
        env = {
            "RANK": "0",
            "LOCAL_RANK": "0",
            "WORLD_SIZE": "1",
            "LOCAL_WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()),
            "TRAINGUARD_JOB_SPEC": '{"steps": 1, "device": "cuda"}',  # cuda device -> NCCL backend
            "TRAINGUARD_JOB": "gpucheck",
            "TRAINGUARD_JSON": "1",
        }
        cmds.append(("python -m trainer.worker (world size 1, nccl)", [py, "-m", "trainguard.trainer.worker"], env))
    if importlib.util.find_spec("trainguard.cli") is not None:
        argv = ["train", "--nproc", "1", "--steps", "1", "--standalone", "--json", "--state-dir", state_dir]
        argv += ["--set", "device=cuda"]
        cmds.append(("trainguard " + " ".join(argv), [py, "-m", "trainguard", *argv], {}))
    return cmds


def train_step(col: GpuCollector, py: str, timeout: float) -> str:
    """Run one training step on the GPU (NCCL, world size 1); watch for its pid on the GPU."""
    import tempfile

    visible, why = cuda_devices(py)
    if visible == 0 and not os.environ.get("GPU_CHECK_TRAIN_CMD"):
        print(f"train step: torch without CUDA ({why}) -> skipped")
        return "skipped"
    state_dir = tempfile.mkdtemp(prefix="trainguard-gpucheck-")
    cmds = train_commands(py, state_dir)
    if not cmds:
        print("train step: no trainer entry point found (trainer.worker / trainguard train) -> skipped")
        return "skipped"
    for label, argv, extra in cmds:
        env = dict(os.environ, PYTHONPATH=str(REPO), NCCL_DEBUG="VERSION", PYTHONUNBUFFERED="1", **extra)
        print(f"train step: {label}")
        t0 = time.monotonic()
        proc = subprocess.Popen(
            argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        seen_gpu: int | None = None
        while proc.poll() is None and time.monotonic() - t0 < timeout:
            tree = _tree(proc.pid)
            col.track({pid: TrackedProcess(pid, "gpucheck-train", 0, 0) for pid in tree})
            col.poll(time.monotonic())
            for pid in tree:
                if seen_gpu is None and col.gpu_for_pid(pid) is not None:
                    seen_gpu = col.gpu_for_pid(pid)
            time.sleep(0.5)
        if proc.poll() is None:
            proc.kill()
        out = proc.communicate()[0] if proc.stdout else ""
        rc = proc.returncode
        stepped = any(ln.startswith("{") and '"step": 1' in ln for ln in out.splitlines())
        nccl = "NCCL version" in out
        tail = "\n".join(out.strip().splitlines()[-8:])
        print(
            f"  rc={rc} in {time.monotonic() - t0:.1f}s, step 1 reported: {stepped}, NCCL used: {nccl}, "
            f"trainer pid seen on gpu: {seen_gpu}\n  " + tail.replace("\n", "\n  ")
        )
        if rc == 0 and stepped:
            return "ok"
        if rc != 2:  # 2 = bad configuration/usage: try the next form of the command
            return "failed"
    return "failed"


def clock_check(py: str) -> str:
    """bench/gpu_clock_check.py: the compute time judged on CUDA leaves out a collective wait."""
    proc = subprocess.run([py, str(REPO / "bench" / "gpu_clock_check.py")], cwd=REPO, capture_output=True,
                          text=True, timeout=180, env=dict(os.environ, PYTHONPATH=str(REPO)))
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]
    print("compute clock: " + ("\n  ".join(lines[-6:]) if lines else f"no output, rc={proc.returncode}"))
    if any(ln.startswith("CLOCK skipped") for ln in lines):
        return "skipped"
    return "ok" if proc.returncode == 0 else "failed"


def self_test_nvml(drift: bool) -> Any:
    """A fake NVML plus a matching fake nvidia-smi, to check this script on a machine without a GPU
    (tests/bench/test_gpu_check.py). ``drift`` makes nvidia-smi disagree on memory.used by 200 MiB."""
    global query_smi, query_smi_pids
    from tests.helpers.fakenvml import FakeGpu, FakeNvml  # the tests' fake; only the self-test needs it
    from trainguard.agent.collectors.gpu import Nvml

    gpus = [FakeGpu(index=0, processes={os.getpid(): 1 << 30}), FakeGpu(index=1, nvlinks=(), temperature=70)]
    gpus[1].throttle_power()

    def fake_smi() -> list[dict[str, str]]:
        return [
            {
                "index": str(g.index),
                "uuid": g.uuid,
                "utilization.gpu": str(g.util_gpu + 3),
                "memory.used": str(g.mem_used // MIB + (200 if drift else 10)),
                "memory.total": str(g.mem_total // MIB),
                "temperature.gpu": str(g.temperature + 1),
                "power.draw": f"{g.power_mw / 1000 * 1.05:.2f}",
                "clocks.sm": str(g.sm_clock),
                "clocks_throttle_reasons.active": f"0x{g.throttle_mask:016x}",
            }
            for g in gpus
        ]

    def fake_pids() -> dict[str, set[int]]:
        return {g.uuid: set(g.processes) for g in gpus if g.processes}

    query_smi, query_smi_pids = fake_smi, fake_pids
    return Nvml(module=FakeNvml(gpus))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="fewer rounds, shorter training timeout")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--no-train", action="store_true", help="skip the training step")
    ap.add_argument("--train-timeout", type=float, default=None)
    ap.add_argument(
        "--self-test", choices=["agree", "drift"], help="fake NVML and nvidia-smi (no GPU needed)"
    )
    args = ap.parse_args()
    rounds = args.rounds or (3 if args.quick else 5)
    train_timeout = args.train_timeout or (120.0 if args.quick else 240.0)
    py = sys.executable

    nvml = self_test_nvml(args.self_test == "drift") if args.self_test else None
    if nvml is None and shutil.which("nvidia-smi") is None:
        print("ERROR nvidia-smi not found. HINT run this on a machine with the NVIDIA driver")
        print("RESULT fields_ok=0 fields_total=0 train_step=skipped")
        return 1
    col = GpuCollector(noop_emit, nvml, GpuCollectorConfig(xid_events=True))
    try:
        col.start()
    except Exception as exc:
        print(f"collector did not start: {exc}")
        print("RESULT fields_ok=0 fields_total=0 train_step=skipped")
        return 1
    n_gpus = len(col._devices)
    print(f"driver {col.driver_version}, {n_gpus} GPU(s), python {sys.version.split()[0]}")
    load = [] if args.self_test else start_load(min(n_gpus, 8), seconds=rounds * 1.5 + 20, py=py)
    try:
        ok, total, rows = compare(col, rounds)
        print_table(rows)
        ok2, total2 = end_to_end(col, load)
        ok, total = ok + ok2, total + total2
    finally:
        for p in load:
            p.kill()
            p.wait()
    train = "skipped"
    if not args.no_train and not args.self_test:
        try:
            train = train_step(col, py, train_timeout)
        except Exception as exc:  # the NVML result above stands whatever happens here
            print(f"train step crashed: {exc!r}")
            train = "failed"
    clock = "skipped"
    if not args.self_test:
        clock = clock_check(py)
    col.stop()
    print(
        f"RESULT fields_ok={ok} fields_total={total} fields_ok_ratio={ok / total if total else 0:.3f} train_step={train}"
        f" compute_clock={clock}"
    )
    return 0 if ok == total else 1


if __name__ == "__main__":
    sys.exit(main())
