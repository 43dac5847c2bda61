"""Pure view models: agent status dicts in, rows and labels for the panels out.

No Textual here and no clock of its own (``now`` is passed in), so every rule about what the
on-call engineer sees (what "stalled" means, how a straggler is flagged, what "n/a" stands for) is a
plain function with plain tests.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from trainguard.tui.source import AgentSnapshot

NA = "n/a"
STRAGGLER_FLAG = 0.8  # scores below this are highlighted (1.0: as fast as the fastest rank)
SILENT_MIN_S = 5.0  # a rank quiet for longer than this and 10 median steps is shown as silent
TIER_ORDER = {"memory": 0, "peer": 1, "disk": 2, "object": 3}


def num(value: Any) -> float | None:
    """A finite number, or None (missing, null, NaN, a string)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def fmt_ms(seconds: Any) -> str:
    v = num(seconds)
    return NA if v is None else f"{v * 1e3:.1f}"


def fmt_float(value: Any, digits: int = 4) -> str:
    v = num(value)
    if v is None:
        return "nan" if isinstance(value, float) and math.isnan(value) else NA
    return f"{v:.{digits}g}"


def fmt_pct(frac: Any) -> str:
    v = num(frac)
    return NA if v is None else f"{v * 100:.0f}%"


def fmt_bytes(n: Any) -> str:
    v = num(n)
    if v is None:
        return NA
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(v) < 1000 or unit == "TB":
            return f"{v:.0f} {unit}" if unit == "B" else f"{v:.1f} {unit}"
        v /= 1000
    return NA  # unreachable


def fmt_age(seconds: Any) -> str:
    v = num(seconds)
    if v is None:
        return NA
    v = max(0.0, v)
    if v < 120:
        return f"{v:.0f}s"
    if v < 7200:
        return f"{v / 60:.0f}m"
    if v < 172800:
        return f"{v / 3600:.1f}h"
    return f"{v / 86400:.1f}d"


# -- ranks ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RankRow:
    """One rank as the ranks table shows it."""

    agent: str
    node: str
    job: str
    rank: int
    state: str
    step: int | None
    step_s: float | None
    compute_s: float | None
    comm_s: float | None
    data_s: float | None
    score: float | None
    cause: str
    batch_size: int | None
    batch_share: float | None
    loss: float | None
    pid: int | None

    @property
    def key(self) -> str:
        return f"{self.agent}|{self.job}|{self.rank}"

    @property
    def straggling(self) -> bool:
        return self.score is not None and self.score < STRAGGLER_FLAG

    @property
    def healthy(self) -> bool:
        return self.state in ("running", "external")

    def detail(self) -> str:
        """The whole row in one line, for narrow terminals where the table scrolls sideways."""
        parts = [f"{self.job} rank {self.rank} on {self.node}: {self.state}",
                 f"step {NA if self.step is None else self.step}",
                 f"{fmt_ms(self.step_s)} ms = compute {fmt_ms(self.compute_s)} + comm {fmt_ms(self.comm_s)}"
                 f" + data {fmt_ms(self.data_s)}",
                 f"score {NA if self.score is None else f'{self.score:.2f}'}"
                 + (f" ({self.cause})" if self.cause else ""),
                 f"batch {NA if self.batch_size is None else self.batch_size} ({fmt_pct(self.batch_share)})",
                 f"loss {fmt_float(self.loss)}"]
        if self.pid is not None:
            parts.append(f"pid {self.pid}")
        return ", ".join(parts)

    def text(self) -> str:
        """Everything a filter may match."""
        return " ".join(str(c) for c in (self.node, self.job, f"rank{self.rank}", self.rank, self.state, self.cause,
                                         "straggler" if self.straggling else ""))


@dataclass(frozen=True)
class Column:
    key: str
    label: str
    cell: Callable[[RankRow], str]
    sort: Callable[[RankRow], Any]


def _none_last(value: Any) -> tuple[int, Any]:
    return (1, 0) if value is None else (0, value)


RANK_COLUMNS: tuple[Column, ...] = (
    Column("node", "node", lambda r: r.node, lambda r: r.node),
    Column("job", "job", lambda r: r.job, lambda r: r.job),
    Column("rank", "rank", lambda r: str(r.rank), lambda r: (r.job, r.rank)),
    Column("state", "state", lambda r: r.state, lambda r: r.state),
    Column("step", "step", lambda r: NA if r.step is None else str(r.step), lambda r: _none_last(r.step)),
    Column("step_ms", "step ms", lambda r: fmt_ms(r.step_s), lambda r: _none_last(r.step_s)),
    Column("compute_ms", "comp ms", lambda r: fmt_ms(r.compute_s), lambda r: _none_last(r.compute_s)),
    Column("comm_ms", "comm ms", lambda r: fmt_ms(r.comm_s), lambda r: _none_last(r.comm_s)),
    Column("score", "score", lambda r: NA if r.score is None else f"{r.score:.2f}" + (" !" if r.straggling else ""),
           lambda r: _none_last(r.score)),
    Column("cause", "cause", lambda r: r.cause or ("-" if r.score is not None else NA), lambda r: r.cause),
    Column("share", "batch", lambda r: (NA if r.batch_size is None else f"{r.batch_size} {fmt_pct(r.batch_share)}"),
           lambda r: _none_last(r.batch_share)),
    Column("loss", "loss", lambda r: fmt_float(r.loss), lambda r: _none_last(r.loss)),
    Column("data_ms", "data ms", lambda r: fmt_ms(r.data_s), lambda r: _none_last(r.data_s)),
    Column("pid", "pid", lambda r: NA if r.pid is None else str(r.pid), lambda r: _none_last(r.pid)),
)
COLUMN_KEYS = tuple(c.key for c in RANK_COLUMNS)


def rank_state(rank: Mapping[str, Any], job_state: str, now: float) -> str:
    """running / exited N / killed SIGn / silent Ns / the job's state for ranks not running."""
    if rank.get("exit_signal"):
        return f"killed {rank['exit_signal']}"
    if rank.get("exit_code") is not None and rank.get("alive") is False:
        return f"exit {rank['exit_code']}"
    if rank.get("alive") is False:
        return "gone"
    tel = rank.get("telemetry") or {}
    last = num(tel.get("last_seen"))
    median = num(tel.get("median_step_s")) or 0.0
    if last is not None and job_state in ("running", "external"):
        quiet = now - last
        if quiet > max(SILENT_MIN_S, 10 * median):
            return f"silent {fmt_age(quiet)}"
    if job_state == "external":
        return "external"
    return "running" if job_state in ("running", "") else job_state


def rank_rows(snapshots: Iterable[AgentSnapshot], now: float) -> list[RankRow]:
    rows: list[RankRow] = []
    for snap in snapshots:
        if snap.status is None:
            continue
        for job in snap.status.get("jobs", []):
            ranks = job.get("ranks", [])
            sizes = [num((r.get("telemetry") or {}).get("batch_size")) for r in ranks]
            total = sum(s for s in sizes if s is not None)
            for r, size in zip(ranks, sizes, strict=True):
                if not isinstance(r.get("rank"), int):
                    continue  # not a rank this dashboard can name; the rest of the job still shows
                tel = r.get("telemetry") or {}
                step_s = num(tel.get("median_step_s")) if num(tel.get("median_step_s")) is not None else num(tel.get("step_s"))
                compute_s = num(tel.get("median_compute_s"))
                if compute_s is None:
                    compute_s = num(tel.get("compute_s"))
                comm_s = num(tel.get("median_comm_s"))
                if comm_s is None:
                    comm_s = num(tel.get("comm_s"))
                data_s = num(tel.get("median_data_s"))
                if data_s is None:
                    data_s = num(tel.get("data_s"))
                step = tel.get("step")
                pid = r.get("pid", tel.get("pid"))
                rows.append(RankRow(
                    agent=snap.agent, node=snap.node, job=str(job.get("job", "?")), rank=r["rank"],
                    state=rank_state(r, str(job.get("state", "")), now),
                    step=step if isinstance(step, int) else None,
                    step_s=step_s, compute_s=compute_s, comm_s=comm_s, data_s=data_s,
                    score=num(tel.get("straggler_score", r.get("straggler_score"))),
                    cause=str(tel.get("straggler_cause") or r.get("straggler_cause") or ""),
                    batch_size=int(size) if size is not None else None,
                    batch_share=(size / total) if size is not None and total > 0 else None,
                    loss=num(tel.get("loss")) if "loss" in tel else None,
                    pid=pid if isinstance(pid, int) else None,
                ))
    return rows


def matches(text: str, query: str) -> bool:
    """Every space-separated word of ``query`` occurs in ``text`` (case-insensitive)."""
    low = text.lower()
    return all(word in low for word in query.lower().split())


def select_rows(rows: Sequence[RankRow], query: str, sort_key: str, reverse: bool) -> list[RankRow]:
    column = next((c for c in RANK_COLUMNS if c.key == sort_key), RANK_COLUMNS[2])
    picked = [r for r in rows if matches(r.text(), query)] if query else list(rows)
    # Ties keep a stable node/job/rank order, so the table does not shuffle between refreshes.
    picked.sort(key=lambda r: (r.node, r.job, r.rank))
    picked.sort(key=column.sort, reverse=reverse)
    return picked


# -- overview ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class JobLine:
    node: str
    job: str
    state: str
    attempt: str
    restarts: str
    ranks: str
    step: str
    speed: str
    plan: str


def job_lines(snapshots: Iterable[AgentSnapshot], now: float) -> list[JobLine]:
    lines = []
    for snap in snapshots:
        if snap.status is None:
            continue
        for job in snap.status.get("jobs", []):
            ranks = job.get("ranks", [])
            alive = sum(1 for r in ranks if r.get("alive", True))
            tels = [r.get("telemetry") or {} for r in ranks]
            steps = [t["step"] for t in tels if isinstance(t.get("step"), int)]
            rates = [num(t.get("steps_per_s")) for t in tels]
            rate = min((v for v in rates if v is not None), default=None)
            tokens = sum(v for v in (num(t.get("tokens_per_s")) for t in tels) if v is not None)
            plan = job.get("plan") or {}
            speed = NA if rate is None else f"{rate:.1f} st/s" + (f" {tokens / 1e3:.1f}k tok/s" if tokens else "")
            plan_text = NA if not plan else (
                f"v{plan.get('version', '?')} lr×{fmt_float(plan.get('lr_scale'), 3)}"
                + (f" lr={fmt_float(plan.get('lr'), 3)}" if plan.get("lr") is not None else ""))
            lines.append(JobLine(
                node=snap.node, job=str(job.get("job", "?")), state=str(job.get("state", "?")),
                attempt=str(job.get("attempt", "-")), restarts=str(job.get("restarts", 0)),
                ranks=f"{alive}/{len(ranks)}", step=str(max(steps)) if steps else NA, speed=speed, plan=plan_text,
            ))
    return lines


def collector_summary(status: Mapping[str, Any]) -> list[tuple[str, bool, str]]:
    """(name, up, reason) per collector, sorted by name."""
    out = []
    for name, c in sorted((status.get("collectors") or {}).items()):
        up = bool(c.get("up")) if isinstance(c, Mapping) else bool(c)
        reason = str(c.get("reason") or "") if isinstance(c, Mapping) else ""
        out.append((name, up, reason))
    return out


# -- GPUs -------------------------------------------------------------------------------------------

GPU_HEADERS = ("node", "gpu", "name", "util", "memory", "temp", "power", "throttle", "XID", "ECC")


def _gpu_list(raw: Any) -> list[Mapping[str, Any]]:
    if isinstance(raw, Mapping):
        return [dict(v, index=v.get("index", k)) for k, v in sorted(raw.items()) if isinstance(v, Mapping)]
    if isinstance(raw, list):
        return [g for g in raw if isinstance(g, Mapping)]
    return []


def gpu_rows(snapshots: Iterable[AgentSnapshot]) -> list[tuple[str, ...]]:
    """Cells per GPU, from a status ``gpus`` key (a list of readings, or a dict index -> reading)."""
    rows: list[tuple[str, ...]] = []
    for snap in snapshots:
        if snap.status is None:
            continue
        for g in _gpu_list(snap.status.get("gpus")):
            util = num(g.get("utilization_gpu_pct", g.get("util_pct")))
            used, total = num(g.get("memory_used_bytes")), num(g.get("memory_total_bytes"))
            power, limit = num(g.get("power_w")), num(g.get("power_limit_w"))
            temp = num(g.get("temperature_c"))
            reasons = g.get("slowdown_reasons") or g.get("throttle_reasons") or []
            xids = g.get("xids", g.get("xid_count"))
            last_xid = g.get("last_xid")
            ecc = num(g.get("ecc_uncorrected"))
            rows.append((
                snap.node, str(g.get("index", "?")), str(g.get("name", NA)),
                NA if util is None else f"{util:.0f}%",
                NA if used is None else f"{fmt_bytes(used)}" + ("" if total is None else f"/{fmt_bytes(total)}"),
                NA if temp is None else f"{temp:.0f}C",
                NA if power is None else f"{power:.0f}W" + ("" if limit is None else f"/{limit:.0f}"),
                ",".join(str(x) for x in reasons) if isinstance(reasons, list | tuple) else str(reasons) or "-",
                (NA if xids is None else str(xids)) + (f" (last {last_xid})" if last_xid is not None else ""),
                NA if ecc is None else f"{ecc:.0f}",
            ))
    return rows


# -- kernel histograms ------------------------------------------------------------------------------

BARS = " ▁▂▃▄▅▆▇█"


@dataclass(frozen=True)
class HistLine:
    node: str
    histogram: str
    series: str
    count: int
    p50_s: float | None
    p99_s: float | None
    bars: str


def log2_quantile_s(slots: Sequence[int], q: float, unit_s: float = 1e-6) -> float | None:
    """Upper bound of the slot holding quantile ``q`` (slot i covers [2^i, 2^(i+1)) units)."""
    total = sum(slots)
    if total <= 0:
        return None
    target = q * total
    seen = 0
    for i, n in enumerate(slots):
        seen += n
        if seen >= target:
            return float(2 ** (i + 1)) * unit_s
    return float(2 ** len(slots)) * unit_s


def sparkbars(slots: Sequence[int]) -> str:
    """One bar per slot from the first to the last non-empty one, log-scaled so rare tails show."""
    nz = [i for i, n in enumerate(slots) if n > 0]
    if not nz:
        return ""
    part = slots[nz[0]: nz[-1] + 1]
    top = math.log1p(max(part))
    return "".join(BARS[0 if n <= 0 else max(1, round(math.log1p(n) / top * (len(BARS) - 1)))] for n in part)


def _slots(h: Any) -> list[int] | None:
    if isinstance(h, Mapping):
        h = h.get("slots")
    if isinstance(h, list | tuple) and all(isinstance(x, int) and not isinstance(x, bool) for x in h):
        return list(h)
    return None


def kernel_lines(snapshots: Iterable[AgentSnapshot]) -> list[HistLine]:
    """From a status ``kernel`` key: ``{histogram name: {series: {"slots": [...], "sum_ns": n}}}``
    (log2 µs slots as the eBPF programs keep them; a bare list of slots also works)."""
    lines = []
    for snap in snapshots:
        if snap.status is None or not isinstance(snap.status.get("kernel"), Mapping):
            continue
        for hname, series in sorted(snap.status["kernel"].items()):
            if not isinstance(series, Mapping):
                continue
            for sname, h in sorted(series.items(), key=lambda kv: str(kv[0])):
                slots = _slots(h)
                if slots is None:
                    continue
                unit = 1e-6
                if isinstance(h, Mapping) and num(h.get("unit_s")) is not None:
                    unit = float(h["unit_s"])
                lines.append(HistLine(snap.node, str(hname), str(sname), sum(slots),
                                      log2_quantile_s(slots, 0.5, unit), log2_quantile_s(slots, 0.99, unit),
                                      sparkbars(slots)))
    return lines


def fmt_latency(seconds: float | None) -> str:
    if seconds is None:
        return NA
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f}us"
    if seconds < 1:
        return f"{seconds * 1e3:.1f}ms"
    return f"{seconds:.2f}s"


# -- checkpoints ------------------------------------------------------------------------------------

CKPT_HEADERS = ("node", "job", "tier", "newest step", "age", "size", "written", "count")


def checkpoint_rows(snapshots: Iterable[AgentSnapshot], now: float,
                    clock_text: Callable[[float], str]) -> list[tuple[str, ...]]:
    """Per node, job and tier: the newest checkpoint's step, age, size and commit time, and how many
    that tier holds; a tier that could not be listed shows its error."""
    rows: list[tuple[str, ...]] = []
    for snap in snapshots:
        best: dict[tuple[str, str], dict[str, Any]] = {}
        counts: dict[tuple[str, str], int] = {}
        errors: dict[tuple[str, str], str] = {}
        for c in snap.checkpoints:
            if not isinstance(c, Mapping):
                continue
            key = (str(c.get("job", "?")), str(c.get("tier", "?")))
            if c.get("error"):
                errors[key] = str(c["error"])
                continue
            step = c.get("step", c.get("newest_step"))
            if not isinstance(step, int):
                continue
            counts[key] = counts.get(key, 0) + 1
            if key not in best or step > best[key]["step"]:
                best[key] = dict(c, step=step)
        keys = sorted(set(best) | set(errors), key=lambda k: (k[0], TIER_ORDER.get(k[1], 9), k[1]))
        for key in keys:
            if key in best:
                c = best[key]
                created = num(c.get("created", c.get("last_write")))
                age = num(c.get("age_seconds"))
                if age is None and created is not None:
                    age = now - created
                rows.append((snap.node, key[0], key[1], str(c["step"]), fmt_age(age),
                             fmt_bytes(c.get("size", c.get("size_bytes"))),
                             NA if created is None else clock_text(created), str(counts[key])))
            else:
                rows.append((snap.node, key[0], key[1], "error", NA, NA, errors[key][:60], "0"))
    return rows


# -- controller history -----------------------------------------------------------------------------

@dataclass
class Series:
    steps: deque[int] = field(default_factory=lambda: deque(maxlen=HISTORY))
    lr: deque[float] = field(default_factory=lambda: deque(maxlen=HISTORY))
    batch: deque[float] = field(default_factory=lambda: deque(maxlen=HISTORY))
    loss: deque[float] = field(default_factory=lambda: deque(maxlen=HISTORY))


HISTORY = 600


class ControllerHistory:
    """LR, global batch size and mean loss per job over steps, gathered from successive polls
    (one point per new step seen; a restart that goes back in steps starts the series over)."""

    def __init__(self) -> None:
        self.jobs: dict[str, Series] = {}

    def add(self, snapshots: Iterable[AgentSnapshot]) -> bool:
        changed = False
        for snap in snapshots:
            if snap.status is None:
                continue
            for job in snap.status.get("jobs", []):
                tels = [r.get("telemetry") or {} for r in job.get("ranks", [])]
                tels = [t for t in tels if isinstance(t.get("step"), int)]
                if not tels:
                    continue
                step = max(t["step"] for t in tels)
                name = str(job.get("job"))
                series = self.jobs.setdefault(name, Series())
                if series.steps and step < series.steps[-1]:
                    series = self.jobs[name] = Series()
                if series.steps and step == series.steps[-1]:
                    continue
                lrs = [v for v in (num(t.get("lr")) for t in tels) if v is not None]
                batches = [v for v in (num(t.get("batch_size")) for t in tels) if v is not None]
                losses = [v for v in (num(t.get("loss")) for t in tels) if v is not None]
                series.steps.append(step)
                series.lr.append(max(lrs) if lrs else math.nan)
                series.batch.append(sum(batches) if batches else math.nan)
                series.loss.append(sum(losses) / len(losses) if losses else math.nan)
                changed = True
        return changed


# -- events -----------------------------------------------------------------------------------------

EVENT_HEADERS = ("seq", "time", "sev", "kind", "where", "message", "cause / action")


def event_where(e: Mapping[str, Any], with_node: bool) -> str:
    parts = []
    if with_node and e.get("node"):
        parts.append(str(e["node"]))
    if e.get("job"):
        parts.append(str(e["job"]))
    if e.get("rank") is not None:
        parts.append(f"r{e['rank']}")
    return "/".join(parts) or "-"


def event_cause(e: Mapping[str, Any]) -> str:
    fields = e.get("fields") if isinstance(e.get("fields"), Mapping) else {}
    parts = []
    if e.get("cause"):
        parts.append(str(e["cause"]))
    action = fields.get("action") if fields else None
    if action:
        parts.append(f"→ {action}")
    return " ".join(parts) or "-"


def event_text(e: Mapping[str, Any]) -> str:
    return " ".join(str(e.get(k, "")) for k in ("kind", "severity", "node", "job", "rank", "message", "cause")) + \
        " " + str(e.get("fields", ""))
