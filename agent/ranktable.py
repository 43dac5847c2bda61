"""Recent telemetry per (job, rank), and the per-rank figures derived from it.

The receiver thread writes here for every datagram, so ``add_many`` does as little as it can: a
dict lookup, a deque append and a few integer sums under one lock per batch. Everything derived
(medians, rates) is computed at ``snapshot`` time, outside the lock, and cached per rank until
that rank sends again; a snapshot is immutable plain data that the exporter, the control API and
the detectors can keep and read from any thread.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field, replace
from itertools import islice
from types import MappingProxyType
from typing import Any, NamedTuple

from trainguard.agent.wire import Telemetry

MESSAGE_BYTES = 880
"""Memory one stored message costs, measured with tracemalloc on decoded datagrams (~830 bytes
plus the ring's slot), before its variable strings (job id, checkpoint error)."""
RANK_BYTES = 4096
"""Memory of one rank's entry besides its messages (ring, counters, cached view)."""


@dataclass(frozen=True)
class RankTableConfig:
    ring: int = 512
    """Recent steps kept per rank (the ring buffer behind ``window``)."""
    window: int = 32
    """Steps the medians and rates in a snapshot are computed over."""
    accept_unknown_jobs: bool = True
    """Keep telemetry from jobs nobody registered (e.g. torchrun jobs pointed at the socket)."""
    max_ranks: int = 65536
    """Upper bound on (job, rank) entries, so a sender inventing ids cannot grow the agent without end."""
    max_foreign_jobs: int = 64
    """Upper bound on jobs nobody registered (not launched by this agent) kept at once."""
    max_bytes: int = 256 << 20
    """Byte budget of the whole table (estimated: ``MESSAGE_BYTES`` a message plus its strings).
    Past it a rank keeps only its newest ``window`` messages and no new rank is taken."""
    foreign_idle_s: float = 300.0
    """A job nobody registered that sent nothing for this long is evicted (its place goes to a new one)."""

    def __post_init__(self) -> None:
        if isinstance(self.max_bytes, bool) or not isinstance(self.max_bytes, int) or self.max_bytes < 1 << 20:
            raise ValueError(f"telemetry.max_bytes: must be an integer >= 1048576 (1 MiB), got {self.max_bytes!r}")
        if not self.foreign_idle_s > 0:
            raise ValueError(f"telemetry.foreign_idle_s: must be > 0, got {self.foreign_idle_s!r}")
        for key in ("ring", "window", "max_ranks"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"telemetry.{key}: must be an integer >= 1, got {value!r}")
        if self.window > self.ring:
            raise ValueError(f"telemetry.window: {self.window} exceeds telemetry.ring ({self.ring})")
        if not isinstance(self.accept_unknown_jobs, bool):
            raise ValueError("telemetry.accept_unknown_jobs: must be true or false")


@dataclass(frozen=True, slots=True)
class RankView:
    """One rank as of a snapshot: its latest message plus figures over the recent window.

    Medians and rates are None until there are enough steps to compute them.
    """

    job: str
    rank: int
    local_rank: int
    pid: int
    step: int
    plan_version: int
    wall_time: float
    """The rank's clock at its latest step."""
    last_seen: float
    """The agent's clock when the latest message arrived."""
    step_s: float
    data_s: float
    fwd_bwd_s: float
    comm_s: float
    opt_s: float
    compute_s: float
    loss: float
    grad_norm: float
    lr: float
    batch_size: int
    mem_bytes: int
    dp_rank: int | None
    world_size: int | None
    messages: int
    """Messages stored for this rank since the agent first saw it."""
    samples_total: int
    tokens_total: int
    window_len: int
    median_step_s: float | None
    median_compute_s: float | None
    median_comm_s: float | None
    median_data_s: float | None
    steps_per_s: float | None
    samples_per_s: float | None
    tokens_per_s: float | None
    attempt: int | None = None
    """The rank's attempt, as its latest message says (None: its sender does not tell)."""
    applies: int | None = None
    """What of the plan the rank applies (``wire.APPLIES_*`` bits; None: not declared)."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    to_dict = as_dict


@dataclass(frozen=True)
class TableSnapshot(Mapping[str, Mapping[int, RankView]]):
    """job -> rank -> RankView (also reachable as ``.jobs``), plus when it was taken."""

    taken_at: float
    jobs: Mapping[str, Mapping[int, RankView]] = field(default_factory=lambda: MappingProxyType({}))

    def __getitem__(self, job: str) -> Mapping[int, RankView]:
        return self.jobs[job]

    def __iter__(self) -> Iterator[str]:
        return iter(self.jobs)

    def __len__(self) -> int:
        return len(self.jobs)

    def ranks(self) -> Iterator[RankView]:
        for ranks in self.jobs.values():
            yield from ranks.values()

    def as_dict(self) -> dict[str, Any]:
        """JSON-able form: {"taken_at": t, "jobs": {job: {"rank": {...}}}} (JSON keys are strings)."""
        return {
            "taken_at": self.taken_at,
            "jobs": {job: {str(r): v.as_dict() for r, v in ranks.items()} for job, ranks in self.jobs.items()},
        }


@dataclass(frozen=True)
class AddResult:
    accepted: list[Telemetry]
    rejected: dict[str, int]


def message_bytes(msg: Telemetry) -> int:
    """Estimated memory of one stored message."""
    return MESSAGE_BYTES + len(msg.job) + len(msg.ckpt_error or "")


class _RankState:
    __slots__ = ("ring", "last_seen", "messages", "samples_total", "tokens_total", "view", "bytes")

    def __init__(self, ring: int) -> None:
        self.ring: deque[Telemetry] = deque(maxlen=ring)
        self.bytes = RANK_BYTES
        self.last_seen = 0.0
        self.messages = 0
        self.samples_total = 0
        self.tokens_total = 0
        self.view: RankView | None = None  # cache, valid while view.messages == messages


class _Counts(NamedTuple):
    last_seen: float
    messages: int
    samples_total: int
    tokens_total: int


def _rates(recent: list[Telemetry]) -> tuple[float | None, float | None, float | None]:
    """Steps, samples and tokens per second over the newest run of increasing steps.

    A restarted rank goes back to its checkpoint's step; mixing its old and new steps would give
    nonsense, so the rate only spans the run since the last step went backwards.
    """
    steps = [m.step for m in recent]
    start = len(steps) - 1
    while start > 0 and steps[start - 1] < steps[start]:
        start -= 1
    first, last = recent[start], recent[-1]
    span = last.wall_time - first.wall_time
    if start == len(recent) - 1 or span <= 0:
        return None, None, None
    tail = recent[start + 1 :]
    samples = sum([m.samples for m in tail])
    tokens = sum([m.tokens for m in tail])
    return (last.step - first.step) / span, samples / span, tokens / span


def _median(values: list[float]) -> float:
    """Median, sorting ``values`` in place (statistics.median is several times slower here)."""
    values.sort()
    mid = len(values) // 2
    return float(values[mid]) if len(values) % 2 else (values[mid - 1] + values[mid]) / 2.0


def _view(job: str, rank: int, state: _Counts, recent: list[Telemetry]) -> RankView:
    last = recent[-1]
    enough = len(recent) >= 2
    steps_per_s, samples_per_s, tokens_per_s = _rates(recent) if enough else (None, None, None)
    return RankView(
        job=job,
        rank=rank,
        local_rank=last.local_rank,
        pid=last.pid,
        step=last.step,
        plan_version=last.plan_version,
        wall_time=float(last.wall_time),
        last_seen=state.last_seen,
        step_s=float(last.step_s),
        data_s=float(last.data_s),
        fwd_bwd_s=float(last.fwd_bwd_s),
        comm_s=float(last.comm_s),
        opt_s=float(last.opt_s),
        compute_s=float(last.compute_s),
        loss=float(last.loss),
        grad_norm=float(last.grad_norm),
        lr=float(last.lr),
        batch_size=last.batch_size,
        mem_bytes=last.mem_bytes,
        dp_rank=last.dp_rank,
        world_size=last.world_size,
        messages=state.messages,
        samples_total=state.samples_total,
        tokens_total=state.tokens_total,
        window_len=len(recent),
        median_step_s=_median([m.step_s for m in recent]),
        median_compute_s=_median([m.fwd_bwd_s + m.opt_s for m in recent]),
        median_comm_s=_median([m.comm_s for m in recent]),
        median_data_s=_median([m.data_s for m in recent]),
        steps_per_s=steps_per_s,
        samples_per_s=samples_per_s,
        tokens_per_s=tokens_per_s,
        attempt=last.attempt,
        applies=last.applies,
    )


class RankTable:
    """Thread-safe store of recent telemetry per (job, rank).

    ``samples`` and ``tokens`` in a message count all the steps it sums up (``Telemetry.steps``);
    the table adds them into totals.
    """

    def __init__(
        self,
        config: RankTableConfig | None = None,
        clock: Callable[[], float] = time.time,
        *,
        capacity: int | None = None,
    ) -> None:
        config = config or RankTableConfig()
        if capacity is not None:  # shorthand for RankTableConfig(ring=...)
            config = replace(config, ring=capacity, window=min(config.window, capacity))
        self.config = config
        self._clock = clock
        self._lock = threading.Lock()
        self._jobs: dict[str, dict[int, _RankState]] = {}
        self._registered: set[str] = set()
        self._world: dict[str, int] = {}
        """Registered jobs' rank counts: a message naming a rank at or past it is dropped."""
        self._count = 0
        self._bytes = 0
        self.evicted_foreign_total = 0
        self._evict_scan_at = float("-inf")
        """Jobs nobody registered, evicted after telemetry.foreign_idle_s of silence."""

    # -- writing ------------------------------------------------------------------------------

    def add(self, msg: Telemetry, now: float | None = None) -> str | None:
        """Store one message; returns None, or the reason it was rejected."""
        result = self.add_many((msg,), now)
        return next(iter(result.rejected), None)

    def add_many(self, msgs: Iterable[Telemetry], now: float | None = None) -> AddResult:
        """Store a batch under one lock. ``now`` is the arrival time (default: the table's clock)."""
        if now is None:
            now = self._clock()
        accepted: list[Telemetry] = []
        rejected: dict[str, int] = {}
        cfg = self.config
        ring, window, budget = cfg.ring, cfg.window, cfg.max_bytes
        with self._lock:
            jobs = self._jobs
            for msg in msgs:
                ranks = jobs.get(msg.job)
                state = ranks.get(msg.rank) if ranks is not None else None
                size = message_bytes(msg)
                if state is None:
                    world = self._world.get(msg.job)
                    if world is not None and msg.rank >= world:
                        rejected["rank_range"] = rejected.get("rank_range", 0) + 1
                        continue
                    if ranks is None and msg.job not in self._registered:
                        if not cfg.accept_unknown_jobs:
                            rejected["unknown_job"] = rejected.get("unknown_job", 0) + 1
                            continue
                        if self._foreign_count() >= cfg.max_foreign_jobs and (
                                now < self._evict_scan_at or not self._evict_idle_foreign(now)):
                            rejected["foreign_limit"] = rejected.get("foreign_limit", 0) + 1
                            continue
                    if self._count >= cfg.max_ranks:
                        rejected["table_full"] = rejected.get("table_full", 0) + 1
                        continue
                    need = RANK_BYTES + window * size
                    if self._bytes + need > budget and not (
                            msg.job in self._registered and self._make_room(need, budget)):
                        rejected["table_bytes"] = rejected.get("table_bytes", 0) + 1
                        continue
                    if ranks is None:
                        ranks = jobs[msg.job] = {}
                    state = ranks[msg.rank] = _RankState(ring)
                    self._count += 1
                    self._bytes += state.bytes
                q = state.ring
                if len(q) == q.maxlen:
                    gone = message_bytes(q[0])
                    state.bytes -= gone
                    self._bytes -= gone
                q.append(msg)
                state.bytes += size
                self._bytes += size
                # Over budget: this rank gives up its oldest messages past the median window.
                while self._bytes > budget and len(q) > window:
                    gone = message_bytes(q.popleft())
                    state.bytes -= gone
                    self._bytes -= gone
                state.last_seen = now
                state.messages += 1
                state.samples_total += msg.samples
                state.tokens_total += msg.tokens
                accepted.append(msg)
        return AddResult(accepted, rejected)

    def _foreign_count(self) -> int:
        return sum(1 for j in self._jobs if j not in self._registered)

    def _drop(self, job: str) -> None:
        ranks = self._jobs.pop(job, None)
        if ranks:
            self._count -= len(ranks)
            self._bytes -= sum(r.bytes for r in ranks.values())

    def _evict_idle_foreign(self, now: float) -> int:
        """Under the lock: drop jobs nobody registered that sent nothing for foreign_idle_s. A
        flood of new job ids looks at most once a second (each look reads every foreign rank)."""
        self._evict_scan_at = now + 1.0
        idle = [job for job, ranks in self._jobs.items() if job not in self._registered
                and now - max((r.last_seen for r in ranks.values()), default=0.0) >= self.config.foreign_idle_s]
        for job in idle:
            self._drop(job)
        self.evicted_foreign_total += len(idle)
        return len(idle)

    def _make_room(self, need: int, budget: int) -> bool:
        """Under the lock: a job this agent launched comes first. Jobs nobody registered leave,
        the longest silent first, until ``need`` bytes fit; returns whether they do."""
        foreign = sorted((max((r.last_seen for r in ranks.values()), default=0.0), job)
                         for job, ranks in self._jobs.items() if job not in self._registered)
        for _seen, job in foreign:
            if self._bytes + need <= budget:
                break
            self._drop(job)
            self.evicted_foreign_total += 1
        return self._bytes + need <= budget

    def evict_idle_foreign(self, now: float | None = None) -> int:
        """Drop silent jobs nobody registered (the daemon calls it every tick); returns how many."""
        with self._lock:
            return self._evict_idle_foreign(self._clock() if now is None else now)

    @property
    def bytes_used(self) -> int:
        """Estimated memory the table holds (``max_bytes`` bounds it)."""
        with self._lock:
            return self._bytes

    def set_accept_unknown_jobs(self, accept: bool) -> None:
        with self._lock:
            self.config = replace(self.config, accept_unknown_jobs=accept)

    def register_job(self, job: str, world_size: int | None = None) -> None:
        """Mark a job as known, so its telemetry is kept even when unknown jobs are rejected.
        ``world_size``: its rank count; a message naming a rank at or past it is dropped
        (``rank_range``), so one job's ranks cannot fill the table with invented rank numbers."""
        with self._lock:
            self._registered.add(job)
            if world_size is not None:
                self._world[job] = world_size
                for rank in [r for r in self._jobs.get(job, {}) if r >= world_size]:
                    self._bytes -= self._jobs[job].pop(rank).bytes
                    self._count -= 1

    def forget_job(self, job: str) -> None:
        """Drop everything about a job (it ended or was cleaned up); it is unregistered too."""
        with self._lock:
            self._registered.discard(job)
            self._world.pop(job, None)
            self._drop(job)

    # -- reading ------------------------------------------------------------------------------

    def jobs(self) -> list[str]:
        with self._lock:
            return sorted(self._jobs)

    def window(self, job: str, rank: int, n: int | None = None) -> list[Telemetry]:
        """The newest ``n`` messages of one rank (all kept ones when n is None), oldest first."""
        with self._lock:
            state = self._jobs.get(job, {}).get(rank)
            if state is None:
                return []
            ring = state.ring
            if n is None or n >= len(ring):
                return list(ring)
            if n <= 0:
                return []
            # Index from the right end: a deque is cheap to index near its ends.
            return [ring[i] for i in range(len(ring) - n, len(ring))]

    def latest(self, job: str, rank: int) -> Telemetry | None:
        with self._lock:
            state = self._jobs.get(job, {}).get(rank)
            return state.ring[-1] if state is not None and state.ring else None

    def snapshot(self) -> TableSnapshot:
        """Immutable figures for every rank. Medians are computed outside the lock so a large
        table does not stall the receiver thread."""
        w = self.config.window
        todo: list[tuple[str, int, _Counts, list[Telemetry]]] = []
        cached: list[tuple[str, int, RankView]] = []
        with self._lock:
            taken_at = self._clock()
            for job, ranks in self._jobs.items():
                for rank, state in ranks.items():
                    view = state.view
                    if view is not None and view.messages == state.messages:
                        cached.append((job, rank, view))
                        continue
                    recent = list(islice(reversed(state.ring), w))
                    recent.reverse()
                    # Copy the counters: the live state keeps changing once the lock is released.
                    counts = _Counts(state.last_seen, state.messages, state.samples_total, state.tokens_total)
                    todo.append((job, rank, counts, recent))
        out: dict[str, dict[int, RankView]] = {}
        for job, rank, view in cached:
            out.setdefault(job, {})[rank] = view
        fresh: list[tuple[str, int, RankView]] = []
        for job, rank, counts, recent in todo:
            view = _view(job, rank, counts, recent)
            out.setdefault(job, {})[rank] = view
            fresh.append((job, rank, view))
        if fresh:
            with self._lock:
                for job, rank, view in fresh:
                    live = self._jobs.get(job, {}).get(rank)
                    if live is not None and live.messages == view.messages:
                        live.view = view
        return TableSnapshot(
            taken_at=taken_at,
            jobs=MappingProxyType(
                {job: MappingProxyType(dict(sorted(ranks.items()))) for job, ranks in sorted(out.items())}
            ),
        )

    def __len__(self) -> int:
        with self._lock:
            return self._count
