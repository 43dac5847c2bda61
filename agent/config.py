"""Agent configuration: typed dataclasses loaded from TOML and validated at load.

Every defect is reported as one ``ConfigError`` naming the dotted key (``detection.window: must be
>= 3``), which the CLI prints as one line with exit code 2. Built-in defaults let the agent run with
no file at all.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import tomllib
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

# Sections owned by their modules; ConfigError lives apart so they raise it without a cycle.
from trainguard.agent.cluster.config import ClusterConfig
from trainguard.agent.collectors.gpu.config import GpuCollectorConfig
from trainguard.agent.configerror import ConfigError as ConfigError
from trainguard.agent.controller.config import ControllerConfig
from trainguard.agent.detect.config import StragglerConfig

DEFAULT_CONFIG_PATH = "/etc/trainguard/agent.toml"
DEFAULT_STATE_DIR = "/var/lib/trainguard"
DEFAULT_RUN_DIR = "/run/trainguard"
DEFAULT_METRICS_PORT = 9478


def _positive(key: str, value: float) -> None:
    if value <= 0:
        raise ConfigError(key, f"must be > 0, got {value}")


def _host_port(key: str, value: str, allow_empty: bool) -> None:
    if not value and allow_empty:
        return
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not (0 <= int(port) <= 65535):
        raise ConfigError(key, f"expected HOST:PORT, got {value!r}")


@dataclass
class AgentSection:
    node: str = field(default_factory=socket.gethostname)
    """Name of this node in events, metrics and the cluster."""
    state_dir: str = DEFAULT_STATE_DIR
    """Event log, disk checkpoint tier and job state live here."""
    run_dir: str = DEFAULT_RUN_DIR
    """Runtime sockets (agent.sock, telemetry.sock) and plan files."""
    interval_s: float = 1.0
    """Main loop period: collectors are read and detectors run once per interval."""
    on_stop: Literal["stop_ranks", "leave_ranks"] = "stop_ranks"
    """On SIGTERM: stop the ranks cleanly, or leave them running for the next agent to adopt."""
    job_retention_s: float = 3600.0
    """A finished job stays in status, events' job views and /metrics this long, then is forgotten."""

    heartbeat_stale_s: float = 60.0
    """A supervised thread (rank monitor, telemetry, API, cluster, /metrics) without a heartbeat for
    this long is stuck: the agent reports itself unhealthy and stops feeding the systemd watchdog."""

    def validate(self, key: str) -> None:
        _positive(f"{key}.interval_s", self.interval_s)
        _positive(f"{key}.job_retention_s", self.job_retention_s)
        _positive(f"{key}.heartbeat_stale_s", self.heartbeat_stale_s)
        if not self.node:
            raise ConfigError(f"{key}.node", "must not be empty")


@dataclass
class ApiSection:
    tcp: str = ""
    """HOST:PORT of the cross-node API (empty: unix socket only). Every request needs a token."""
    token_file: str = ""
    """File of bearer tokens (`token [read|admin]` per line); required when tcp is set."""
    unix_requires_token: bool = False
    """Local clients are gated by the socket's 0660 mode unless this is set."""
    tls_cert: str = ""
    """PEM certificate (chain) of this agent: the TCP API serves HTTPS with it, and the agent
    presents it when it calls other agents (mutual TLS)."""
    tls_key: str = ""
    """PEM private key of ``tls_cert`` (empty: in the same file)."""
    tls_ca: str = ""
    """PEM CA bundle other agents' certificates must chain to: the agents this one calls are
    verified against it, and with ``tls_client_auth`` the agents that call this one."""
    tls_client_auth: bool = False
    """Refuse TCP clients without a client certificate from ``tls_ca`` (mutual TLS between agents;
    remote dashboards then need a certificate too)."""
    allow_plaintext: bool = False
    """Serve the TCP API without TLS: bearer tokens and checkpoint bytes cross the network in clear,
    and callers carry no node identity. Only for loopback or a network nobody else reaches; the
    agent warns at every start."""
    header_timeout_s: float = 10.0
    """A request's whole head must arrive within this (slowloris clients are cut there)."""
    max_connections_per_peer: int = 16
    """TCP connections served at once per client address (of 64 in all)."""

    def validate(self, key: str) -> None:
        _host_port(f"{key}.tcp", self.tcp, allow_empty=True)
        if self.tcp and not self.token_file:
            raise ConfigError(f"{key}.token_file", "required when api.tcp is set")
        if self.tcp and not self.tls_cert and not self.allow_plaintext:
            raise ConfigError(f"{key}.tls_cert", "required when api.tcp is set: bearer tokens and checkpoints must "
                                                 "not cross the network in clear (or set api.allow_plaintext = true)")
        if self.tls_client_auth and not self.tls_ca:
            raise ConfigError(f"{key}.tls_ca", "required when api.tls_client_auth is true")
        if (self.tls_key or self.tls_client_auth) and not self.tls_cert:
            raise ConfigError(f"{key}.tls_cert", "required with api.tls_key / api.tls_client_auth")
        if self.tcp and self.tls_cert and not self.tls_client_auth:
            raise ConfigError(f"{key}.tls_client_auth", "must be true when api.tcp serves TLS: every node's certificate "
                                                        "names it, and node-scoped requests are checked against it")
        _positive(f"{key}.header_timeout_s", self.header_timeout_s)
        if isinstance(self.max_connections_per_peer, bool) or not isinstance(self.max_connections_per_peer, int) \
                or self.max_connections_per_peer < 1:
            raise ConfigError(f"{key}.max_connections_per_peer", "must be an integer >= 1")


@dataclass
class MetricsSection:
    addr: str = f"127.0.0.1:{DEFAULT_METRICS_PORT}"
    """HOST:PORT for the read-only Prometheus /metrics endpoint (empty: off). Loopback by default:
    a Prometheus on another host needs it widened explicitly (e.g. "0.0.0.0:9478")."""
    max_connections: int = 16
    """Connections served at once; more are answered 503 and closed."""
    timeout_s: float = 10.0
    """Per read/write, and for a whole connection: a slow client is closed after this long."""
    tls_cert: str = ""
    """PEM certificate (chain): /metrics is served over HTTPS with it (empty: plain HTTP)."""
    tls_key: str = ""
    """PEM private key of ``tls_cert`` (empty: in the same file)."""
    tls_ca: str = ""
    """PEM CA bundle scrapers' client certificates must chain to (with ``tls_client_auth``)."""
    tls_client_auth: bool = False
    """Refuse scrapers without a client certificate from ``tls_ca`` (mutual TLS)."""

    def validate(self, key: str) -> None:
        _host_port(f"{key}.addr", self.addr, allow_empty=True)
        if not (1 <= self.max_connections <= 4096):
            raise ConfigError(f"{key}.max_connections", f"must be in [1, 4096], got {self.max_connections}")
        _positive(f"{key}.timeout_s", self.timeout_s)
        if self.tls_client_auth and not self.tls_ca:
            raise ConfigError(f"{key}.tls_ca", "required when metrics.tls_client_auth is true")
        if (self.tls_key or self.tls_client_auth) and not self.tls_cert:
            raise ConfigError(f"{key}.tls_cert", "required with metrics.tls_key / metrics.tls_client_auth")


@dataclass
class EventLogSection:
    max_bytes: int = 16 * 1024 * 1024
    """Rotate the JSON-lines event log when it grows past this size."""
    keep: int = 5
    """Rotated files kept besides the live one."""

    def validate(self, key: str) -> None:
        if self.max_bytes < 4096:
            raise ConfigError(f"{key}.max_bytes", "must be >= 4096")
        if self.keep < 1:
            raise ConfigError(f"{key}.keep", "must be >= 1")


@dataclass
class TelemetrySection:
    ring: int = 512
    """Recent steps kept per rank."""
    accept_unknown_jobs: bool = True
    """Keep telemetry from jobs this agent did not launch (e.g. torchrun jobs pointed at the socket)."""
    min_queue: int = 0
    """Raise net.unix.max_dgram_qlen to at least this at start (root; host-wide; 0 leaves it). The
    kernel default of 10 queued datagrams loses telemetry at the sender whenever the agent stalls."""
    max_foreign_jobs: int = 64
    """At most this many jobs the agent did not launch are kept (more: their datagrams are dropped
    and counted), so a local process inventing job ids cannot grow the agent's tables."""
    foreign_idle_s: float = 300.0
    """A job the agent did not launch that sent nothing for this long is evicted, so stale torchrun
    jobs never keep new ones out."""
    max_bytes: int = 256 << 20
    """Byte budget of the telemetry table (estimated). Past it ranks keep only their newest
    detection window of steps and new ranks are dropped (``table_bytes``)."""

    def validate(self, key: str) -> None:
        if self.ring < 16:
            raise ConfigError(f"{key}.ring", "must be >= 16")
        if not (0 <= self.max_foreign_jobs <= 1 << 16):
            raise ConfigError(f"{key}.max_foreign_jobs", "must be in [0, 65536]")
        _positive(f"{key}.foreign_idle_s", self.foreign_idle_s)
        if self.max_bytes < 1 << 20:
            raise ConfigError(f"{key}.max_bytes", f"must be >= 1048576 (1 MiB), got {self.max_bytes}")
        if not (0 <= self.min_queue <= 1 << 20):
            raise ConfigError(f"{key}.min_queue", "must be in [0, 1048576]")


@dataclass
class CollectorsSection:
    host: bool = True
    """Host counters from /proc (CPU, memory, network, disk)."""
    ebpf: bool = True
    """Kernel collectors through eBPF (run-queue, off-CPU, block I/O, TCP, faults, exits, OOM kills);
    they need root or CAP_BPF+CAP_PERFMON, bcc and kernel headers, and are off with a reason otherwise."""
    gpu: bool = True
    """GPU metrics and events through NVML; off with a reason where no NVIDIA driver answers."""

    def validate(self, key: str) -> None:
        return None


@dataclass
class LauncherSection:
    python: str = ""
    """Interpreter for rank processes (empty: the agent's own)."""
    user: str = ""
    """Run ranks as this user (empty: as the agent's user with every capability dropped, i.e. as
    root under a root agent: then whoever may submit a job is root-equivalent). The telemetry
    socket is given to its group, so that group may not be the agent's (the control socket's)."""
    master_addr: str = "127.0.0.1"
    """``MASTER_ADDR`` the ranks of a job on this node meet at (their rendezvous store's host)."""
    stop_grace_s: float = 10.0
    """SIGTERM -> SIGKILL grace period when stopping ranks."""
    cgroups: Literal["auto", "on", "off"] = "auto"
    """A cgroup per job (``trainguard/<job>``; v2, or the v1 cpu/cpuacct/memory/pids controllers):
    "auto" when the agent may make them (root), "on" refuses to start without, "off" never."""
    systemd_units: Literal["auto", "on", "off"] = "auto"
    """Ranks as transient systemd units (outside the agent's sandbox and cgroup): "auto" when the
    agent runs as a systemd service; the warm launcher is not used then."""
    job_cpus: float = 0.0
    """Default CPU quota of a job's cgroup, in CPUs (0: none; a job's ``cpus`` overrides it)."""
    job_memory_max: int = 0
    """Default memory ceiling of a job's cgroup in bytes (0: none; a job's ``memory_max`` overrides it)."""
    log_max_bytes: int = 64 << 20
    """A rank's log (``<state>/jobs/<job>/rank<N>.log``) is rotated when it grows past this."""
    log_keep: int = 3
    """Rotated logs kept per rank (``rank<N>.log.1`` newest)."""

    def validate(self, key: str) -> None:
        _positive(f"{key}.stop_grace_s", self.stop_grace_s)
        if self.log_max_bytes < 4096:
            raise ConfigError(f"{key}.log_max_bytes", f"must be >= 4096, got {self.log_max_bytes}")
        if not (1 <= self.log_keep <= 100):
            raise ConfigError(f"{key}.log_keep", f"must be in [1, 100], got {self.log_keep}")
        if self.job_cpus < 0:
            raise ConfigError(f"{key}.job_cpus", f"must be >= 0, got {self.job_cpus}")
        if self.job_memory_max != 0 and self.job_memory_max < 16 << 20:
            raise ConfigError(f"{key}.job_memory_max", f"bytes, at least 16 MiB (or 0), got {self.job_memory_max}")


@dataclass
class ObjectStoreSection:
    url: str = ""
    """``s3://bucket/prefix`` or ``file:///path``; empty disables the object tier."""
    endpoint_url: str = ""
    """S3-compatible endpoint (MinIO, Ceph); empty: AWS."""
    key: str = ""
    """Access key id (with ``secret``); empty: the default credential chain."""
    secret: str = ""
    """Secret access key; a file that holds one must be ``chmod 600`` or the agent refuses it."""
    region: str = ""
    """S3 region (empty: the endpoint's default)."""

    def validate(self, key: str) -> None:
        if self.url and not (self.url.startswith("s3://") or self.url.startswith("file://")):
            raise ConfigError(f"{key}.url", f"must start with s3:// or file://, got {self.url!r}")


@dataclass
class CheckpointSection:
    memory_root: str = ""
    """Shared-memory root of the memory tier (empty: /dev/shm/trainguard-<hash of state_dir>)."""
    memory_every: int = 100
    """Steps between memory-tier checkpoints (the ranks' only checkpoint stall)."""
    memory_keep: int = 2
    """Memory-tier checkpoints kept per job."""
    snapshots: bool = True
    """Per-step snapshots of every rank's state in shared memory (a rank crash loses the step
    that was running and at most ``snapshot_every`` - 1 more, or ``snapshot_every`` when it lands
    while the newest snapshot is still being copied; ``trainguard.checkpoint.snapshot.writer``)."""
    snapshot_every: int = 0
    """Steps between snapshots; 0: chosen by each rank from its measured stall, the fewest steps
    (1, 2, 4, ... 64) that keep snapshots within 1% of its step time (a stall counted as many times
    over as the node's ranks outnumber its cores: ``trainguard.checkpoint.snapshot.cost.cost_scale``)."""
    disk_dir: str = ""
    """Disk tier directory (empty: <state_dir>/checkpoints)."""
    disk_every: int = 500
    """Steps between copies of the newest memory checkpoint to disk (one each time ``step // disk_every``
    advances), made in the background."""
    disk_keep: int = 3
    """Disk-tier checkpoints kept per job."""
    object_every: int = 2000
    """Steps between copies of the newest memory checkpoint to the object tier."""
    object_keep: int = 3
    """Object-tier checkpoints kept per job."""
    object: ObjectStoreSection = field(default_factory=ObjectStoreSection)

    def validate(self, key: str) -> None:
        for name in ("memory_every", "memory_keep", "disk_every", "disk_keep", "object_every", "object_keep"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{key}.{name}", f"must be >= 1, got {getattr(self, name)}")
        if self.snapshot_every < 0:
            raise ConfigError(f"{key}.snapshot_every", f"must be >= 0 (0: automatic), got {self.snapshot_every}")
        for name in ("memory_root", "disk_dir"):
            value = getattr(self, name)
            if value and not os.path.isabs(value):
                raise ConfigError(f"{key}.{name}", f"must be an absolute path, got {value!r}")
        self.object.validate(f"{key}.object")


@dataclass
class RecoverySection:
    max_restarts: int = 3
    """Restarts without progress before a job is declared a crash loop and stopped."""
    hang_factor: float = 10.0
    """A job hangs when no rank advanced for hang_factor x its median step time ..."""
    hang_floor_s: float = 30.0
    """... and at least this long."""
    startup_timeout_s: float = 180.0
    """A (re)started job that has not finished its first step after this long hangs."""
    loss_spike_factor: float = 4.0
    """Loss above this factor x its recent median (or NaN/inf) is divergence: roll back."""
    rollback_lr_factor: float = 0.5
    """LR scale multiplier applied after a rollback for divergence."""
    warm_launcher: bool = True
    """Fork ranks from a zygote that pre-imported torch (restart in ~1 s instead of ~10 s)."""

    def validate(self, key: str) -> None:
        if self.max_restarts < 0:
            raise ConfigError(f"{key}.max_restarts", "must be >= 0")
        if self.hang_factor <= 1:
            raise ConfigError(f"{key}.hang_factor", "must be > 1")
        _positive(f"{key}.hang_floor_s", self.hang_floor_s)
        _positive(f"{key}.startup_timeout_s", self.startup_timeout_s)
        if self.loss_spike_factor <= 1:
            raise ConfigError(f"{key}.loss_spike_factor", "must be > 1")
        if not (0 < self.rollback_lr_factor <= 1):
            raise ConfigError(f"{key}.rollback_lr_factor", "must be in (0, 1]")


@dataclass
class AgentConfig:
    agent: AgentSection = field(default_factory=AgentSection)
    api: ApiSection = field(default_factory=ApiSection)
    metrics: MetricsSection = field(default_factory=MetricsSection)
    eventlog: EventLogSection = field(default_factory=EventLogSection)
    telemetry: TelemetrySection = field(default_factory=TelemetrySection)
    collectors: CollectorsSection = field(default_factory=CollectorsSection)
    gpu: GpuCollectorConfig = field(default_factory=GpuCollectorConfig)
    launcher: LauncherSection = field(default_factory=LauncherSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    recovery: RecoverySection = field(default_factory=RecoverySection)
    detection: StragglerConfig = field(default_factory=StragglerConfig)
    controller: ControllerConfig = field(default_factory=ControllerConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)

    def validate(self) -> None:
        for f in dataclasses.fields(self):
            section = getattr(self, f.name)
            # Sections owned by their modules validate themselves in __post_init__.
            if hasattr(section, "validate"):
                section.validate(f.name)


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _coerce(key: str, tp: Any, value: Any) -> Any:
    origin = typing.get_origin(tp)
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            raise ConfigError(key, f"must be one of {', '.join(map(repr, allowed))}, got {value!r}")
        return value
    if origin in (types.UnionType, typing.Union):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _coerce(key, args[0], value)
    if origin is list:
        (item,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(key, f"expected a list, got {type(value).__name__}")
        return [_coerce(f"{key}[{i}]", item, v) for i, v in enumerate(value)]
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(key, f"expected a table, got {type(value).__name__}")
        return _build(tp, value, key)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(key, f"expected true or false, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(key, f"expected a number, got {value!r}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(key, f"expected an integer, got {value!r}")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(key, f"expected a string, got {value!r}")
        return value
    raise ConfigError(key, f"unsupported type {_type_name(tp)}")


def _build(cls: Any, table: dict[str, Any], prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in table:
        if key not in names:
            where = f"{prefix}.{key}" if prefix else key
            raise ConfigError(where, f"unknown key (known: {', '.join(sorted(names))})")
    kwargs = {}
    for name, value in table.items():
        kwargs[name] = _coerce(f"{prefix}.{name}" if prefix else name, hints[name], value)
    try:
        return cls(**kwargs)
    except ValueError as exc:
        if isinstance(exc, ConfigError):
            raise
        # Module-owned sections raise "section.key: why" from __post_init__.
        key, sep, why = str(exc).partition(": ")
        raise ConfigError(key if sep else prefix or "config", why if sep else str(exc)) from None


def config_from_dict(table: dict[str, Any]) -> AgentConfig:
    cfg: AgentConfig = _build(AgentConfig, table, "")
    cfg.validate()
    return cfg


SECRET_KEY_NAMES = frozenset({"secret", "password", "passphrase", "token", "secret_key", "access_token"})
"""Keys whose value is a credential when written inline in the config file."""


def _inline_secrets(table: dict[str, Any], prefix: str = "") -> list[str]:
    """Dotted keys of the non-empty credentials written in ``table``."""
    found = []
    for key, value in table.items():
        dotted = f"{prefix}.{key}" if prefix else key
        if isinstance(value, dict):
            found += _inline_secrets(value, dotted)
        elif key in SECRET_KEY_NAMES and isinstance(value, str) and value:
            found.append(dotted)
    return found


def check_secret_file_mode(path: str, table: dict[str, Any]) -> None:
    """A config file that holds a credential must be readable by its owner alone: refused at load
    otherwise, naming the key and the file, as ``ssh`` refuses a readable private key."""
    secrets = _inline_secrets(table)
    if not secrets:
        return
    try:
        mode = os.stat(path).st_mode & 0o777
    except OSError as exc:
        raise ConfigError(secrets[0], f"cannot check the mode of {path}: {exc.strerror or exc}") from None
    if mode & 0o077:
        raise ConfigError(secrets[0], f"holds a secret, but {path} is readable by group or others "
                                      f"(mode {mode:04o}): chmod 600 {path}")


def load_config(path: str | None, *, must_exist: bool = False) -> AgentConfig:
    """Load and validate. ``path`` None or a missing default file gives the built-in defaults."""
    if path is None or (not must_exist and not os.path.exists(path)):
        cfg = AgentConfig()
        cfg.validate()
        return cfg
    try:
        with open(path, "rb") as fh:
            table = tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError("config", f"no such file {path}") from None
    except PermissionError:
        raise ConfigError("config", f"cannot read {path}: permission denied") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("config", f"{path} is not valid TOML: {exc}") from None
    check_secret_file_mode(path, table)
    return config_from_dict(table)


def apply_state_dir(cfg: AgentConfig, state_dir: str) -> AgentConfig:
    """``--state-dir``: every file and socket of this agent under one directory."""
    cfg.agent.state_dir = state_dir
    cfg.agent.run_dir = os.path.join(state_dir, "run")
    return cfg


def parse_host_port(value: str) -> tuple[str, int]:
    host, _, port = value.rpartition(":")
    return (host or "0.0.0.0"), int(port)
