"""One training rank: ``python -m trainguard.trainer.worker``.

This is how the agent launches ranks. Configured entirely by the environment:

* ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` (torchrun conventions);
* ``TRAINGUARD_JOB_SPEC``: the ``TrainConfig`` as JSON text, or the path of a file holding it;
* ``TRAINGUARD_JOB`` (job id, default ``standalone``), ``TRAINGUARD_SOCKET`` (telemetry),
  ``TRAINGUARD_PLAN`` (plan file), ``TRAINGUARD_FAULTS`` (extra fault specs);
* ``TRAINGUARD_JSON=1``: rank 0 prints one JSON object per step on stdout.

Exit status: 0 done (or stopped by the plan), 2 bad configuration, 1 any other error.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from trainguard.agent.wire import ENV_JOB_SPEC
from trainguard.trainer.config import ConfigError, TrainConfig


def config_from_env(environ: dict[str, str] | None = None) -> TrainConfig:
    env = os.environ if environ is None else environ
    spec = env.get(ENV_JOB_SPEC, "").strip()
    if not spec:
        return TrainConfig()
    if not spec.startswith("{"):
        with open(spec) as fh:
            spec = fh.read()
    return TrainConfig.from_json(spec)


def print_row(row: dict[str, Any]) -> None:
    print(json.dumps(row, allow_nan=True), flush=True)


def print_human(row: dict[str, Any]) -> None:
    val = f" val {row['val_loss']:.4f}" if "val_loss" in row else ""
    print(f"step {row['step']:5d}  loss {row['loss']:.4f}{val}  lr {row['lr']:.2e}  "
          f"{row['tokens_per_s']:9.0f} tok/s  {row['step_s'] * 1000:7.1f} ms", flush=True)


def run_rank(cfg: TrainConfig, json_out: bool) -> int:
    """Set up and run one rank in this process (the environment names the rank)."""
    from trainguard.trainer.parallel import RankEnv
    from trainguard.trainer.train import Trainer
    trainer = Trainer(cfg, RankEnv.from_env(), sink=print_row if json_out else print_human)
    trainer.setup()
    try:
        return trainer.run()
    finally:
        trainer.close()


def main() -> int:
    try:
        cfg = config_from_env()
    except (ConfigError, OSError) as exc:
        print(f"trainguard worker: bad job spec: {exc}", file=sys.stderr)
        return 2
    return run_rank(cfg, os.environ.get("TRAINGUARD_JSON") == "1")


if __name__ == "__main__":
    sys.exit(main())
