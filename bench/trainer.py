"""Trainer benchmark: tokens/s of every parallel layout on 4 forked CPU ranks (gloo) with the
single-process figure beside them, then gradient compression on a dp4 DDP run: payload bytes per
step and validation loss after N steps against no compression.

    python bench/trainer.py [--quick]

Tokens/s is the median over the steps after the first two (start-up, FSDP/DTensor first-call
costs), from rank 0's per-step rows. The single process uses one torch thread, like each rank. Compression bytes are what each rank hands to collectives in
the last step (powersgd runs dense for its first steps, as torch recommends); the ratio is the
dense fp32 gradient payload over that.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.trainjobs import run_job, tiny_config  # noqa: E402
from trainguard.trainer.model import param_count  # noqa: E402

LAYOUTS: list[tuple[str, int, dict[str, Any]]] = [
    ("single", 1, {}),
    ("dp4_fsdp", 4, {"dp": 4}),
    ("dp4_ddp", 4, {"dp": 4, "dp_mode": "ddp"}),
    ("dp2xtp2", 4, {"dp": 2, "tp": 2}),
    ("pp2xdp2", 4, {"pp": 2, "dp": 2, "pp_schedule": "1f1b", "microbatches": 4}),
    ("pp2xtp2", 4, {"pp": 2, "tp": 2, "pp_schedule": "1f1b", "microbatches": 4}),
    ("pp2xdp2_interleaved", 4, {"pp": 2, "dp": 2, "pp_schedule": "interleaved", "microbatches": 4}),
]
COMPRESSION = ["none", "powersgd", "int8", "int4"]


def model_section(quick: bool) -> dict[str, int]:
    return {"layers": 4, "d_model": 64 if quick else 128, "heads": 4, "context": 64 if quick else 128}


def run_layouts(work: Path, cache: str, quick: bool) -> dict[str, float]:
    steps = 5 if quick else 12
    out: dict[str, float] = {}
    print(f"{'layout':<22}{'procs':>6}{'tokens/s':>12}{'step ms':>10}{'vs single':>11}")
    # The single-process figure runs first and again last (the better one counts): on a shared
    # host, load from other work would otherwise skew every ratio against one noisy sample.
    for name, nproc, parallel in [*LAYOUTS, LAYOUTS[0]]:
        cfg = tiny_config(cache, model=model_section(quick), parallel=parallel, steps=steps, global_batch=16,
                          data={"cache_dir": cache, "max_bytes": 4_000_000, "val_samples": 16})
        result = run_job(cfg, nproc, work / name)
        if result.rc != 0 or len(result.rows) < steps:
            print(f"{name:<22}{nproc:>6}  FAILED rc={result.rc}")
            out[name] = 0.0
            continue
        timed = result.rows[2:]
        tps = statistics.median(r["tokens_per_s"] for r in timed)
        step_ms = statistics.median(r["step_s"] for r in timed) * 1000
        if name == "single" and name in out:
            print(f"{'single (again)':<22}{nproc:>6}{tps:>12.0f}{step_ms:>10.1f}")
            out[name] = max(out[name], tps)
            continue
        out[name] = tps
        rel = tps / out["single"] if out.get("single") else float("nan")
        print(f"{name:<22}{nproc:>6}{tps:>12.0f}{step_ms:>10.1f}{rel:>10.2f}x")
    return out


def run_compression(work: Path, cache: str, quick: bool) -> dict[str, dict[str, float]]:
    steps = 12 if quick else 40
    dense = param_count_bytes(quick)
    out: dict[str, dict[str, float]] = {}
    print(f"\n{'compression (dp4 ddp)':<22}{'bytes/step':>12}{'ratio':>8}{'val loss':>10}{'tokens/s':>10}")
    for spec in COMPRESSION:
        cfg = tiny_config(cache, model=model_section(quick), parallel={"dp": 4, "dp_mode": "ddp"}, steps=steps,
                          global_batch=16, compression=spec, optim={"warmup": 2},
                          data={"cache_dir": cache, "max_bytes": 4_000_000, "val_samples": 32})
        result = run_job(cfg, 4, work / f"compress_{spec}")
        if result.rc != 0 or not result.rows:
            print(f"{spec:<22}  FAILED rc={result.rc}")
            continue
        last = result.rows[-1]
        sent = float(last.get("comm_bytes", dense)) if spec != "none" else float(dense)
        ratio = dense / sent if sent else float("nan")
        val = float(last.get("val_loss", float("nan")))
        tps = statistics.median(r["tokens_per_s"] for r in result.rows[2:])
        out[spec] = {"bytes": sent, "ratio": ratio, "val_loss": val}
        print(f"{spec:<22}{sent:>12.0f}{ratio:>8.2f}{val:>10.4f}{tps:>10.0f}")
    return out


def param_count_bytes(quick: bool) -> int:
    from trainguard.trainer.config import ModelConfig
    return param_count(ModelConfig(**model_section(quick))) * 4


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller model, fewer steps (< 2 min)")
    args = ap.parse_args()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="tg-bench-trainer-") as tmp:
        work = Path(tmp)
        cache = str(work / "corpus")
        print(f"model {model_section(args.quick)}, global batch 16, gloo on CPU\n")
        tps = run_layouts(work, cache, args.quick)
        comp = run_compression(work, cache, args.quick)
    parts = [f"tokens_per_s_{k}={v:.0f}" for k, v in tps.items()]
    for k, v in tps.items():
        if k != "single" and tps.get("single"):
            parts.append(f"{k}_vs_single_ratio={v / tps['single']:.3f}")
    for spec, c in comp.items():
        if spec != "none":
            parts.append(f"{spec}_compression_ratio={c['ratio']:.2f}")
        parts.append(f"val_loss_{spec}={c['val_loss']:.4f}")
    parts.append(f"wall_s={time.monotonic() - started:.0f}")
    print("RESULT " + " ".join(parts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
