"""Memory stalls: user page faults and direct-reclaim time, node-wide and per rank."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from .base import MapReader, Program

FAULT = "exceptions:page_fault_user"
RECLAIM_BEGIN = "vmscan:mm_vmscan_direct_reclaim_begin"
RECLAIM_END = "vmscan:mm_vmscan_direct_reclaim_end"
MEMCG_BEGIN = "vmscan:mm_vmscan_memcg_reclaim_begin"
MEMCG_END = "vmscan:mm_vmscan_memcg_reclaim_end"


@dataclass(frozen=True)
class FaultSnapshot:
    node: int = 0
    ranks: dict[int, int] = field(default_factory=dict)


class PageFaults(Program):
    name = "pagefaults"
    hooks = ((FAULT, "tg_fault_user"),)
    rank_arrays = ("tg_faults_rank",)

    def body(self) -> str:
        return """
BPF_PERCPU_ARRAY(tg_faults_node, u64, 1);
BPF_ARRAY(tg_faults_rank, u64, TG_MAX_TRACKED);

int tg_fault_user(struct tg_args_page_fault_user *args) {
    u32 zero = 0;
    u64 *n = tg_faults_node.lookup(&zero);
    if (n)
        *n += 1;
    u32 idx1 = tg_current_idx1();
    if (idx1) {
        u32 i = idx1 - 1;
        u64 *c = tg_faults_rank.lookup(&i);
        if (c)
            __sync_fetch_and_add(c, 1);
    }
    return 0;
}
"""

    def read(self, module: MapReader, idxs: Iterable[int]) -> FaultSnapshot:
        node = sum(int(v) for v in module.percpu_get("tg_faults_node", 0))
        return FaultSnapshot(node, {i: int(module.array_get("tg_faults_rank", i)) for i in idxs})


@dataclass(frozen=True)
class Reclaim:
    ns: int = 0
    count: int = 0


@dataclass(frozen=True)
class ReclaimSnapshot:
    node: Reclaim = Reclaim()
    ranks: dict[int, Reclaim] = field(default_factory=dict)


class DirectReclaim(Program):
    """Time a task spent reclaiming memory itself inside an allocation (it stalls meanwhile):
    global direct reclaim, and the reclaim a memory-limited cgroup forces on its own tasks when
    they charge past the limit (where containerised training jobs meet it first)."""

    name = "directreclaim"
    hooks = ((RECLAIM_BEGIN, "tg_reclaim_begin"), (RECLAIM_END, "tg_reclaim_end"),
             (MEMCG_BEGIN, "tg_reclaim_begin"), (MEMCG_END, "tg_reclaim_end"))
    optional = frozenset({MEMCG_BEGIN, MEMCG_END})
    rank_arrays = ("tg_reclaim_rank",)

    def body(self) -> str:
        return """
struct tg_reclaim { u64 ns; u64 count; };
BPF_HASH(tg_reclaim_start, u32, u64, 8192);
BPF_PERCPU_ARRAY(tg_reclaim_node, struct tg_reclaim, 1);
BPF_ARRAY(tg_reclaim_rank, struct tg_reclaim, TG_MAX_TRACKED);

/* Attached to the direct and the memcg begin/end pairs alike; neither reads its record. */
int tg_reclaim_begin(void *args) {
    u32 tid = (u32)bpf_get_current_pid_tgid();
    u64 ts = bpf_ktime_get_ns();
    tg_reclaim_start.update(&tid, &ts);
    return 0;
}

int tg_reclaim_end(void *args) {
    u32 tid = (u32)bpf_get_current_pid_tgid();
    u64 *tsp = tg_reclaim_start.lookup(&tid);
    if (!tsp)
        return 0;
    u64 delta = bpf_ktime_get_ns() - *tsp;
    tg_reclaim_start.delete(&tid);
    u32 zero = 0;
    struct tg_reclaim *n = tg_reclaim_node.lookup(&zero);
    if (n) {
        n->ns += delta;
        n->count += 1;
    }
    u32 idx1 = tg_current_idx1();
    if (idx1) {
        u32 i = idx1 - 1;
        struct tg_reclaim *r = tg_reclaim_rank.lookup(&i);
        if (r) {
            __sync_fetch_and_add(&r->ns, delta);
            __sync_fetch_and_add(&r->count, 1);
        }
    }
    return 0;
}
"""

    def read(self, module: MapReader, idxs: Iterable[int]) -> ReclaimSnapshot:
        ns = count = 0
        for v in module.percpu_get("tg_reclaim_node", 0):
            ns += int(v.ns)
            count += int(v.count)
        ranks = {}
        for i in idxs:
            r = module.array_get("tg_reclaim_rank", i)
            ranks[i] = Reclaim(int(r.ns), int(r.count))
        return ReclaimSnapshot(Reclaim(ns, count), ranks)
