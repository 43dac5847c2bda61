"""What every eBPF program class shares: the probe environment, the common C prelude, the base class.

A program is rendered as C text (``render``), compiled together with the others into one BPF object
by the collector (one clang run instead of seven), attached (``attach``), read once per interval
(``read``), and detached (``detach``). The prelude holds what they share: the tracked-TGID map
(the agent's rank registry, kept current by ``track``), a thread -> rank-slot map so events that
only see a thread id (wakeups, switch-in) can be attributed, the log2 slot helper and the event
ring buffer.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from .. import btf
from ..hist import NSLOTS, Log2Hist
from ..tracefs import Field, Tracefs, render_struct

MAX_TRACKED = 128  # rank slots (processes), per node

# sched_switch's prev_state: 0 is TASK_RUNNING (a yield); a preempted task is reported as
# TASK_REPORT_MAX (0x100 since 4.14), above every real sleep state bit. Both are runnable.
PRELUDE = f"""
#include <uapi/linux/ptrace.h>
#define TG_MAX_TRACKED {MAX_TRACKED}
#define TG_NSLOTS {NSLOTS}
#define TG_RUNNABLE(state) ((state) == 0 || (state) >= 0x100)

struct tg_hist {{ u64 slots[TG_NSLOTS]; u64 sum_ns; }};

BPF_HASH(tg_tracked, u32, u32, 1024);                  /* tgid -> rank slot */
BPF_TABLE("lru_hash", u32, u32, tg_tid_idx, 32768);    /* thread id -> rank slot */
BPF_RINGBUF_OUTPUT(tg_events, 16);                     /* exit / OOM events, 64 KiB */
BPF_PERCPU_ARRAY(tg_event_drops, u64, 1);

static __always_inline u32 tg_slot(u64 delta_ns) {{
    u32 s = bpf_log2l(delta_ns / 1000);
    s = s ? s - 1 : 0;
    if (s >= TG_NSLOTS)
        s = TG_NSLOTS - 1;
    return s & (TG_NSLOTS - 1);
}}

/* per-CPU copy: no atomics needed */
static __always_inline void tg_hist_add_percpu(struct tg_hist *h, u64 delta_ns) {{
    h->slots[tg_slot(delta_ns)] += 1;
    h->sum_ns += delta_ns;
}}

static __always_inline void tg_hist_add(struct tg_hist *h, u64 delta_ns) {{
    __sync_fetch_and_add(&h->slots[tg_slot(delta_ns)], 1);
    __sync_fetch_and_add(&h->sum_ns, delta_ns);
}}

/* Rank slot + 1 of the current task if its thread group is tracked, else 0. Remembers the
   thread so that later events that only carry its thread id can be attributed. */
static __always_inline u32 tg_current_idx1(void) {{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32, tid = (u32)id;
    u32 *idx = tg_tracked.lookup(&tgid);
    if (!idx)
        return 0;
    u32 v = *idx;
    u32 *known = tg_tid_idx.lookup(&tid);
    if (!known || *known != v)
        tg_tid_idx.update(&tid, &v);
    return v + 1;
}}

static __always_inline u32 tg_tid_idx1(u32 tid) {{
    u32 *idx = tg_tid_idx.lookup(&tid);
    return idx ? *idx + 1 : 0;
}}

static __always_inline void tg_count_drop(void) {{
    u32 zero = 0;
    u64 *d = tg_event_drops.lookup(&zero);
    if (d)
        *d += 1;
}}
"""


@dataclass
class ProbeEnv:
    """What programs probe and render against: the running kernel's tracefs and (lazily) BTF."""

    tracefs: Tracefs
    btf_loader: Callable[[], btf.Btf] = btf.load
    _btf: btf.Btf | None = field(default=None, repr=False)
    _btf_error: str | None = field(default=None, repr=False)

    def btf(self) -> btf.Btf | None:
        if self._btf is None and self._btf_error is None:
            try:
                self._btf = self.btf_loader()
            except btf.BtfError as exc:
                self._btf_error = str(exc)
        return self._btf


class MapReader(Protocol):
    """The slice of loader.LoadedModule programs use (typed here so tests can fake it)."""

    def attach_tracepoint(self, tracepoint: str, fn_name: str) -> None: ...
    def detach(self, tracepoint: str, fn_name: str) -> None: ...
    def array_get(self, name: str, index: int) -> Any: ...
    def percpu_get(self, name: str, index: int) -> list[Any]: ...
    def array_zero(self, name: str, index: int) -> None: ...
    def hash_items(self, name: str) -> list[tuple[Any, Any]]: ...


def hist_from(value: Any) -> Log2Hist:
    return Log2Hist(tuple(int(x) for x in value.slots), int(value.sum_ns))


def percpu_hist(values: Iterable[Any]) -> Log2Hist:
    total = Log2Hist()
    for v in values:
        total = total + hist_from(v)
    return total


def tp_struct_name(tracepoint: str) -> str:
    return "tg_args_" + tracepoint.split(":")[1]


class Program(ABC):
    """One eBPF program: its tracepoints, its C text, its maps, its snapshot."""

    name: ClassVar[str]
    # (tracepoint, C function) pairs; all must exist unless listed in ``optional``.
    hooks: ClassVar[tuple[tuple[str, str], ...]]
    optional: ClassVar[frozenset[str]] = frozenset()
    # per-rank-slot maps zeroed when a slot is given to a new process
    rank_arrays: ClassVar[tuple[str, ...]] = ()

    def __init__(self, env: ProbeEnv) -> None:
        self.env = env
        self.fields: dict[str, dict[str, Field]] = {}
        self.attached: list[tuple[str, str]] = []

    def probe(self) -> str | None:
        """None if this program can load here, else why not (one line)."""
        for tp, _fn in self.hooks:
            if self.env.tracefs.exists(tp):
                self.fields[tp] = self.env.tracefs.fields(tp)
            elif tp not in self.optional:
                return f"tracepoint {tp} not available"
        return self.check_fields()

    def check_fields(self) -> str | None:
        return None

    def has(self, tracepoint: str, field_name: str = "") -> bool:
        fs = self.fields.get(tracepoint)
        return fs is not None and (not field_name or field_name in fs)

    def need_fields(self, tracepoint: str, *names: str) -> str | None:
        missing = [n for n in names if not self.has(tracepoint, n)]
        return f"tracepoint {tracepoint} lacks fields {', '.join(missing)}" if missing else None

    def structs(self) -> str:
        # Guarded: two programs on one tracepoint (sched_switch) share its record struct.
        out = []
        for tp, fs in self.fields.items():
            name = tp_struct_name(tp)
            guard = name.upper() + "_DEFINED"
            out.append(f"#ifndef {guard}\n#define {guard}\n{render_struct(name, list(fs.values()))}\n#endif")
        return "\n".join(out)

    def render(self) -> str:
        """This program's C text (it needs PRELUDE before it)."""
        return f"/* ---- {self.name} ---- */\n{self.structs()}\n{self.body()}"

    @abstractmethod
    def body(self) -> str: ...

    def attach(self, module: MapReader) -> None:
        for tp, fn in self.hooks:
            if tp in self.fields:
                module.attach_tracepoint(tp, fn)
                self.attached.append((tp, fn))

    def detach(self, module: MapReader) -> None:
        while self.attached:
            module.detach(*self.attached.pop())

    def reset_slot(self, module: MapReader, idx: int) -> None:
        for name in self.rank_arrays:
            module.array_zero(name, idx)

    @abstractmethod
    def read(self, module: MapReader, idxs: Iterable[int]) -> Any:
        """Read this program's maps once: a frozen snapshot (cumulative since attach)."""
