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
import os
import sys
import tomllib
import typing
from pathlib import Path
from typing import Any

from agent.cluster.config import ClusterConfig
from agent.cluster.service import ClusterService
from agent.config import AgentConfig, ConfigError, apply_state_dir, load_config
from agent.daemon import Agent, _safe_fields


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
    def __init__(self, cfg: AgentConfig, cluster_cfg: ClusterConfig, config_path: str | None = None) -> None:
        super().__init__(cfg, config_path)
        self.cluster_cfg = cluster_cfg

    def _peer_token(self) -> str | None:
        from agent.api.auth import TokenFileError, read_client_token

        path = self.cluster_cfg.peer_token_file or self.cfg.api.token_file
        if not path:
            return None
        try:
            return read_client_token(Path(path))
        except TokenFileError as exc:
            raise ConfigError("cluster.peer_token_file", str(exc)) from None

    def _cluster_event(self, kind: str, message: str, fields: dict[str, Any]) -> None:
        fields = dict(fields)
        severity = str(fields.pop("severity", "info"))
        job = fields.pop("job", None)
        cause = str(fields.pop("cause_", ""))
        self.events.emit(kind, message, severity=severity, job=job if isinstance(job, str) else None,
                         cause=cause, **_safe_fields(fields))

    # wiring point 1 + 2: the peer tier goes into the checkpoint manager, the blob store is exposed
    def _start_recovery(self) -> None:
        from agent.checkpoint import CheckpointManager
        from agent.recovery.service import RecoveryService, checkpoint_settings

        settings = checkpoint_settings(self.cfg)
        self.cluster = ClusterService(self.cluster_cfg, node=self.cfg.agent.node, memory_root=settings.memory_root,
                                      token=self._peer_token(), emit=self._cluster_event,
                                      on_adopt=lambda job, when: self.recovery.note_failure(job, "node_lost", when))
        self.blob_store = self.cluster.store
        self.checkpoints = CheckpointManager(settings, emit=self._on_checkpoint_event,
                                             extra_tiers=self.cluster.tiers,
                                             extra_intervals=self.cluster.intervals,
                                             extra_keep=self.cluster.keep)
        self.checkpoints.start()
        self.recovery = RecoveryService(self, self.checkpoints)
        self.supervisor.launch_env = self.recovery.launch_env
        self.tick_hooks.append(self.recovery.tick)
        self.checkpoint_catalog = self.checkpoints.catalog
        self.rollback = self.recovery.rollback
        self.exclude_rank = self.recovery.exclude_rank
        self.events.subscribe(self._watch_failures)

    # wiring point 3: join the cluster once peers can reach our API
    def _start_api(self) -> None:
        super()._start_api()
        self.exporter.sources.append(self.cluster)
        tcp = self.api.tcp_address
        self.cluster.start(f"{tcp[0]}:{tcp[1]}" if tcp else None, self.supervisor, self.plans)
        with open(os.path.join(self.cfg.agent.run_dir, "api.addr"), "w") as fh:
            fh.write(f"{tcp[0]}:{tcp[1]}\n" if tcp else "\n")

    # wiring point 4: leave the cluster first (resign leadership, release the lease)
    def shutdown(self) -> None:
        cluster = getattr(self, "cluster", None)
        if cluster is not None:
            cluster.stop(leave=True)
        super().shutdown()


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
