"""The straggler service the agent runs once per tick: detect, attribute, migrate, exclude.

``install(agent, config)`` appends the service's tick hook, adds it to the exporter's metric
sources and sets the agent's declared ``straggler`` field, which the control API reads for status,
the dashboard and GET/PUT /v1/config/detection.

Per job and tick: every rank's recent telemetry plus its CPU run delay go to the detector
(straggler.py); a rank that becomes a straggler gets a cause from the collectors (causes.py) and a
``straggler_detected`` event; the migration policy (agent/heal/migration.py) publishes per-dp-rank
batch sizes through the job's plan, and takes them back to even once no straggler is left. A rank
that stays a straggler past ``exclude_after_s`` is excluded (``agent.heal.exclusion``: the job restarts without
its data-parallel replica) unless ``observe_only`` holds.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client.metrics_core import Metric

from trainguard.agent.collectors.ebpf import EbpfCollector
from trainguard.agent.collectors.gpu import GpuCollector
from trainguard.agent.detect.causes import (
    Attribution,
    Evidence,
    attribute,
    evidence_from_wire,
    evidence_to_wire,
)
from trainguard.agent.detect.config import StragglerConfig
from trainguard.agent.detect.evidence import ProcReader, RankEvidence
from trainguard.agent.detect.jobview import (
    CAUSE_RETRIES,
    REMOTE_EVIDENCE_TTL_S,
    Layout,
    RemoteEvidence,
    _JobState,
    _layout,
    current_attempt,
    step_samples,
    takes_batch_sizes,
)
from trainguard.agent.detect.straggler import (
    RankFigures,
    RankInput,
    RankState,
    StragglerDetector,
    Transition,
)
from trainguard.agent.eventlog import EventLog
from trainguard.agent.heal.migration import Decision, MigrationPolicy, ReplicaModel, even_sizes
from trainguard.agent.lifecycle.plans import PlanStore
from trainguard.agent.metricspec import MetricSpec
from trainguard.agent.ranktable import RankTable

if TYPE_CHECKING:
    # Types only, both real cycles: the daemon imports this package, and the supervisor imports
    # agent.detect.peerdiag, which loads this package first.
    from trainguard.agent.daemon import Agent
    from trainguard.agent.lifecycle.supervisor import Supervisor

log = logging.getLogger("trainguard.straggler")

SCORE = MetricSpec("trainguard_rank_straggler_score", "gauge", "", ("job", "rank"),
                   "Straggler score in [0, 1]: the fastest peer's median compute time per step at the even batch "
                   "divided by this rank's (the lower of: compute alone, compute plus CPU run-queue wait); 1 = as "
                   "fast as the fastest, stragglers fall below detection.enter_score.")
DETECTED = MetricSpec("trainguard_stragglers_detected_total", "counter", "", ("job", "cause"),
                      "Ranks declared stragglers, by attributed cause (cpu_contention, cpu_quota, io_wait, "
                      "memory_reclaim, gpu_throttle, gpu_error, unknown).")
MIGRATIONS = MetricSpec("trainguard_shard_migrations_total", "counter", "", ("job",),
                        "Plans published by shard migration (moves, re-balances and undos).")
SHARE = MetricSpec("trainguard_rank_batch_share", "gauge", "", ("job", "rank"),
                   "Fraction of the global batch the rank's dp replica processes per step.")
METRICS: tuple[MetricSpec, ...] = (SCORE, DETECTED, MIGRATIONS, SHARE)




class StragglerService:
    """Judges every job's ranks once per tick, attributes a cause, migrates shards and excludes a
    rank that stays slow. Its collaborators are the agent's parts it uses (``install`` hands them)."""

    def __init__(self, config: StragglerConfig, *, events: EventLog, table: RankTable, supervisor: Supervisor,
                 plans: PlanStore, exclude_rank: Callable[[str, int, str], object],
                 ebpf: EbpfCollector | None = None, gpu: GpuCollector | None = None,
                 proc_root: Path = Path("/proc"), sys_root: Path = Path("/sys"),
                 clock: Callable[[], float] = time.time) -> None:
        self.events = events
        self.table = table
        self.supervisor = supervisor
        self.plans = plans
        self.exclude_rank = exclude_rank
        """Restarts a job without one rank's data-parallel replica (agent.heal.exclusion)."""
        self.ebpf = ebpf
        """Per-rank kernel statistics for causes (None: the eBPF collector is off)."""
        self.gpu = gpu
        """Per-process GPU errors for causes (None: the GPU collector is off)."""
        self.config = config
        self.clock = clock
        self.evidence = RankEvidence(ProcReader(proc_root, sys_root))
        self._jobs: dict[str, _JobState] = {}
        self._remote: dict[tuple[str, int], RemoteEvidence] = {}
        """Evidence other nodes sent for their ranks of the jobs judged here."""
        self._lock = threading.RLock()
        self._gpu_errors_seen: dict[int, int] = {}

    # --- runtime API ------------------------------------------------------------------------
    def detection_config(self) -> dict[str, Any]:
        return self.config.as_dict()

    def set_config(self, new: StragglerConfig) -> None:
        """Replace the whole configuration (jobs keep their state; new thresholds apply from the
        next evaluation)."""
        with self._lock:
            self.config = new
            for st in self._jobs.values():
                st.detector.config = new
                st.policy.min_gain = new.min_gain
                st.policy.gain = new.rebalance_gain
                st.policy.settle_steps = new.settle_steps

    def update_detection(self, fields: dict[str, Any]) -> dict[str, Any]:
        """Apply a partial change (validated as a whole; DetectionConfigError names the key)."""
        with self._lock:
            new = self.config.updated(fields)
            self.set_config(new)
        self.events.emit("config_changed", f"detection settings changed: {sorted(fields)}",
                               section="detection", changes=dict(fields))
        return new.as_dict()

    def scores(self, job: str) -> dict[int, tuple[float, str, str]]:
        """rank -> (score, cause or "", state) for status views."""
        with self._lock:
            st = self._jobs.get(job)
            if st is None:
                return {}
            out = {}
            for rank in st.detector.ranks():
                state = "excluded" if rank in st.excluded else st.detector.state(rank).value
                out[rank] = (st.detector.score(rank), st.causes.get(rank, ""), state)
            return out

    def fixed_samples(self, job: str, group: int = 0) -> float:
        """The peer group's fitted fixed forward+backward part in samples' worth (0: not fitted):
        what a rank on a reduced share is judged with at the even batch."""
        with self._lock:
            st = self._jobs.get(job)
            return st.detector.fixed_samples(group) if st is not None else 0.0

    def batch_sizes(self, job: str) -> list[int] | None:
        with self._lock:
            st = self._jobs.get(job)
            return list(st.sizes) if st is not None and st.sizes is not None else None

    # --- the tick ---------------------------------------------------------------------------
    def __call__(self, agent: Agent, now: float) -> None:
        self.tick(now)

    def tick(self, now: float) -> None:
        cfg = self.config
        if not cfg.enabled:
            return
        snapshot = self.table.snapshot()
        records = self.supervisor.jobs
        # A job that ended keeps its telemetry in the table for a while; it has nothing left to judge.
        live = {j: v for j, v in snapshot.jobs.items()
                if not (j in records and (records[j].state.finished or not records[j].decides_here))}
        # This node's ranks of jobs judged on another node: their evidence goes along with their
        # forwarded telemetry (local_evidence), since only this node can read their /proc.
        hosted = {j: v for j, v in snapshot.jobs.items()
                  if j in records and not records[j].state.finished and not records[j].decides_here}
        with self._lock:
            for job in [j for j in self._jobs if j not in live]:
                self._jobs.pop(job)
            for job in {k[0] for k in self.evidence.keys()} - set(live) - set(hosted):
                self.evidence.forget_job(job)
            ebpf = self.ebpf
            for job, views in hosted.items():
                for rank, view in views.items():
                    if self._is_local(job, rank):
                        stats = ebpf.rank_stats(job, rank) if ebpf is not None else None
                        self.evidence.observe(job, rank, view.pid, view.step, now, stats)
            for job, views in live.items():
                try:
                    self._tick_job(job, views, now)
                except Exception:  # noqa: BLE001 - one job's odd data must not stop the others
                    log.exception("straggler detection failed for job %s", job)

    def _tick_job(self, job: str, views: Mapping[int, Any], now: float) -> None:
        cfg = self.config
        st = self._jobs.get(job)
        if st is None:
            st = self._jobs[job] = _JobState(
                StragglerDetector(cfg), MigrationPolicy(cfg.min_gain, cfg.rebalance_gain, cfg.settle_steps))
        attempt = current_attempt(views)
        views = {r: v for r, v in views.items() if v.attempt == attempt}  # ranks not yet back wait
        layout = _layout(self.supervisor, job, views)
        ebpf = self.ebpf
        inputs: dict[int, RankInput] = {}
        local = self._local_ranks(job, views)
        for rank, view in views.items():
            if rank in st.excluded:
                continue
            window = self.table.window(job, rank, 2 * cfg.window + cfg.warmup_steps)
            steps = step_samples([m for m in window if m.attempt == attempt])
            if rank in local:
                stats = ebpf.rank_stats(job, rank) if ebpf is not None else None
                self.evidence.observe(job, rank, view.pid, view.step, now, stats)
                delay = self.evidence.run_delay_per_step(job, rank, now, cfg.delay_window_s,
                                                         from_step=st.detector.judged_from(rank))
            else:
                # Another node's rank: its pid means nothing in this node's /proc.
                remote = self._fresh_remote(job, rank, now)
                delay = remote.delay_per_step_s if remote is not None else 0.0
            dp_rank = view.dp_rank if view.dp_rank is not None else rank
            inputs[rank] = RankInput(rank, layout.group(rank) if layout.known else 0, dp_rank, steps, delay, attempt)
        result = st.detector.evaluate(inputs, now)
        for tr in result.transitions:
            if tr.detected:
                self._on_detected(job, st, tr, result.figures, views)
            elif tr.recovered:
                self._on_recovered(job, st, tr, result.figures)
        if result.evaluated:
            self._name_unknown_causes(job, st, result.figures, views)
            self._migrate(job, st, layout, views, result.figures)
            self._maybe_exclude(job, st, now)
        if st.sizes is None and layout.dp > 0:
            total = layout.global_batch or sum(self._replica_batches(views).values()) or layout.dp
            st.sizes = even_sizes(total, layout.dp, 1) if total >= layout.dp else None

    @staticmethod
    def _replica_batches(views: Mapping[int, Any]) -> dict[int, int]:
        out: dict[int, int] = {}
        for v in views.values():
            out[v.dp_rank if v.dp_rank is not None else v.rank] = v.batch_size
        return out

    # --- detection events ---------------------------------------------------------------------
    def _gpu_errors(self, pid: int) -> tuple[Any | None, int]:
        gpu_col = self.gpu
        if gpu_col is None:
            return None, 0
        stats = gpu_col.gpu_stats_for_pid(pid)
        gpu = gpu_col.gpu_for_pid(pid)
        if gpu is None:
            return stats, 0
        if gpu in gpu_col.lost_gpus():
            return stats, 1
        total = sum(n for (g, _xid), n in gpu_col.xid_counts().items() if g == gpu)
        before = self._gpu_errors_seen.get(gpu, 0)
        self._gpu_errors_seen[gpu] = total
        return stats, max(0, total - before)

    # --- ranks on other nodes --------------------------------------------------------------------
    def _is_local(self, job: str, rank: int) -> bool:
        """Does ``rank`` of ``job`` run on this node (every rank does unless the job spans nodes)?"""
        record = self.supervisor.jobs.get(job)
        block = record.block if record is not None else None
        return block is None or block.rank_offset <= rank < block.rank_offset + block.nproc

    def _local_ranks(self, job: str, views: Mapping[int, Any]) -> set[int]:
        return {r for r in views if self._is_local(job, r)}

    def _fresh_remote(self, job: str, rank: int, now: float) -> RemoteEvidence | None:
        remote = self._remote.get((job, rank))
        if remote is None or now - remote.at > REMOTE_EVIDENCE_TTL_S:
            return None
        return remote

    def local_evidence(self, job: str, now: float | None = None) -> dict[str, dict[str, Any]]:
        """What this node saw of its ranks of ``job``, for the node that judges it (sent along with
        the forwarded telemetry): rank -> Evidence fields and run delay per step."""
        now = self.clock() if now is None else now
        out: dict[str, dict[str, Any]] = {}
        views = self.table.snapshot().jobs.get(job, {})
        with self._lock:
            for (j, rank) in self.evidence.keys():
                if j != job:
                    continue
                view = views.get(rank)
                gpu, errors = self._gpu_errors(view.pid) if view is not None else (None, 0)
                ev = self.evidence.evidence(job, rank, self.config.window, gpu, errors)
                out[str(rank)] = {**evidence_to_wire(ev),
                                  "delay_per_step_s": self.evidence.run_delay_per_step(job, rank, now,
                                                                                         self.config.delay_window_s)}
        return out

    def note_remote_evidence(self, job: str, node: str, by_rank: Any, now: float | None = None) -> int:
        """Evidence another node sent for its ranks of ``job``; returns how many ranks' were taken
        (malformed entries are dropped, never raised)."""
        now = self.clock() if now is None else now
        if not isinstance(by_rank, dict):
            return 0
        taken = 0
        for key, fields in by_rank.items():
            try:
                rank = int(key)
                ev = evidence_from_wire(fields)
                delay = float(fields.get("delay_per_step_s", 0.0))
            except (TypeError, ValueError, AttributeError):
                continue
            if not math.isfinite(delay):
                delay = 0.0
            self._remote[(job, rank)] = RemoteEvidence(node, ev, max(0.0, delay), now)
            taken += 1
        return taken

    def _evidence(self, job: str, rank: int, pid: int, fig: RankFigures | None) -> Evidence:
        if not self._is_local(job, rank):
            remote = self._fresh_remote(job, rank, self.clock())
            ev = remote.evidence if remote is not None else Evidence()  # unknown, never a local stranger's
            if fig is not None:
                ev = dataclasses.replace(ev, cpu_s=fig.compute_s - fig.delay_s)
            return ev
        gpu, errors = self._gpu_errors(pid)
        ev = self.evidence.evidence(job, rank, self.config.window, gpu, errors)
        if fig is not None:
            ev = dataclasses.replace(ev, cpu_s=fig.compute_s - fig.delay_s)
        return ev

    def _attribute(self, job: str, rank: int, figures: Mapping[int, RankFigures], views: Mapping[int, Any]) -> Attribution:
        fig = figures.get(rank)
        peers = [f for r, f in figures.items() if r != rank and (fig is None or f.group == fig.group)]
        extra = 0.0
        if fig is not None and peers:
            # Extra compute per step at the even batch, run delay included (as the score sees it).
            even = sum(f.samples for f in [fig, *peers]) / (len(peers) + 1)
            fastest = min(p.at_batch(even) + p.delay_s for p in peers)
            extra = fig.at_batch(even) + fig.delay_s - fastest
        mine = self._evidence(job, rank, views[rank].pid, fig)
        others = [self._evidence(job, p.rank, views[p.rank].pid, p) for p in peers if p.rank in views]
        return attribute(mine, others, extra, min_frac=self.config.cause_min_frac,
                         clock_drop=self.config.gpu_clock_drop)

    def _on_detected(self, job: str, st: _JobState, tr: Transition, figures: Mapping[int, RankFigures],
                     views: Mapping[int, Any]) -> None:
        cfg = self.config
        attr = self._attribute(job, tr.rank, figures, views)
        st.causes[tr.rank] = attr.cause
        st.detections[attr.cause] += 1
        st.cause_retries[tr.rank] = 0
        fig = figures.get(tr.rank)
        movable = takes_batch_sizes(views)
        action = "observe_only" if cfg.observe_only else ("migrate" if cfg.migrate and movable else "report")
        fields: dict[str, Any] = {"score": round(tr.score, 4), "action": action, "details": attr.details}
        if cfg.migrate and not movable:
            fields["note"] = ("not every rank applies the plan's batch sizes (trainguard.init(applies=...)): "
                              "no samples are moved")
        if not self._is_local(job, tr.rank):
            remote = self._remote.get((job, tr.rank))
            fields["node"] = remote.node if remote is not None else "unknown"
            fields["evidence_from"] = "its node" if self._fresh_remote(job, tr.rank, self.clock()) else "none"
        if fig is not None:
            fields.update(step=fig.last_step, per_sample_s=fig.per_sample_s, compute_s=fig.compute_s,
                          run_delay_s=fig.delay_s, dp_rank=fig.dp_rank)
            peers = [f.per_sample_s for f in figures.values() if f.group == fig.group and f.rank != tr.rank]
            if peers:
                fields["fastest_per_sample_s"] = min(peers)
        self.events.emit(
            "straggler_detected",
            f"job {job} rank {tr.rank} is a straggler (score {tr.score:.2f}, cause {attr.cause})",
            severity="warning", cause=attr.cause, job=job, rank=tr.rank, **fields)

    def _name_unknown_causes(self, job: str, st: _JobState, figures: Mapping[int, RankFigures],
                             views: Mapping[int, Any]) -> None:
        """A straggler detected on its first slow steps (a dozen steps can take tens of ms) is judged
        on the collectors' last tick, which may end before the slowdown began: its cause comes out
        "unknown" while the run delay has not caught up. Such a rank is attributed again at the next
        evaluations while it stays a straggler (at most ``CAUSE_RETRIES``), and one
        ``straggler_cause`` event names the cause once the evidence shows one. The detection count
        by cause stays what the detection said."""
        for rank, cause in list(st.causes.items()):
            if (cause != "unknown" or rank not in views or rank not in figures
                    or st.detector.state(rank) != RankState.STRAGGLER or st.cause_retries[rank] >= CAUSE_RETRIES):
                continue
            st.cause_retries[rank] += 1
            attr = self._attribute(job, rank, figures, views)
            if attr.cause == "unknown":
                continue
            st.causes[rank] = attr.cause
            self.events.emit(
                "straggler_cause", f"job {job} rank {rank}: the straggler's cause is {attr.cause} "
                f"(unknown when it was detected)", severity="warning", cause=attr.cause, job=job, rank=rank,
                details=attr.details, step=figures[rank].last_step)

    def _on_recovered(self, job: str, st: _JobState, tr: Transition, figures: Mapping[int, RankFigures]) -> None:
        cause = st.causes.pop(tr.rank, "")
        fig = figures.get(tr.rank)
        self.events.emit(
            "straggler_recovered", f"job {job} rank {tr.rank} is no longer a straggler (score {tr.score:.2f})",
            severity="info", cause=cause, job=job, rank=tr.rank, score=round(tr.score, 4),
            step=fig.last_step if fig is not None else None)

    # --- migration ----------------------------------------------------------------------------
    def _migrate(self, job: str, st: _JobState, layout: Layout, views: Mapping[int, Any],
                 figures: Mapping[int, RankFigures]) -> None:
        cfg = self.config
        if not cfg.migrate or cfg.observe_only or layout.dp < 2:
            return
        live = [r for r in views if r not in st.excluded]
        if not live or not takes_batch_sizes({r: views[r] for r in live}):
            return  # a rank that cannot take batch sizes would run the old split under a new plan
        min_version = min(views[r].plan_version for r in live)
        min_step = min(views[r].step for r in live)
        self._tell_applied(job, st, {r: views[r] for r in live}, min_version)
        if not st.policy.settled(min_version, min_step):
            return
        if any(st.detector.state(r) == RankState.WARMUP for r in live):
            # A rank not judged yet (the job just (re)started): keep the split in force. Undoing it
            # here would hand a straggler whose standing carried over the restart its full share.
            return
        slow = any(st.detector.state(r) in (RankState.STRAGGLER, RankState.RECOVERING) for r in live)
        slowest: dict[int, RankFigures] = {}  # dp replica -> its slowest member
        for fig in figures.values():
            m = slowest.get(fig.dp_rank)
            if m is None or fig.per_sample_s > m.per_sample_s:
                slowest[fig.dp_rank] = fig
        rates = sorted(f.delay_s / max(f.per_sample_s * f.samples, 1e-9) for f in slowest.values())
        common = rates[(len(rates) - 1) // 2] if rates else 0.0  # lower median: with two replicas, the other one
        models = {d: self._model(f, common) for d, f in slowest.items()}
        if slow and sorted(models) != list(range(layout.dp)):
            return  # not every replica measured yet
        plan = self.plans.get(job)
        total = sum(plan.batch_sizes) if plan.batch_sizes else (
            layout.global_batch or sum(self._replica_batches(views).values()))
        if total < layout.dp * layout.quantum or total % layout.quantum:
            return
        if slow:
            replicas = [models[d] for d in range(layout.dp)]
        else:
            replicas = [ReplicaModel(d, 1.0) for d in range(layout.dp)]
        try:
            decision = st.policy.decide(replicas, total, stragglers=slow, quantum=layout.quantum)
        except ValueError as exc:
            log.warning("job %s: no migration: %s", job, exc)
            return
        if decision is not None:
            self._publish(job, st, layout, decision, total, figures)

    def _tell_applied(self, job: str, st: _JobState, views: Mapping[int, Any], min_version: int) -> None:
        """Once every rank reports running the last published split's plan version: one event with
        the batch sizes the ranks report they ran (their word, not the plan's)."""
        version = st.policy.published_version
        if version < 0 or version <= st.applied_told or min_version < version:
            return
        st.applied_told = version
        ran: dict[int, int] = {}
        for rank, view in sorted(views.items()):
            ran.setdefault(view.dp_rank if view.dp_rank is not None else rank, view.batch_size)
        sizes = [ran[d] for d in sorted(ran)]
        self.events.emit(
            "batch_sizes_applied", f"job {job}: every rank runs plan v{version}; batch sizes {sizes} as the ranks report",
            job=job, plan_version=min_version, published_version=version, batch_sizes=sizes, step=min(v.step for v in views.values()))

    def _model(self, f: RankFigures, common_rate: float) -> ReplicaModel:
        """The migration model of one replica. Run delay counts only when the score counts it, only
        beyond the replicas' median delay rate (what every rank suffers moves no work), and then as
        a slower per-sample rate: a rank that gets half a CPU computes at half speed."""
        marginal = f.marginal_s
        if self.config.include_run_delay and f.delay_s > 0:
            rate = f.delay_s / max(f.per_sample_s * f.samples, 1e-9)
            marginal *= 1.0 + max(0.0, rate - common_rate)
        return ReplicaModel(f.dp_rank, marginal, f.fixed_s)

    def _publish(self, job: str, st: _JobState, layout: Layout, d: Decision, total: int,
                 figures: Mapping[int, RankFigures]) -> None:
        stragglers = sorted(r for r in st.detector.ranks() if st.detector.state(r) in
                            (RankState.STRAGGLER, RankState.RECOVERING))
        if d.action == "undo":
            reason = "shard migration undone: no straggler left"
        else:
            reason = f"shard migration ({d.action}) away from straggler rank(s) {stragglers}"
        plan = self.plans.update(job, {"batch_sizes": d.sizes, "reason": reason})
        st.policy.note_published(d.sizes, plan.version)
        st.sizes = list(d.sizes) if d.sizes is not None else even_sizes(total, layout.dp, layout.quantum)
        st.migrations += 1
        level = "dp replica" if layout.tp * layout.pp > 1 else "dp rank"
        fields: dict[str, Any] = {
            "action": d.action, "batch_sizes": st.sizes, "target": d.target, "global_batch": total,
            "plan_version": plan.version, "level": level, "stragglers": stragglers,
            "step": max((f.last_step for f in figures.values()), default=0),
        }
        if layout.tp * layout.pp > 1:
            fields["note"] = (f"tp={layout.tp} pp={layout.pp}: batch moved between whole dp replicas "
                              f"(each replica as fast as its slowest member)")
        speeds = {f.rank: round(f.speed, 3) for f in figures.values()}
        self.events.emit(
            "shard_migration", f"job {job}: {reason}; plan v{plan.version} asks for batch sizes {st.sizes}",
            severity="info" if d.action == "undo" else "warning",
            cause=",".join(st.causes.get(r, "") for r in stragglers), job=job,
            samples_per_s=speeds, **fields)

    # --- exclusion ----------------------------------------------------------------------------
    def _maybe_exclude(self, job: str, st: _JobState, now: float) -> None:
        cfg = self.config
        if cfg.exclude_after_s <= 0:
            return
        for rank in st.detector.ranks():
            since = st.detector.straggler_since(rank)
            if rank in st.excluded or since is None or now - since < cfg.exclude_after_s:
                continue
            if st.detector.state(rank) not in (RankState.STRAGGLER, RankState.RECOVERING):
                continue
            st.excluded.add(rank)  # asked once per episode, whatever the answer
            reason = f"rank {rank} slow for {now - since:.0f} s (limit detection.exclude_after_s={cfg.exclude_after_s:g})"
            cause = st.causes.get(rank, "unknown")
            if cfg.observe_only:
                action = "observe_only"
            else:
                action = "exclude"
                try:
                    self.exclude_rank(job, rank, reason)
                except Exception as exc:  # noqa: BLE001
                    action = f"exclude_failed: {exc}"
            self.events.emit("rank_excluded", f"job {job}: {reason}; {action}",
                                   severity="error", cause=cause, job=job, rank=rank, action=action,
                                   slow_for_s=round(now - since, 1))

    # --- metrics ------------------------------------------------------------------------------
    name = "straggler"

    def metrics(self) -> Iterator[Metric]:
        with self._lock:
            score, detected, migrations, share = SCORE.gauge(), DETECTED.counter(), MIGRATIONS.counter(), SHARE.gauge()
            snapshot = self.table.snapshot()
            for job, st in sorted(self._jobs.items()):
                for rank in st.detector.ranks():
                    value = st.detector.score(rank)
                    if not math.isnan(value):
                        score.add_metric([job, str(rank)], value)
                for cause, n in sorted(st.detections.items()):
                    detected.add_metric([job, cause], n)
                migrations.add_metric([job], st.migrations)
                if st.sizes:
                    total = sum(st.sizes)
                    for rank, view in snapshot.jobs.get(job, {}).items():
                        d = view.dp_rank if view.dp_rank is not None else rank
                        if 0 <= d < len(st.sizes):
                            share.add_metric([job, str(rank)], st.sizes[d] / total)
        return iter([score, detected, migrations, share])


def install(agent: Agent, config: StragglerConfig | None = None, **kwargs: Any) -> StragglerService:
    """Hook the service into a started agent (tick hook, metric source, runtime API).

    Idempotent: an agent that already runs one (the daemon installs it when ``detection.enabled``)
    keeps it, with ``config`` applied, so two services never judge and migrate the same job."""
    existing = agent.straggler
    if isinstance(existing, StragglerService) and not kwargs:
        if config is not None:
            existing.set_config(config)
        return existing
    if isinstance(existing, StragglerService):
        uninstall(agent, existing)
    service = StragglerService(config or StragglerConfig(), events=agent.events, table=agent.table,
                               supervisor=agent.supervisor, plans=agent.plans, exclude_rank=agent.exclude_rank,
                               ebpf=agent.ebpf, gpu=agent.gpu, **kwargs)
    agent.tick_hooks.append(service)
    agent.exporter.sources.append(service)
    agent.straggler = service
    return service


def uninstall(agent: Agent, service: StragglerService) -> None:
    """Take a service out of the agent's loop, metrics and API."""
    if service in agent.tick_hooks:
        agent.tick_hooks.remove(service)
    if service in agent.exporter.sources:
        agent.exporter.sources.remove(service)
    if agent.straggler is service:
        agent.straggler = None
