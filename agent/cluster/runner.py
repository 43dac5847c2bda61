"""An agent with the cluster part wired in, until the daemon itself reads a ``[cluster]`` section.

``ClusterAgent`` is ``agent.daemon.Agent`` plus exactly the four wiring points the daemon needs
(the integrator moves them into ``Agent``; see the report / docs): build the ``ClusterService``
before the checkpoint manager and hand its peer tier to it, expose ``blob_store`` before the API
starts, start the cluster once the TCP API is bound, stop it first on shutdown.

    python -m agent.cluster.runner --state-dir DIR --config agent.toml --cluster-config cluster.toml

``cluster.toml`` holds the keys of ``ClusterConfig`` (top level, or under ``[cluster]``).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tomllib
import typing
from typing import Any

from agent.cluster.config import ClusterConfig
from agent.config import AgentConfig, ConfigError, apply_state_dir, load_config
from agent.daemon import Agent


def load_cluster_config(path: str | None) -> ClusterConfig:
    """Read a ``ClusterConfig`` from TOML; errors name the key (``cluster.<key>: ...``)."""
    if path is None:
        return ClusterConfig()
    try:
        with open(path, "rb") as fh:
            table = tomllib.load(fh)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(f"cluster: cannot read {path}: {exc}") from None
    table = table.get("cluster", table)
    return cluster_config_from_dict(table)


def cluster_config_from_dict(table: dict[str, Any]) -> ClusterConfig:
    hints = typing.get_type_hints(ClusterConfig)
    names = {f.name for f in dataclasses.fields(ClusterConfig)}
    for key, value in table.items():
        if key not in names:
            raise ValueError(f"cluster.{key}: unknown key (known: {', '.join(sorted(names))})")
        tp = hints[key]
        ok = (isinstance(value, list) and all(isinstance(v, str) for v in value)) if typing.get_origin(tp) is list \
            else (isinstance(value, int | float) and not isinstance(value, bool)) if tp is float \
            else isinstance(value, tp) and not (tp is int and isinstance(value, bool))
        if not ok:
            raise ValueError(f"cluster.{key}: expected {getattr(tp, '__name__', tp)}, got {value!r}")
    return ClusterConfig(**table)


class ClusterAgent(Agent):
    """The daemon with a ``ClusterConfig`` given apart from the agent config (the daemon itself
    reads the same keys from its ``[cluster]`` section)."""

    def __init__(self, cfg: AgentConfig, cluster_cfg: ClusterConfig, config_path: str | None = None) -> None:
        cfg.cluster = cluster_cfg
        super().__init__(cfg, config_path)
        self.cluster_cfg = cluster_cfg


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m agent.cluster.runner")
    p.add_argument("--config")
    p.add_argument("--cluster-config")
    p.add_argument("--state-dir")
    p.add_argument("--metrics-addr")
    args = p.parse_args(argv)
    try:
        cfg = load_config(args.config, must_exist=args.config is not None)
        if args.state_dir:
            apply_state_dir(cfg, args.state_dir)
        if args.metrics_addr is not None:
            cfg.metrics.addr = args.metrics_addr
        cluster_cfg = load_cluster_config(args.cluster_config)
    except (ConfigError, ValueError) as exc:
        print(f"trainguard: config error: {exc}", file=sys.stderr)
        return 2
    return ClusterAgent(cfg, cluster_cfg, config_path=args.config).run()


if __name__ == "__main__":
    sys.exit(main())
