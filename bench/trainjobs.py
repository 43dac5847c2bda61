"""Training jobs for the tests and benchmarks, kept out of the package: run a job on forked local
ranks and collect what it reported (rank 0's step rows and every rank's telemetry from a real unix
datagram socket), and an independent single-process reference loop to compare numerics against.

The reference is written out plainly (its own forward call, mean cross-entropy, clipping, AdamW
and learning-rate formula) so that a bug in the trainer's loss scaling, reduction or schedule
shows up as a difference instead of being shared by both sides.
"""

from __future__ import annotations

import json
import math
import os
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainguard.agent.wire import Telemetry, decode_telemetry, split_datagram
from trainguard.trainer.config import TrainConfig


def tiny_config(cache_dir: str, **changes: Any) -> TrainConfig:
    """A model small enough for CPU tests (2 layers, width 32, context 32) on a 2 MB corpus.

    ``changes`` are top-level keys; nested sections merge (``parallel={"dp": 2}``).
    """
    body: dict[str, Any] = {
        "model": {"layers": 2, "d_model": 32, "heads": 4, "context": 32},
        "data": {"cache_dir": cache_dir, "max_bytes": 2_000_000, "val_samples": 16},
        "optim": {"lr": 3e-3, "warmup": 1, "clip": 1.0},
        "steps": 3, "global_batch": 8,
    }
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(body.get(key), dict):
            body[key] = {**body[key], **value}
        else:
            body[key] = value
    return TrainConfig.from_dict(body)


class TelemetryCapture:
    """Binds a unix datagram socket and collects decoded telemetry in a thread until closed."""

    def __init__(self, path: str, on_message: Callable[[Telemetry], None] | None = None) -> None:
        self.path = path
        self.messages: list[Telemetry] = []
        self.errors: list[str] = []
        self.on_message = on_message
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(path)
        self._sock.settimeout(0.05)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                data = self._sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            for part in split_datagram(data):
                try:
                    msg = decode_telemetry(part)
                except ValueError as exc:
                    self.errors.append(str(exc))
                    continue
                self.messages.append(msg)
                if self.on_message is not None:
                    self.on_message(msg)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._sock.close()

    def by_rank(self) -> dict[int, list[Telemetry]]:
        out: dict[int, list[Telemetry]] = {}
        for m in sorted(self.messages, key=lambda m: (m.rank, m.step)):
            out.setdefault(m.rank, []).append(m)
        return out


@dataclass
class JobResult:
    rc: int
    rows: list[dict[str, Any]]
    telemetry: dict[int, list[Telemetry]] = field(default_factory=dict)
    telemetry_errors: list[str] = field(default_factory=list)

    @property
    def losses(self) -> list[float]:
        return [float(r["loss"]) for r in self.rows]


def _recording_entry(rows_path: str) -> Callable[[TrainConfig, bool], int]:
    def entry(cfg: TrainConfig, json_out: bool) -> int:
        from trainguard.trainer.parallel import RankEnv
        from trainguard.trainer.train import Trainer

        def sink(row: dict[str, Any]) -> None:
            with open(rows_path, "a") as fh:
                fh.write(json.dumps(row, allow_nan=True) + "\n")

        trainer = Trainer(cfg, RankEnv.from_env(), sink=sink)
        trainer.setup()
        try:
            return trainer.run()
        finally:
            trainer.close()
    return entry


def run_job(cfg: TrainConfig, nproc: int, workdir: str | os.PathLike[str], *, plan_path: str | None = None,
            on_telemetry: Callable[[Telemetry], None] | None = None, env: dict[str, str] | None = None) -> JobResult:
    """Run ``cfg`` on ``nproc`` forked ranks; rows from rank 0, telemetry from every rank."""
    from trainguard.trainer.launch import run_standalone
    work = Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    rows_path = work / "rows.jsonl"
    rows_path.unlink(missing_ok=True)
    sock_path = str(work / "telemetry.sock")
    if os.path.exists(sock_path):
        os.unlink(sock_path)
    capture = TelemetryCapture(sock_path, on_telemetry)
    job_env = {"TRAINGUARD_SOCKET": sock_path, "TRAINGUARD_JOB": "test", **(env or {})}
    if plan_path:
        job_env["TRAINGUARD_PLAN"] = plan_path
    try:
        rc = run_standalone(cfg, nproc, env=job_env, entry=_recording_entry(str(rows_path)))
    finally:
        # Datagrams already sent are queued in the socket; give the thread a moment to read them.
        import time
        deadline = time.monotonic() + 1.0
        expected = cfg.steps * nproc
        while len(capture.messages) < expected and time.monotonic() < deadline:
            time.sleep(0.02)
        capture.close()
    rows = [json.loads(line) for line in rows_path.read_text().splitlines()] if rows_path.exists() else []
    return JobResult(rc, rows, capture.by_rank(), capture.errors)


@dataclass
class Reference:
    losses: list[float]
    grad_norms: list[float]
    state: dict[str, Any]
    val_loss: float


def reference_run(cfg: TrainConfig, steps: int | None = None) -> Reference:
    """Train the whole model in this process on the same global batches (pre-clip norms too)."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    from trainguard.trainer.data import Corpus, Sampler, windows
    from trainguard.trainer.model import build_stage

    torch.set_num_threads(1)
    model = build_stage(cfg.model, cfg.seed)
    corpus = Corpus.load(cfg.data.cache_dir, cfg.data.max_bytes)
    sampler = Sampler(len(corpus.train) // (cfg.model.context + 1), cfg.seed)
    o = cfg.optim
    decay = [p for p in model.parameters() if p.ndim >= 2]
    other = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": o.weight_decay},
                             {"params": other, "weight_decay": 0.0}], lr=o.lr, betas=(o.beta1, o.beta2))
    losses: list[float] = []
    norms: list[float] = []
    n_steps = cfg.steps if steps is None else steps
    for step in range(n_steps):
        idx = sampler.take(cfg.global_batch)
        batch = torch.from_numpy(windows(corpus.train, cfg.model.context, np.asarray(idx)))
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, 256), batch[:, 1:].reshape(-1))
        loss.backward()
        norm = math.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in model.parameters() if p.grad is not None))
        if o.clip and norm > o.clip:
            for p in model.parameters():
                assert p.grad is not None
                p.grad.mul_(o.clip / (norm + 1e-6))
        if o.warmup and step < o.warmup:
            lr = o.lr * (step + 1) / o.warmup
        elif o.cosine:
            prog = min(1.0, (step - o.warmup) / max(1, cfg.steps - o.warmup))
            lr = o.lr * (o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * prog)))
        else:
            lr = o.lr
        for g in opt.param_groups:
            g["lr"] = lr
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
        norms.append(norm)
    from trainguard.trainer.data import val_index
    vidx = val_index(len(corpus.val) // (cfg.model.context + 1), cfg.data.val_samples)
    vb = torch.from_numpy(windows(corpus.val, cfg.model.context, vidx))
    with torch.no_grad():
        val = float(F.cross_entropy(model(vb[:, :-1]).reshape(-1, 256), vb[:, 1:].reshape(-1)))
    return Reference(losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()}, val)
