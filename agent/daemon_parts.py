"""The agent's parts that its configuration alone decides: the rank user, the TLS contexts, the
peer token, the launcher with its job cgroups, and the collectors. A bad setting is a ConfigError
naming its key; ``Agent.start()`` assigns what these return.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainguard.agent.api.auth import TokenFileError, read_client_token
from trainguard.agent.api.tls import TlsConfigError, TlsFiles, client_context, server_context
from trainguard.agent.collectors.base import Collector, CollectorUnavailable
from trainguard.agent.collectors.ebpf import EbpfCollector
from trainguard.agent.collectors.gpu import GpuCollector, Nvml
from trainguard.agent.collectors.host import HostCollector
from trainguard.agent.config import AgentConfig, ConfigError
from trainguard.agent.lifecycle.cgroups import CgroupError, JobCgroups
from trainguard.agent.lifecycle.launcher import Launcher
from trainguard.agent.lifecycle.rankenv import RankUser, RankUserError
from trainguard.agent.lifecycle.units import under_systemd
from trainguard.agent.paths import agent_tag

log = logging.getLogger("trainguard.agent")

CollectorEvent = Callable[[str, dict[str, Any]], None]


def rank_user(cfg: AgentConfig) -> RankUser | None:
    """``launcher.user`` looked up (None: unset). Refused with a ConfigError naming the key: an
    unknown user, uid 0, or a user whose group is the control socket's (the agent's own group),
    since the telemetry socket is given to that group and the ranks must never reach the
    control API through it."""
    name = cfg.launcher.user
    if not name:
        return None
    try:
        user = RankUser.lookup(name)
    except RankUserError as exc:
        raise ConfigError("launcher.user", str(exc).split(": ", 1)[-1]) from None
    if user.uid == 0:
        raise ConfigError("launcher.user", f"{name!r} has uid 0: ranks would run as root")
    if user.gid == os.getegid():
        raise ConfigError("launcher.user", f"{name!r} has group {user.gid}, the control socket's group (the "
                                           "agent's): its ranks could drive the agent; choose a user of another group")
    return user


def metrics_tls(cfg: AgentConfig) -> Any:
    """The /metrics server's TLS context (None: plain HTTP); a bad file is a ConfigError naming its key."""
    m = cfg.metrics
    files = TlsFiles(m.tls_cert, m.tls_key, m.tls_ca, m.tls_client_auth)
    if not files.enabled:
        return None
    try:
        return server_context(files, prefix="metrics")
    except TlsConfigError as exc:
        key, _, why = str(exc).partition(": ")
        raise ConfigError(key, why) from None


def api_tls(cfg: AgentConfig) -> tuple[Any, Any]:
    """(server, client) SSL contexts of the TCP API from ``[api] tls_*`` (None, None without a
    certificate); a missing or bad file refuses the start with a ConfigError naming the key."""
    api = cfg.api
    files = TlsFiles(api.tls_cert, api.tls_key, api.tls_ca, api.tls_client_auth)
    if not files.enabled:
        return (None, None)
    try:
        return (server_context(files), client_context(files))
    except TlsConfigError as exc:
        key, _, why = str(exc).partition(": ")
        raise ConfigError(key, why) from None


def peer_token(cfg: AgentConfig) -> str | None:
    path = cfg.cluster.peer_token_file or cfg.api.token_file
    if not path:
        return None
    try:
        return read_client_token(Path(path))
    except TokenFileError as exc:
        # Name the key the file came from: a bad api.token_file is not a peer_token_file problem.
        key = "cluster.peer_token_file" if cfg.cluster.peer_token_file else "api.token_file"
        raise ConfigError(key, str(exc)) from None


def make_launcher(cfg: AgentConfig) -> tuple[Launcher, str]:
    """The launcher of the configured kind, and why job cgroups are what they are."""
    mode = cfg.launcher.systemd_units
    units = mode == "on" or (mode == "auto" and under_systemd())
    if mode == "on" and not under_systemd():
        raise ConfigError("launcher.systemd_units", "on, but the agent does not run as a systemd service")
    if units:
        log.info("ranks run as transient systemd units, outside the agent's sandbox (warm launcher off)")
        return Launcher(mode="cold", units=True, log_max_bytes=cfg.launcher.log_max_bytes,
                        log_keep=cfg.launcher.log_keep), "systemd units (a slice per job)"
    cgroups, reason = job_cgroups(cfg)
    return Launcher(mode="warm" if cfg.recovery.warm_launcher else "cold", cgroups=cgroups,
                    log_max_bytes=cfg.launcher.log_max_bytes, log_keep=cfg.launcher.log_keep), reason


def job_cgroups(cfg: AgentConfig) -> tuple[Any, str]:
    """Where job cgroups are made (None: launcher.cgroups is off, or auto and not possible here),
    and why."""
    mode = cfg.launcher.cgroups
    if mode == "off":
        return None, "off in config (launcher.cgroups)"
    try:
        found = JobCgroups.detect(parent=f"trainguard-{agent_tag(cfg.agent.state_dir)}")
    except CgroupError as exc:
        if mode == "on":
            raise ConfigError("launcher.cgroups", f"on, but {exc}") from None
        log.warning("job cgroups off: %s", exc)
        return None, f"not available: {exc}"
    return found, f"cgroup {found.version}"


def start_collectors(cfg: AgentConfig, on_event: CollectorEvent, *, print_bpf: bool = False,
                     nvml_module: Any = None) -> tuple[list[Collector], dict[str, tuple[bool, str | None]]]:
    """Start the configured collectors; one that cannot run here is left out. Returns those that
    started and, per collector name, (up, why not)."""
    wanted: list[tuple[str, Callable[[], Collector]]] = []
    c = cfg.collectors
    if c.host:
        wanted.append(("host", HostCollector))
    if c.ebpf:
        wanted.append(("ebpf", lambda: EbpfCollector(on_event, interval=cfg.agent.interval_s, print_bpf=print_bpf)))
    if c.gpu:
        wanted.append(("gpu", lambda: GpuCollector(on_event, Nvml(module=nvml_module), cfg.gpu)))
    started: list[Collector] = []
    state: dict[str, tuple[bool, str | None]] = {}

    def down(name: str, reason: str) -> None:
        state[name] = (False, reason)
        log.warning("collector %s is off: %s", name, reason)

    for name, factory in wanted:
        try:
            collector = factory()
            collector.start()
        except CollectorUnavailable as exc:
            down(name, str(exc))
            continue
        except Exception as exc:  # noqa: BLE001 - a broken collector must not stop the agent
            down(name, f"failed to start: {type(exc).__name__}: {exc}")
            continue
        started.append(collector)
        state[name] = (True, None)
    for name in ("host", "ebpf", "gpu"):
        if name not in state:
            state[name] = (False, "disabled in config")
    return started, state
