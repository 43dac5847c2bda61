"""The node agent: wires collectors, telemetry, supervisor, exporter and the control API together
and runs the main loop (collect -> detect -> act -> watchdog) once per interval.

Signals: SIGTERM stops cleanly (ranks stopped or left, as configured; state flushed); SIGHUP
reloads the config file. Under systemd it reports READY/STATUS/WATCHDOG/STOPPING.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import platform
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainguard.agent import __version__, daemon_events, daemon_health, daemon_parts, rankpids
from trainguard.agent.agent_metrics import agent_metrics
from trainguard.agent.api.config import ApiConfig
from trainguard.agent.api.handler import ApiError
from trainguard.agent.api.server import ApiServer
from trainguard.agent.checkpoint import CheckpointManager
from trainguard.agent.checkpoint.objectstore import ObjectScope
from trainguard.agent.cluster.service import ClusterService
from trainguard.agent.collectors.base import Collector, TrackedProcess
from trainguard.agent.collectors.ebpf import EbpfCollector
from trainguard.agent.collectors.gpu import GpuCollector
from trainguard.agent.config import AgentConfig, ConfigError, load_config, parse_host_port
from trainguard.agent.control import AgentControl
from trainguard.agent.controller import Controller
from trainguard.agent.controller import install as install_controller
from trainguard.agent.detect import StragglerService
from trainguard.agent.detect import install as install_stragglers
from trainguard.agent.eventlog import EventLog
from trainguard.agent.exporter import (
    AgentExporter,
    HealthMetrics,
    TelemetryMetrics,
    serve_metrics,
    stop_metrics,
)
from trainguard.agent.heal.counts import ActionCounts
from trainguard.agent.heal.exclusion import Exclusion
from trainguard.agent.heal.gpu_faults import GpuFaults
from trainguard.agent.heal.rollback import Rollback
from trainguard.agent.health import Watch
from trainguard.agent.lifecycle.jobs import JobSpec
from trainguard.agent.lifecycle.plans import PlanStore
from trainguard.agent.lifecycle.rankenv import RankUser
from trainguard.agent.lifecycle.ranks import LaunchContext
from trainguard.agent.lifecycle.records import RecordStore
from trainguard.agent.lifecycle.supervisor import Supervisor
from trainguard.agent.metrics_http import MetricsServerLimits
from trainguard.agent.paths import AgentPaths
from trainguard.agent.privilege import FEATURE_OFF, features_off
from trainguard.agent.ranktable import RankTable, RankTableConfig
from trainguard.agent.recovery.service import RecoveryService, checkpoint_settings
from trainguard.agent.sdnotify import Notifier
from trainguard.agent.telemetry import TelemetryServer

log = logging.getLogger("trainguard.agent")

# A main-loop step (collect, detect, act) runs after each interval; these hooks are where the
# detectors and healers of later modules plug in. Each gets the agent and the current time.
TickHook = Callable[["Agent", float], None]


class Agent:
    """One node's agent: supervises the ranks it launched, watches every rank that reports to it,
    heals failures and serves the control API and /metrics.

    Every part is declared in ``__init__``, grouped by concern; those that bind sockets, start
    threads or read files are built by ``start()`` (in the order their collaborators need), the
    others here. A part that a configuration leaves out is ``None`` (``straggler``, the metrics
    server); no other module adds attributes. Services get the parts they use, not the agent.
    """

    def __init__(self, cfg: AgentConfig, config_path: str | None = None, *, print_bpf: bool = False,
                 nvml_module: Any = None) -> None:
        """``nvml_module``: a stand-in for ``pynvml`` (tests pass a fake NVML); None: the real one."""
        # --- configuration and the files it names -----------------------------------------------
        self.cfg = cfg
        """The configuration in force (``reload`` replaces it; paths and sockets stay as started)."""
        self.config_path = config_path
        self.print_bpf = print_bpf
        self.nvml_module = nvml_module
        self.paths = AgentPaths(cfg.agent.state_dir, cfg.agent.run_dir)
        self.rank_user: RankUser | None = None
        """``launcher.user`` looked up by ``start()`` (None: ranks run as the agent's user)."""
        self._tls: tuple[Any, Any] | None = None
        """The TCP API's (server, client) SSL contexts, made once on first use."""

        # --- the agent's own health and its reports ---------------------------------------------
        self.notifier = Notifier()
        self.health = Watch(cfg.agent.heartbeat_stale_s,
                            on_change=functools.partial(daemon_events.on_thread_health, self),
                            on_errors=functools.partial(daemon_events.on_thread_errors, self))
        """The long-lived threads whose heartbeats gate the systemd watchdog (agent.health)."""
        self.events: EventLog
        """The event log every part writes to (built first by ``start()``)."""
        self.started = time.time()
        self.ticks = 0

        # --- ranks: telemetry, plans, supervision -----------------------------------------------
        self.table: RankTable
        """The ranks' latest telemetry, per job and rank."""
        self.telemetry: TelemetryServer
        self.plans: PlanStore
        self.supervisor: Supervisor
        """Launches, watches and restarts the ranks of the jobs this agent runs."""
        self.cgroups_reason = ""
        """Why job cgroups are what they are (said once at start in a ``feature_off`` event)."""
        self.forwarded_in: dict[str, int] = {}
        """Telemetry messages other nodes forwarded here, per node (jobs spanning nodes)."""
        self._external: dict[int, TrackedProcess] = {}
        """Ranks of jobs this agent did not start that report to it (torchrun jobs), by pid."""
        self._managed_pids: dict[str, frozenset[int]] = {}
        self._sender_cache: dict[int, str] = {}
        self._oom_seen: dict[str, int] = {}

        # --- checkpoints and the cluster --------------------------------------------------------
        self.cluster: ClusterService
        """Membership, leader election, the peer tier and the blob store (its own leader without etcd)."""
        self.checkpoints: CheckpointManager

        # --- detection and healing (run once per tick) ------------------------------------------
        self.heal_counts = ActionCounts()
        """Healing actions taken, by job, action and cause (the recovery service exports them)."""
        self.rollback: Rollback
        """Restarts a diverged job from an older checkpoint with its LR cut."""
        self.exclude_rank: Exclusion
        """Restarts a job without one data-parallel replica (stragglers, failed GPUs, drains)."""
        self.recovery: RecoveryService
        """Acts on hangs and loss divergence, times recoveries, picks what each start restores."""
        self.gpu_faults: GpuFaults
        self.straggler: StragglerService | None = None
        """Straggler detection and shard migration (None: ``detection.enabled`` is off)."""
        self.controller: Controller
        """The LR/batch controller (installed with strategy "none" too: the LR follows healing)."""
        self.tick_hooks: list[TickHook] = []
        """Detectors and healers run after each collection, in order."""

        # --- collectors -------------------------------------------------------------------------
        self.collectors: list[Collector] = []
        """The collectors that started (a collector that cannot run here is left out)."""
        self.collector_state: dict[str, tuple[bool, str | None]] = {}
        """Per collector name: (up, why not)."""
        self.ebpf: EbpfCollector | None = None
        self.gpu: GpuCollector | None = None

        # --- outward: metrics and the control API -----------------------------------------------
        self.exporter: AgentExporter
        self.metrics_server: Any = None
        """The /metrics HTTP server (None: ``metrics.addr`` is empty)."""
        self.metrics_port: int | None = None
        self.control: AgentControl
        self.api: ApiServer
        self.api_tcp_port: int | None = None

        # --- the main loop ----------------------------------------------------------------------
        self._stop = threading.Event()
        self._reload = threading.Event()

    # --- start-up ---------------------------------------------------------------------------
    def start(self) -> None:
        """Build the parts declared in ``__init__`` that touch the system, in dependency order, and
        start their threads; the API answers last."""
        cfg = self.cfg
        self.rank_user = daemon_parts.rank_user(cfg)
        self.paths.ensure(ranks_traverse=self.rank_user is not None)
        self.events = EventLog(
            self.paths.events_dir, cfg.agent.node, max_bytes=cfg.eventlog.max_bytes, keep=cfg.eventlog.keep
        )
        self.table = RankTable(
            RankTableConfig(ring=cfg.telemetry.ring, accept_unknown_jobs=cfg.telemetry.accept_unknown_jobs,
                            max_foreign_jobs=cfg.telemetry.max_foreign_jobs, max_bytes=cfg.telemetry.max_bytes,
                            foreign_idle_s=cfg.telemetry.foreign_idle_s)
        )
        self.telemetry = TelemetryServer(
            self.paths.telemetry_socket, self.table, min_queue=cfg.telemetry.min_queue or None,
            # Ranks of launcher.user send through the socket's group, which is never the control socket's.
            group=self.rank_user.gid if self.rank_user is not None else None,
        )
        self.plans = PlanStore(self.paths.plans_dir)
        launcher, self.cgroups_reason = daemon_parts.make_launcher(cfg)
        self.supervisor = Supervisor(
            self.events,
            self.plans,
            launcher,
            self._launch_context,
            stop_grace_s=cfg.launcher.stop_grace_s,
            on_ranks_changed=functools.partial(rankpids.ranks_changed, self),
            # Its own jobs' telemetry is kept even with telemetry.accept_unknown_jobs = false.
            on_submit=self._register_job,
            records=RecordStore(self.paths.jobs_dir),
        )
        self.telemetry.sender_check = functools.partial(rankpids.sender_ok, self)
        self.telemetry.start()
        self._start_recovery()
        self._start_collectors()
        self._adopt_jobs()
        self.exporter = AgentExporter(
            sources=[HealthMetrics(self.health, lambda: self.metrics_server),
                     TelemetryMetrics(self.table, self.telemetry), *self.collectors, self.checkpoints, self.recovery, self],
            build_info={"version": __version__, "python": platform.python_version(), "node": cfg.agent.node},
            collector_status=lambda: dict(self.collector_state),
        )
        self._install_policies()
        if cfg.metrics.addr:
            host, port = parse_host_port(cfg.metrics.addr)
            limits = MetricsServerLimits(max_connections=cfg.metrics.max_connections, timeout_s=cfg.metrics.timeout_s)
            self.metrics_server, self.metrics_port = serve_metrics(self.exporter.registry, host, port, limits=limits,
                                                                    tls=daemon_parts.metrics_tls(cfg))
            _write_whole(self.paths.metrics_addr_file, f"{host}:{self.metrics_port}\n")
        # Before the API answers: whoever sees the agent up finds them in the log.
        for feature, message in features_off(euid=os.geteuid(), ebpf_wanted=cfg.collectors.ebpf,
                                             collectors=self.collector_state, cgroups_mode=cfg.launcher.cgroups,
                                             cgroups_reason=self.cgroups_reason):
            self.events.emit(FEATURE_OFF, message, feature=feature)
        self._start_api()
        daemon_health.watch_threads(self)
        with open(self.paths.pid_file, "w") as fh:
            fh.write(f"{os.getpid()}\n")
        self._write_discovery()
        self.events.emit(
            "agent_started",
            f"agent {__version__} started on {cfg.agent.node}",
            pid=os.getpid(),
            collectors={k: v[0] for k, v in self.collector_state.items()},
        )
        if not cfg.launcher.user and os.geteuid() == 0:
            # Said once per start: whoever may submit a job (the control socket's group, an admin
            # token) may then run code as root, without capabilities but as uid 0.
            self.events.emit("ranks_run_as_root", "ranks run as root without capabilities: no launcher.user is "
                             "set, so submitting a job is root-equivalent (set launcher.user to run them as a user)",
                             severity="warning", cause="launcher.user unset")
        self.notifier.ready(daemon_health.status_line(self))

    def _register_job(self, job: str) -> None:
        """Its telemetry is kept (even with accept_unknown_jobs off) for ranks below its world size."""
        record = self.supervisor.jobs.get(job)
        world = None
        if record is not None:
            world = max(record.spec.nproc, record.block.world_size if record.block is not None else 0)
        self.table.register_job(job, world)

    def feed_watchdog(self) -> bool:
        """One watchdog round of the main loop: feed systemd only while every supervised thread
        beats (kubelet's PLEG check); returns whether it was fed."""
        daemon_health.watch_threads(self)
        healthy = self.health.healthy()
        fed = self.notifier.watchdog(healthy)
        if not healthy:
            self.notifier.status(daemon_health.status_line(self))
        return fed

    def _write_discovery(self) -> None:
        """Tell ranks this agent did not start (torchrun jobs calling ``trainguard.init()``) where
        to report, read plans and put memory checkpoints (``trainguard.run.environment``)."""
        body = {
            "node": self.cfg.agent.node, "pid": os.getpid(), "version": __version__,
            "telemetry_socket": self.paths.telemetry_socket, "plans_dir": self.paths.plans_dir,
            "memory_root": self.checkpoints.settings.memory_root,
            "memory_every": self.checkpoints.settings.memory_interval,
        }
        _write_whole(self.paths.discovery_file, json.dumps(body))

    def _peer_node_of(self, address: str) -> str | None:
        """The cluster member whose advertised API host (or node name) is ``address``."""
        for name, info in self.cluster.members().items():
            host = info.api.rsplit(":", 1)[0].strip("[]") if info.api else ""
            if address in (host, name):
                return name
        return None

    def _object_scope(self, key: str) -> ObjectScope | None:
        """The object-tier scope of a checkpoint key (a job, or a spanning job's part
        ``<job>.part-<node>``): the job's submission uid and this node's fencing epoch for it
        (the record's epoch; for a spanning job the attempt its ranks run)."""
        job = key.split(".part-", 1)[0]
        record = self.supervisor.jobs.get(job)
        if record is None or not record.spec.uid:
            # Not run here (yet): the leader choosing a restore step, a node about to join the job.
            # It reads by the uid of the signed record; epoch 0 never outranks a writer.
            uid = self.cluster.job_uid(job)
            return ObjectScope(uid, 0) if uid else None
        if record.block is not None:
            return ObjectScope(record.spec.uid, record.block.attempt)
        return ObjectScope(record.spec.uid, self.cluster.epoch_of(job))

    def _start_recovery(self) -> None:
        settings = checkpoint_settings(self.cfg)
        # Membership, leader election and the peer tier; with no etcd this node is its own leader.
        self.cluster = ClusterService(
            self.cfg.cluster,
            node=self.cfg.agent.node,
            memory_root=settings.memory_root,
            token=daemon_parts.peer_token(self.cfg),
            emit=functools.partial(daemon_events.on_cluster_event, self),
            on_adopt=lambda job, when: self.recovery.note_failure(job, "node_lost", when),
            tls=self._tls_contexts()[1],
        )
        if self.cluster.gangs is not None:
            # Ranks of a job spanning nodes report to their own node; the node holding rank 0 judges them all.
            self.telemetry.on_message = self.cluster.gangs.on_telemetry
        self.checkpoints = CheckpointManager(
            settings,
            emit=functools.partial(daemon_events.on_checkpoint_event, self),
            extra_tiers=self.cluster.tiers,
            extra_intervals=self.cluster.intervals,
            extra_keep=self.cluster.keep,
            cluster=self.cfg.cluster.name,
            object_scope=self._object_scope,
        )
        self.checkpoints.start()
        owner = self.rank_user
        if owner is not None:
            # The ranks' own job directories become theirs, and what they wrote is theirs to restore.
            self.checkpoints.set_job_owner(lambda _job: (owner.uid, owner.gid))
        if self.cluster.gangs is not None and self.checkpoints.object is not None:
            self.cluster.gangs.shared_tiers = [self.checkpoints.object]
        self.rollback = Rollback(self.supervisor, self.plans, self.events, self.heal_counts,
                                 lr_factor=self.cfg.recovery.rollback_lr_factor)
        self.exclude_rank = Exclusion(self.supervisor, self.plans, self.events, self.heal_counts)
        self.recovery = RecoveryService(lambda: self.cfg, self.events, self.supervisor, self.table, self.checkpoints,
                                        self.rollback, self.heal_counts)
        self.supervisor.launch_env = self.recovery.launch_env
        self.supervisor.peer_node_of = self._peer_node_of
        self.supervisor.before_survivors_stop = self.recovery.before_survivors_stop
        self.tick_hooks.append(self.recovery.tick)
        self.gpu_faults = GpuFaults(self.supervisor, self.events, self.exclude_rank, exclude=self.cfg.gpu.exclude_failed)
        self.tick_hooks.append(lambda _agent, _now: self.gpu_faults.tick())
        self.events.subscribe(functools.partial(daemon_events.watch_failures, self))

    def _install_policies(self) -> None:
        """Straggler detection/migration and the LR/batch controller, as configured."""
        if self.cfg.detection.enabled:
            self.straggler = install_stragglers(self, self.cfg.detection)
            if self.cluster.gangs is not None:
                self.cluster.gangs.evidence_for = self.straggler.local_evidence  # sent along with forwarded telemetry
        # Installed with strategy "none" too: the LR still follows a global batch that healing
        # changed (controller.lr_batch_rule), which is cheap (no per-step telemetry read).
        self.controller = install_controller(self, self.cfg.controller)

    def drain(self, job: str, target: dict[str, Any]) -> dict[str, Any]:
        """Operator drain: restart the job without the rank's data-parallel replica."""
        rank = target.get("rank")
        node = target.get("node")
        if node is not None and (isinstance(rank, bool) or not isinstance(rank, int)):
            if self.cluster.gangs is None:
                raise ApiError(409, f"node {node} is the only node of this agent's job: there is nowhere to move its "
                                    "ranks; drain a rank instead (its data-parallel replica leaves the job)")
            try:
                return self.cluster.drain(job, str(node))
            except LookupError as exc:
                raise ApiError(404, str(exc)) from None
            except ValueError as exc:
                raise ApiError(409, str(exc)) from None
            except Exception as exc:  # noqa: BLE001 - etcd down or refusing: say so, change nothing
                raise ApiError(503, f"drain not recorded: {exc}") from None
        if isinstance(rank, bool) or not isinstance(rank, int):
            raise ApiError(400, "drain needs {\"rank\": N} (or {\"node\": NAME} in a cluster)")
        if not self.exclude_rank(job, rank, "drained by an operator"):
            raise ApiError(409, f"job {job}: rank {rank} cannot be drained (data parallelism is already 1)")
        return {"job": job, "drained_rank": rank}

    def _start_api(self) -> None:
        cfg = self.cfg.api
        self.control = AgentControl(self)
        api_cfg = ApiConfig(
            unix_socket=Path(self.paths.control_socket),
            tcp=cfg.tcp or None,
            token_file=Path(cfg.token_file) if cfg.token_file else None,
            unix_requires_token=cfg.unix_requires_token,
            tls=self._tls_contexts()[0],
            allow_plaintext=cfg.allow_plaintext,
            header_timeout_s=cfg.header_timeout_s,
            max_connections_per_peer=cfg.max_connections_per_peer,
        )
        if cfg.tcp and not cfg.tls_cert:
            log.warning("api: the TCP API on %s serves plain HTTP (api.allow_plaintext = true): bearer tokens "
                        "and checkpoint bytes cross the network in clear", cfg.tcp)
            self.events.emit("api_plaintext", f"the TCP API on {cfg.tcp} serves plain HTTP (api.allow_plaintext)",
                             severity="warning")
        self.api = ApiServer(api_cfg, self.control, on_auth_failure=functools.partial(daemon_events.on_auth_failure, self),
                             on_node_refused=functools.partial(daemon_events.on_node_refused, self))
        self.api.start()
        tcp = self.api.tcp_address
        self.api_tcp_port = tcp[1] if tcp else None
        # Join the cluster once peers can reach this agent's API.
        self.exporter.sources.append(self.cluster)
        self.cluster.start(f"{tcp[0]}:{tcp[1]}" if tcp else None, self.supervisor, self.plans,
                               self.cfg.controller.lr_batch_rule)
        _write_whole(os.path.join(self.cfg.agent.run_dir, "api.addr"), f"{tcp[0]}:{tcp[1]}\n" if tcp else "\n")

    def _tls_contexts(self) -> tuple[Any, Any]:
        """The TCP API's (server, client) SSL contexts, made once (``daemon_parts.api_tls``)."""
        if self._tls is None:
            self._tls = daemon_parts.api_tls(self.cfg)
        return self._tls

    def _adopt_jobs(self) -> None:
        """Jobs a previous agent on this state directory left: adopted or restarted (the records
        are read after the collectors start, so adopted ranks get eBPF exit statuses and metrics)."""
        records = self.supervisor.records
        if records is None:
            return
        saved, problems = records.load_all()
        for problem in problems:
            self.events.emit("job_not_adopted", f"unreadable job record {problem}", severity="error", cause=problem)
        self.supervisor.adopt(saved)

    def _start_collectors(self) -> None:
        collectors, state = daemon_parts.start_collectors(
            self.cfg, functools.partial(daemon_events.on_collector_event, self), print_bpf=self.print_bpf,
            nvml_module=self.nvml_module)
        self.collectors.extend(collectors)
        self.collector_state.update(state)
        self.ebpf = next((c for c in collectors if isinstance(c, EbpfCollector)), None)
        self.gpu = next((c for c in collectors if isinstance(c, GpuCollector)), None)

    def _forget_finished(self, now: float) -> None:
        """Finished jobs leave status and /metrics after agent.job_retention_s (their events stay)."""
        def clear(job: str) -> None:  # before the job leaves the status: then /metrics has none of it either
            self.table.forget_job(job)
            self.plans.forget(job)
            self.controller.forget(job)
            self.supervisor.launcher.forget(job)
            self._oom_seen.pop(job, None)

        for job in self.supervisor.forget_finished(self.cfg.agent.job_retention_s, now, before=clear):
            self.events.emit("job_forgotten", f"job {job} ended more than {self.cfg.agent.job_retention_s:g}s ago: "
                             "removed from status and metrics", job=job)

    def _launch_context(self, spec: JobSpec) -> LaunchContext:
        return LaunchContext(
            telemetry_socket=self.paths.telemetry_socket,
            plan_path=self.plans.path(spec.job),
            log_dir=os.path.join(self.paths.jobs_dir, spec.job),
            master_addr=self.cfg.launcher.master_addr,
            python=self.cfg.launcher.python,
            user=self.cfg.launcher.user,
            run_dir=self.cfg.agent.run_dir,
            extra_env={"TRAINGUARD_STATE_DIR": self.cfg.agent.state_dir, "TRAINGUARD_JSON": "1"},
            gpus=self._healthy_gpus(),
            cpus=self.cfg.launcher.job_cpus,
            memory_max=self.cfg.launcher.job_memory_max,
        )

    def _healthy_gpus(self) -> tuple[int, ...] | None:
        return self.gpu_faults.healthy(self.gpu.gpu_indices()) if self.gpu is not None else None

    # --- main loop --------------------------------------------------------------------------
    def tick(self, now: float) -> None:
        for c in self.collectors:
            try:
                c.poll(now)
            except Exception as exc:  # noqa: BLE001 - one bad read must not stop the loop
                log.warning("collector %s poll failed: %s", c.name, exc)
        self.table.evict_idle_foreign(now)
        snapshot = self.table.snapshot()
        for job, ranks in snapshot.jobs.items():
            steps = [r.step for r in ranks.values()]
            if steps:
                self.supervisor.note_progress(job, max(steps))
        rankpids.track_external(self, snapshot, now)
        daemon_events.watch_cgroups(self)
        self._forget_finished(now)
        for hook in list(self.tick_hooks):
            try:
                hook(self, now)
            except Exception as exc:  # noqa: BLE001
                log.exception("tick hook %s failed: %s", hook, exc)
        self.ticks += 1

    def run(self) -> int:
        signal.signal(signal.SIGTERM, lambda *_: self._stop.set())
        signal.signal(signal.SIGINT, lambda *_: self._stop.set())
        signal.signal(signal.SIGHUP, lambda *_: self._reload.set())
        self.start()
        interval = self.cfg.agent.interval_s
        watchdog = self.notifier.watchdog_interval_s()
        period = min(interval, watchdog) if watchdog else interval
        next_tick = time.monotonic()
        try:
            while not self._stop.is_set():
                if self._reload.is_set():
                    self._reload.clear()
                    self.reload()
                now = time.monotonic()
                if now >= next_tick:
                    self.tick(time.time())
                    next_tick = now + interval
                    self.notifier.status(daemon_health.status_line(self))
                self.feed_watchdog()
                self._stop.wait(max(0.0, min(period, next_tick - time.monotonic())))
        finally:
            self.shutdown()
        return 0

    def request_stop(self) -> None:
        self._stop.set()

    def reload(self) -> None:
        self.notifier.reloading()
        try:
            new = load_config(self.config_path, must_exist=self.config_path is not None)
        except ConfigError as exc:
            self.events.emit("config_reload_failed", f"config not reloaded: {exc}", severity="error", cause=str(exc))
            self.notifier.ready(daemon_health.status_line(self))
            return
        # Paths and sockets stay as started; the rest takes effect now.
        new.agent.state_dir, new.agent.run_dir = self.cfg.agent.state_dir, self.cfg.agent.run_dir
        self.cfg = new
        try:
            self.api.reload()
        except Exception as exc:  # noqa: BLE001
            self.events.emit("config_reload_failed", f"API tokens not reloaded: {exc}", severity="error")
        self.events.emit("config_reloaded", "configuration reloaded", path=self.config_path)
        self.notifier.ready(daemon_health.status_line(self))

    def shutdown(self) -> None:
        """Stop every part ``start()`` built; a start that failed part-way (a ConfigError) built
        only some, so the parts are looked up among those built rather than assumed."""
        built = vars(self)
        self.notifier.stopping()
        if "cluster" in built:
            self.cluster.stop(leave=True)  # resign leadership and release the lease first
        events: EventLog | None = built.get("events")
        if events is not None:
            events.emit("agent_stopping", f"agent stopping ({self.cfg.agent.on_stop})")
        if "supervisor" in built:
            if self.cfg.agent.on_stop == "stop_ranks":
                self.supervisor.stop_all("agent shutdown")
            self.supervisor.close()
            if self.cfg.agent.on_stop == "stop_ranks":
                self.supervisor.launcher.close_all()  # no stray, warm launcher or cgroup left (left ranks keep theirs)
        for part in ("api", "telemetry", "checkpoints"):
            obj = built.get(part)
            if obj is not None:
                try:
                    obj.stop()
                except Exception as exc:  # noqa: BLE001
                    log.warning("stopping %s: %s", part, exc)
        if self.metrics_server is not None:
            stop_metrics(self.metrics_server)
        for c in self.collectors:
            try:
                c.stop()
            except Exception:  # noqa: BLE001
                pass
        if events is not None:
            events.emit("agent_stopped", "agent stopped")
            events.close()
        for path in (self.paths.pid_file, self.paths.metrics_addr_file, self.paths.discovery_file):
            try:
                os.unlink(path)
            except OSError:
                pass

    # --- reporting --------------------------------------------------------------------------
    @property
    def event_counts(self) -> dict[tuple[str, str], int]:
        return dict(self.events.counts)

    def metrics(self) -> Any:
        """Agent-level metric families (events, restarts, jobs) for the exporter."""
        return agent_metrics(self)


def _write_whole(path: str, text: str) -> None:
    """Write by rename: a reader polling for the file (a test, a wrapper script) never sees it
    empty or half written (CI read an empty api.addr between its creation and the write)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as fh:
        fh.write(text)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
