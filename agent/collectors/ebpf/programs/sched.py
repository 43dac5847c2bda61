"""Scheduler programs: run-queue latency (node and per rank) and off-CPU time of rank threads."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from ..hist import Log2Hist
from .base import MapReader, Program, hist_from, percpu_hist

SWITCH = "sched:sched_switch"
WAKEUP = "sched:sched_wakeup"
WAKEUP_NEW = "sched:sched_wakeup_new"


@dataclass(frozen=True)
class RunqSnapshot:
    node: Log2Hist = Log2Hist()
    ranks: dict[int, Log2Hist] = field(default_factory=dict)  # rank slot -> histogram


class RunqLatency(Program):
    """Time from becoming runnable (wakeup, or preemption) to running, as runqlat measures it."""

    name = "runqlat"
    hooks = ((WAKEUP, "tg_runq_wakeup"), (WAKEUP_NEW, "tg_runq_wakeup_new"), (SWITCH, "tg_runq_switch"))
    optional = frozenset({WAKEUP_NEW})
    rank_arrays = ("tg_runq_rank",)

    def check_fields(self) -> str | None:
        return self.need_fields(SWITCH, "prev_pid", "prev_state", "next_pid") or self.need_fields(WAKEUP, "pid")

    def body(self) -> str:
        wakeup_new = ""
        if self.has(WAKEUP_NEW):
            wakeup_new = """
int tg_runq_wakeup_new(struct tg_args_sched_wakeup_new *args) {
    return tg_runq_enqueue(args->pid, bpf_ktime_get_ns());
}"""
        return """
/* tid -> when it became runnable, 0 once it ran. Entries are overwritten in place and never
   deleted: a hash update or delete costs ~100-120 ns each, a lookup ~20 ns, and this runs on
   every context switch. The LRU map evicts the threads that are gone. */
BPF_TABLE("lru_hash", u32, u64, tg_runq_start, 32768);
BPF_PERCPU_ARRAY(tg_runq_node, struct tg_hist, 1);
BPF_ARRAY(tg_runq_rank, struct tg_hist, TG_MAX_TRACKED);

static __always_inline int tg_runq_enqueue(u32 tid, u64 ts) {
    if (tid == 0)
        return 0;
    u64 *p = tg_runq_start.lookup(&tid);
    if (p)
        *p = ts;
    else
        tg_runq_start.update(&tid, &ts);
    return 0;
}

int tg_runq_wakeup(struct tg_args_sched_wakeup *args) {
    return tg_runq_enqueue(args->pid, bpf_ktime_get_ns());
}
""" + wakeup_new + """
int tg_runq_switch(struct tg_args_sched_switch *args) {
    u64 now = bpf_ktime_get_ns();
    tg_current_idx1();  /* learn prev's thread id if it belongs to a rank */
    if (TG_RUNNABLE(args->prev_state))
        tg_runq_enqueue(args->prev_pid, now);
    u32 next = args->next_pid;
    if (next == 0)
        return 0;
    u64 *tsp = tg_runq_start.lookup(&next);
    if (!tsp || *tsp == 0)
        return 0;
    u64 delta = now - *tsp;
    *tsp = 0;
    u32 zero = 0;
    struct tg_hist *h = tg_runq_node.lookup(&zero);
    if (h)
        tg_hist_add_percpu(h, delta);
    u32 idx1 = tg_tid_idx1(next);
    if (idx1) {
        u32 i = idx1 - 1;
        struct tg_hist *r = tg_runq_rank.lookup(&i);
        if (r)
            tg_hist_add(r, delta);
    }
    return 0;
}
"""

    def read(self, module: MapReader, idxs: Iterable[int]) -> RunqSnapshot:
        return RunqSnapshot(
            node=percpu_hist(module.percpu_get("tg_runq_node", 0)),
            ranks={i: hist_from(module.array_get("tg_runq_rank", i)) for i in idxs},
        )


@dataclass(frozen=True)
class OffCpu:
    """Cumulative off-CPU time of one rank's threads, split by why they were off."""

    runnable_ns: int = 0  # preempted or yielded: wanted the CPU
    blocked_ns: int = 0  # slept: I/O, locks, futex (a collective's wait), page-in
    runnable_n: int = 0
    blocked_n: int = 0
    io_ns: int = 0  # the part of blocked_ns in uninterruptible sleep (disk I/O, page-in), not a lock's or a peer's wait
    io_n: int = 0


@dataclass(frozen=True)
class OffCpuSnapshot:
    ranks: dict[int, OffCpu] = field(default_factory=dict)


class OffCpuTime(Program):
    """Off-CPU time of tracked rank threads, switch-out to switch-in (offcputime's measure)."""

    name = "offcpu"
    hooks = ((SWITCH, "tg_offcpu_switch"),)
    rank_arrays = ("tg_offcpu_rank",)

    def check_fields(self) -> str | None:
        return self.need_fields(SWITCH, "prev_pid", "prev_state", "next_pid")

    def body(self) -> str:
        return """
struct tg_off { u64 ts; u32 idx; u32 kind; };  /* kind: 0 slept, 1 runnable, 2 slept uninterruptible */
struct tg_offcpu { u64 runnable_ns; u64 blocked_ns; u64 runnable_n; u64 blocked_n; u64 io_ns; u64 io_n; };
BPF_TABLE("lru_hash", u32, struct tg_off, tg_off_start, 32768);  /* rank threads off CPU (ts 0: on) */
BPF_ARRAY(tg_offcpu_rank, struct tg_offcpu, TG_MAX_TRACKED);

int tg_offcpu_switch(struct tg_args_sched_switch *args) {
    u32 idx1 = tg_current_idx1();
    u32 next = args->next_pid;
    struct tg_off *o = tg_off_start.lookup(&next);
    if (!idx1 && (!o || o->ts == 0))
        return 0;  /* the common case: neither side is a rank thread */
    u64 now = bpf_ktime_get_ns();
    u32 prev = args->prev_pid;
    if (idx1 && prev) {
        struct tg_off o = {};
        o.ts = now;
        o.idx = idx1 - 1;
        /* TASK_UNINTERRUPTIBLE (D, 0x2): waiting on the disk or a page-in; a futex, an epoll or a
           socket read (a collective waiting for a peer, an idle helper thread) sleeps interruptibly. */
        o.kind = TG_RUNNABLE(args->prev_state) ? 1 : ((args->prev_state & 0x2) ? 2 : 0);
        struct tg_off *old = tg_off_start.lookup(&prev);
        if (old)
            *old = o;
        else
            tg_off_start.update(&prev, &o);
    }
    if (!o || o->ts == 0)
        return 0;
    u64 delta = now - o->ts;
    u32 i = o->idx;
    u32 kind = o->kind;
    o->ts = 0;
    struct tg_offcpu *c = tg_offcpu_rank.lookup(&i);
    if (!c)
        return 0;
    if (kind == 1) {
        __sync_fetch_and_add(&c->runnable_ns, delta);
        __sync_fetch_and_add(&c->runnable_n, 1);
    } else {
        __sync_fetch_and_add(&c->blocked_ns, delta);
        __sync_fetch_and_add(&c->blocked_n, 1);
        if (kind == 2) {
            __sync_fetch_and_add(&c->io_ns, delta);
            __sync_fetch_and_add(&c->io_n, 1);
        }
    }
    return 0;
}
"""

    def read(self, module: MapReader, idxs: Iterable[int]) -> OffCpuSnapshot:
        out = {}
        for i in idxs:
            v = module.array_get("tg_offcpu_rank", i)
            out[i] = OffCpu(int(v.runnable_ns), int(v.blocked_ns), int(v.runnable_n), int(v.blocked_n),
                            int(v.io_ns), int(v.io_n))
        return OffCpuSnapshot(out)
