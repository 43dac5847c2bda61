"""Programs whose news cannot wait for the next interval: rank exits and OOM kills.

Each writes a fixed-layout record into the shared ring buffer (``tg_events``); the collector's
event thread decodes it by its leading ``kind`` and emits an agent event within milliseconds.
They also keep counters, read once per interval like every other program.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from dataclasses import dataclass, field

from .base import MapReader, Program

EXIT = "sched:sched_process_exit"
OOM = "oom:mark_victim"

KIND_EXIT = 1
KIND_OOM = 2


@dataclass(frozen=True)
class CountSnapshot:
    node: int = 0
    ranks: dict[int, int] = field(default_factory=dict)


def _read_counts(module: MapReader, node_map: str, rank_map: str, idxs: Iterable[int]) -> CountSnapshot:
    node = sum(int(v) for v in module.percpu_get(node_map, 0))
    return CountSnapshot(node, {i: int(module.array_get(rank_map, i)) for i in idxs})


@dataclass(frozen=True)
class ExitRecord:
    pid: int  # the thread that exited last (its group died with it)
    tgid: int
    slot: int | None  # rank slot, None if not tracked
    wait_status: int | None  # as wait(2) reports it; None when BTF gave no offset to read it
    ktime_ns: int  # CLOCK_MONOTONIC
    comm: str

    @property
    def signal(self) -> int | None:
        return None if self.wait_status is None else self.wait_status & 0x7F

    @property
    def exit_code(self) -> int | None:
        """As subprocess reports it: the exit status, or -signal when a signal killed it."""
        if self.wait_status is None:
            return None
        sig = self.wait_status & 0x7F
        return -sig if sig else (self.wait_status >> 8) & 0xFF

    @property
    def core_dumped(self) -> bool:
        return bool(self.wait_status and self.wait_status & 0x80)


_EXIT_FMT = struct.Struct("<IIIIiIQ16s")


def decode_exit(data: bytes) -> ExitRecord:
    _kind, pid, tgid, idx1, status, has_status, ktime, comm = _EXIT_FMT.unpack_from(data)
    return ExitRecord(pid, tgid, idx1 - 1 if idx1 else None, status if has_status else None, ktime,
                      comm.split(b"\0", 1)[0].decode(errors="replace"))


class ProcessExits(Program):
    """Thread-group exits, with the wait status read from the exiting task_struct.

    The status is ``task->exit_code`` (``signal->group_exit_code`` while a group exit is still
    being set up), at offsets taken from the running kernel's BTF, because the headers bcc
    compiles against describe another kernel. Without BTF the event still comes, without status.
    """

    name = "exits"
    hooks = ((EXIT, "tg_exit"),)
    rank_arrays = ("tg_exits_rank",)

    def check_fields(self) -> str | None:
        return None

    def _status_reader(self) -> str:
        b = self.env.btf()
        if b is None:
            return "    e.has_status = 0;"
        try:
            exit_code = b.member_offset("task_struct", "exit_code")
            signal = b.member_offset("task_struct", "signal")
            group_code = b.member_offset("signal_struct", "group_exit_code")
        except Exception:
            return "    e.has_status = 0;"
        return f"""    char *task = (char *)bpf_get_current_task();
    s32 code = 0;
    bpf_probe_read_kernel(&code, sizeof(code), task + {exit_code});
    if (code == 0) {{
        char *sig = 0;
        bpf_probe_read_kernel(&sig, sizeof(sig), task + {signal});
        if (sig)
            bpf_probe_read_kernel(&code, sizeof(code), sig + {group_code});
    }}
    e.wait_status = code;
    e.has_status = 1;"""

    def body(self) -> str:
        # group_dead (6.x) marks the last thread of the group; older kernels: the leader's exit.
        last = "args->group_dead" if self.has(EXIT, "group_dead") else "tid == tgid"
        return f"""
struct tg_exit_event {{ u32 kind; u32 pid; u32 tgid; u32 idx1; s32 wait_status; u32 has_status;
                        u64 ktime_ns; char comm[16]; }};
BPF_PERCPU_ARRAY(tg_exits_node, u64, 1);
BPF_ARRAY(tg_exits_rank, u64, TG_MAX_TRACKED);

int tg_exit(struct tg_args_sched_process_exit *args) {{
    u64 id = bpf_get_current_pid_tgid();
    u32 tid = (u32)id, tgid = id >> 32;
    tg_tid_idx.delete(&tid);
    if (!({last}))
        return 0;
    u32 zero = 0;
    u64 *n = tg_exits_node.lookup(&zero);
    if (n)
        *n += 1;
    u32 *idx = tg_tracked.lookup(&tgid);
    if (!idx)
        return 0;
    u32 i = *idx;
    u64 *c = tg_exits_rank.lookup(&i);
    if (c)
        __sync_fetch_and_add(c, 1);
    struct tg_exit_event e = {{}};
    e.kind = {KIND_EXIT};
    e.pid = tid;
    e.tgid = tgid;
    e.idx1 = i + 1;
    e.ktime_ns = bpf_ktime_get_ns();
    bpf_get_current_comm(&e.comm, sizeof(e.comm));
{self._status_reader()}
    if (tg_events.ringbuf_output(&e, sizeof(e), 0))
        tg_count_drop();
    return 0;
}}
"""

    def read(self, module: MapReader, idxs: Iterable[int]) -> CountSnapshot:
        return _read_counts(module, "tg_exits_node", "tg_exits_rank", idxs)


@dataclass(frozen=True)
class OomRecord:
    pid: int
    slot: int | None
    uid: int
    total_vm_kb: int
    anon_rss_kb: int
    file_rss_kb: int
    shmem_rss_kb: int
    oom_score_adj: int
    ktime_ns: int
    comm: str


_OOM_FMT = struct.Struct("<IIIIQQQQqQ16s")


def decode_oom(data: bytes) -> OomRecord:
    (_kind, pid, idx1, uid, total_vm, anon, file_, shmem, adj, ktime, comm) = _OOM_FMT.unpack_from(data)
    return OomRecord(pid, idx1 - 1 if idx1 else None, uid, total_vm, anon, file_, shmem, adj, ktime,
                     comm.split(b"\0", 1)[0].decode(errors="replace"))


class OomKills(Program):
    """Every OOM victim on the node (any process), flagged when it is a tracked rank."""

    name = "oomkill"
    hooks = ((OOM, "tg_oom"),)
    rank_arrays = ("tg_oom_rank",)

    def check_fields(self) -> str | None:
        return self.need_fields(OOM, "pid")

    def body(self) -> str:
        copies = []
        for name in ("uid", "total_vm", "anon_rss", "file_rss", "shmem_rss", "oom_score_adj"):
            if self.has(OOM, name):  # RSS fields arrived in 6.x; older kernels give only the pid
                target = name + ("_kb" if name.endswith(("_vm", "_rss")) else "")
                copies.append(f"    e.{target} = args->{name};")
        comm = self.fields[OOM].get("comm")
        if comm is not None and comm.data_loc:  # u32: length << 16 | offset in the record
            copies.append("    bpf_probe_read_kernel_str(&e.comm, sizeof(e.comm), "
                          "(char *)args + (args->comm & 0xffff));")
        elif comm is not None:
            copies.append("    bpf_probe_read_kernel_str(&e.comm, sizeof(e.comm), args->comm);")
        assigns = "\n".join(copies)
        return f"""
struct tg_oom_event {{ u32 kind; u32 pid; u32 idx1; u32 uid; u64 total_vm_kb; u64 anon_rss_kb;
                       u64 file_rss_kb; u64 shmem_rss_kb; s64 oom_score_adj; u64 ktime_ns;
                       char comm[16]; }};
BPF_PERCPU_ARRAY(tg_oom_node, u64, 1);
BPF_ARRAY(tg_oom_rank, u64, TG_MAX_TRACKED);

int tg_oom(struct tg_args_mark_victim *args) {{
    u32 zero = 0;
    u64 *n = tg_oom_node.lookup(&zero);
    if (n)
        *n += 1;
    struct tg_oom_event e = {{}};
    e.kind = {KIND_OOM};
    e.pid = args->pid;
    u32 pid = e.pid;
    u32 *idx = tg_tracked.lookup(&pid);  /* the victim is usually the group leader */
    if (!idx)
        idx = tg_tid_idx.lookup(&pid);
    if (idx) {{
        u32 i = *idx;
        e.idx1 = i + 1;
        u64 *c = tg_oom_rank.lookup(&i);
        if (c)
            __sync_fetch_and_add(c, 1);
    }}
    e.ktime_ns = bpf_ktime_get_ns();
{assigns}
    if (tg_events.ringbuf_output(&e, sizeof(e), 0))
        tg_count_drop();
    return 0;
}}
"""

    def read(self, module: MapReader, idxs: Iterable[int]) -> CountSnapshot:
        return _read_counts(module, "tg_oom_node", "tg_oom_rank", idxs)
