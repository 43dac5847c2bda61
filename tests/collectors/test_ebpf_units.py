"""Pure parts of the eBPF collector: log2 slots -> Prometheus buckets, quantiles, tracepoint formats,
BTF offsets, privilege/header probes, exit-status decoding. No root, no bcc."""

from __future__ import annotations

import math
import struct
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trainguard.agent.collectors.ebpf import btf
from trainguard.agent.collectors.ebpf.hist import NSLOTS, Log2Hist, log2_buckets, log2_quantile, slot_upper_s
from trainguard.agent.collectors.ebpf.metrics import KernelSnapshot
from trainguard.agent.collectors.ebpf.probes import headers_problem, privilege_problem
from trainguard.agent.collectors.ebpf.programs.events import decode_exit
from trainguard.agent.collectors.ebpf.programs.io import dev_major_minor
from trainguard.agent.collectors.ebpf.programs.sched import OffCpu, OffCpuSnapshot, RunqSnapshot
from trainguard.agent.collectors.ebpf.rankstats import rank_delta
from trainguard.agent.collectors.ebpf.tracefs import Tracefs, parse_format, render_struct

SWITCH_FORMAT = """name: sched_switch
ID: 330
format:
\tfield:unsigned short common_type;\toffset:0;\tsize:2;\tsigned:0;
\tfield:unsigned char common_flags;\toffset:2;\tsize:1;\tsigned:0;
\tfield:unsigned char common_preempt_count;\toffset:3;\tsize:1;\tsigned:0;
\tfield:int common_pid;\toffset:4;\tsize:4;\tsigned:1;

\tfield:char prev_comm[16];\toffset:8;\tsize:16;\tsigned:0;
\tfield:pid_t prev_pid;\toffset:24;\tsize:4;\tsigned:1;
\tfield:int prev_prio;\toffset:28;\tsize:4;\tsigned:1;
\tfield:long prev_state;\toffset:32;\tsize:8;\tsigned:1;
\tfield:char next_comm[16];\toffset:40;\tsize:16;\tsigned:0;
\tfield:pid_t next_pid;\toffset:56;\tsize:4;\tsigned:1;
\tfield:int next_prio;\toffset:60;\tsize:4;\tsigned:1;
"""

BLOCK_FORMAT = """format:
\tfield:int common_pid;\toffset:4;\tsize:4;\tsigned:1;
\tfield:dev_t dev;\toffset:8;\tsize:4;\tsigned:0;
\tfield:sector_t sector;\toffset:16;\tsize:8;\tsigned:0;
\tfield:__data_loc char[] cmd;\toffset:60;\tsize:4;\tsigned:0;
"""


# --- log2 slots -> cumulative buckets -------------------------------------------------------------
def test_buckets_are_cumulative_with_log2_bounds_in_seconds() -> None:
    slots = [0] * NSLOTS
    slots[0], slots[3], slots[10] = 2, 5, 1  # [0,2) µs, [8,16) µs, [1024,2048) µs
    b = log2_buckets(slots, finite=12)
    assert [le for le, _ in b] == ["2e-06", "4e-06", "8e-06", "1.6e-05", "3.2e-05", "6.4e-05", "0.000128",
                                   "0.000256", "0.000512", "0.001024", "0.002048", "0.004096", "+Inf"]
    counts = [c for _, c in b]
    assert counts[:3] == [2, 2, 2] and counts[3] == 7 and counts[9] == 7 and counts[10] == 8
    assert counts[-1] == 8


def test_counts_beyond_the_finite_buckets_land_only_in_inf() -> None:
    slots = [1, 0, 0, 4]
    b = log2_buckets(slots, finite=2)
    assert b == [("2e-06", 1.0), ("4e-06", 1.0), ("+Inf", 5.0)]


def test_bucket_bounds_do_not_depend_on_the_data() -> None:
    empty = log2_buckets([0] * NSLOTS)
    full = log2_buckets([7] * NSLOTS)
    assert [le for le, _ in empty] == [le for le, _ in full]
    assert empty[-1] == ("+Inf", 0.0)


def test_bucket_function_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="finite"):
        log2_buckets([1], finite=0)
    with pytest.raises(ValueError, match="slots"):
        log2_buckets([1, -1])


@given(st.lists(st.integers(min_value=0, max_value=10**9), min_size=NSLOTS, max_size=NSLOTS))
def test_buckets_monotone_and_total_matches(slots: list[int]) -> None:
    b = log2_buckets(slots)
    counts = [c for _, c in b]
    assert counts == sorted(counts)
    assert counts[-1] == sum(slots)
    bounds = [float(le) for le, _ in b[:-1]]
    assert bounds == sorted(bounds) and bounds[0] == pytest.approx(2e-6)


def test_slot_bounds_match_kernel_slot_rule() -> None:
    # kernel: slot = floor(log2(us)), 0 and 1 µs in slot 0; so a value v lies below its slot's le
    for us in (0, 1, 2, 3, 4, 1000, 65535):
        slot = max(us, 1).bit_length() - 1
        assert us * 1e-6 < slot_upper_s(slot)
        assert slot == 0 or us * 1e-6 >= slot_upper_s(slot - 1)


def test_quantiles_interpolate_inside_the_slot() -> None:
    slots = [0] * NSLOTS
    slots[10] = 100  # all in [1024, 2048) µs
    assert log2_quantile(slots, 0.5) == pytest.approx(1536e-6)
    assert 1024e-6 <= log2_quantile(slots, 0.99) <= 2048e-6
    assert math.isnan(log2_quantile([0] * NSLOTS, 0.5))
    with pytest.raises(ValueError, match="q"):
        log2_quantile(slots, 1.5)


def test_hist_since_and_reset() -> None:
    a = Log2Hist((1,) + (0,) * (NSLOTS - 1), 500)
    b = Log2Hist((3,) + (2,) + (0,) * (NSLOTS - 2), 9000)
    d = b.since(a)
    assert d.slots[:2] == (2, 2) and d.sum_ns == 8500 and d.count == 4
    assert a.since(b) == a  # went backwards: the counters were reset, all of it is new
    with pytest.raises(ValueError, match="slots"):
        Log2Hist((1, 2))


def test_rank_delta_over_an_interval() -> None:
    h0 = Log2Hist((0,) * 10 + (4,) + (0,) * (NSLOTS - 11), 4_000_000)
    h1 = Log2Hist((0,) * 10 + (10,) + (0,) * (NSLOTS - 11), 10_000_000)
    prev = KernelSnapshot(10.0, {0: 42}, runq=RunqSnapshot(ranks={0: h0}),
                          offcpu=OffCpuSnapshot({0: OffCpu(runnable_ns=1_000_000_000)}))
    cur = KernelSnapshot(11.0, {0: 42}, runq=RunqSnapshot(ranks={0: h1}),
                         offcpu=OffCpuSnapshot({0: OffCpu(runnable_ns=1_500_000_000, blocked_ns=10**8)}))
    s = rank_delta(prev, cur, 0)
    assert s.interval_s == 1.0 and s.runq_count == 6 and s.runq_total_s == pytest.approx(0.006)
    assert 1024e-6 <= s.runq_p50_s <= 2048e-6
    assert s.offcpu_runnable_s == pytest.approx(0.5) and s.offcpu_blocked_s == pytest.approx(0.1)
    assert math.isnan(s.faults) and math.isnan(s.reclaim_s)  # programs not loaded: unknown, not 0


# --- tracepoint formats ---------------------------------------------------------------------------
def test_format_parsing_skips_common_fields_and_reads_arrays() -> None:
    fields = {f.name: f for f in parse_format(SWITCH_FORMAT)}
    assert list(fields) == ["prev_comm", "prev_pid", "prev_prio", "prev_state", "next_comm", "next_pid",
                            "next_prio"]
    assert fields["prev_comm"].array_len == 16 and fields["prev_state"].size == 8
    assert fields["prev_pid"].c_decl() == "s32 prev_pid"


def test_rendered_struct_puts_fields_at_format_offsets() -> None:
    fields = parse_format(BLOCK_FORMAT)
    text = render_struct("x", fields)
    # dev at 8, then 4 bytes of padding so the 6.x layout's sector lands at 16; data_loc is a u32
    assert "u32 dev;\n    char __pad1[4];\n    u64 sector;" in text
    assert "u32 cmd;" in text and "__pad2[36]" in text


def test_tracefs_probe_on_a_fake_tree(tmp_path: Path) -> None:
    d = tmp_path / "events" / "sched" / "sched_switch"
    d.mkdir(parents=True)
    (d / "format").write_text(SWITCH_FORMAT)
    tf = Tracefs(tmp_path)
    assert tf.exists("sched:sched_switch") and not tf.exists("sched:sched_wakeup")
    assert "next_pid" in tf.fields("sched:sched_switch")


# --- BTF ------------------------------------------------------------------------------------------
def _btf_blob() -> bytes:
    """A BTF blob with int, struct inner {int a; int b;}, struct task_struct {int x; <anon inner>; int exit_code;}."""
    strs = b"\0int\0inner\0a\0b\0task_struct\0x\0exit_code\0"

    def off(s: str) -> int:
        return strs.index(s.encode() + b"\0")

    types = b""
    types += struct.pack("<III", off("int"), 1 << 24, 4) + struct.pack("<I", 32)  # id 1 INT
    types += struct.pack("<III", off("inner"), (4 << 24) | 2, 8)  # id 2 STRUCT inner
    types += struct.pack("<III", off("a"), 1, 0) + struct.pack("<III", off("b"), 1, 32)
    types += struct.pack("<III", off("task_struct"), (4 << 24) | 3, 16)  # id 3
    types += struct.pack("<III", off("x"), 1, 0) + struct.pack("<III", 0, 2, 32)
    types += struct.pack("<III", off("exit_code"), 1, 96)
    hdr = struct.pack("<HBBIIIII", 0xEB9F, 1, 0, 24, 0, len(types), len(types), len(strs))
    return hdr + types + strs


def test_btf_member_offsets_follow_anonymous_members() -> None:
    b = btf.Btf(_btf_blob())
    assert b.member_offset("task_struct", "exit_code") == 12
    assert b.member_offset("task_struct", "b") == 8  # inside the anonymous struct at byte 4
    with pytest.raises(btf.BtfError, match="no member"):
        b.member_offset("task_struct", "nope")
    with pytest.raises(btf.BtfError, match="magic"):
        btf.Btf(b"\0" * 32)


@pytest.mark.skipif(not btf.VMLINUX_BTF.exists(), reason="kernel has no BTF at /sys/kernel/btf/vmlinux")
def test_btf_of_the_running_kernel() -> None:
    b = btf.load()
    pid, tgid = b.member_offset("task_struct", "pid"), b.member_offset("task_struct", "tgid")
    assert tgid == pid + 4  # adjacent pid_t fields in every kernel since 2.6
    assert b.member_offset("task_struct", "exit_code") > 0


# --- probes and decoding --------------------------------------------------------------------------
def test_privilege_probe() -> None:
    assert privilege_problem(0, "") is None
    caps_bpf_perfmon = (1 << 39) | (1 << 38)
    assert privilege_problem(1000, f"CapEff:\t{caps_bpf_perfmon:016x}\n") is None
    assert privilege_problem(1000, f"CapEff:\t{1 << 21:016x}\n") is None
    reason = privilege_problem(65534, "CapEff:\t0000000000000000\n")
    assert reason is not None and "root" in reason and "65534" in reason


def test_headers_probe(tmp_path: Path) -> None:
    none = tmp_path / "nokheaders"
    assert "no kernel headers" in (headers_problem(tmp_path, none) or "")
    (tmp_path / "build" / "include").mkdir(parents=True)
    assert "source" in (headers_problem(tmp_path, none) or "")
    (tmp_path / "source" / "include" / "linux").mkdir(parents=True)
    (tmp_path / "source" / "include" / "linux" / "kconfig.h").write_text("")
    assert headers_problem(tmp_path, none) is None


def test_exit_status_decoding() -> None:
    def rec(status: int) -> bytes:
        return struct.pack("<IIIIiIQ16s", 1, 10, 10, 3, status, 1, 123, b"python3")

    killed = decode_exit(rec(9))
    assert (killed.signal, killed.exit_code, killed.slot, killed.comm) == (9, -9, 2, "python3")
    exited = decode_exit(rec(3 << 8))
    assert (exited.signal, exited.exit_code) == (0, 3)
    dumped = decode_exit(rec(0x80 | 11))
    assert dumped.core_dumped and dumped.exit_code == -11


def test_block_dev_t_split() -> None:
    assert dev_major_minor((254 << 20) | 3) == (254, 3)


# --- Prometheus families from a snapshot (no kernel needed) ----------------------------------------
def test_families_from_a_snapshot_label_and_convert_units() -> None:
    from prometheus_client.core import CollectorRegistry

    from trainguard.agent.collectors.base import TrackedProcess
    from trainguard.agent.collectors.ebpf.metrics import METRICS, families
    from trainguard.agent.collectors.ebpf.programs.events import CountSnapshot
    from trainguard.agent.collectors.ebpf.programs.io import BlockIoSnapshot
    from trainguard.agent.collectors.ebpf.programs.mem import FaultSnapshot, Reclaim, ReclaimSnapshot
    from trainguard.agent.collectors.ebpf.programs.net import TcpSnapshot

    slots = [0] * NSLOTS
    slots[3] = 5  # [8, 16) µs
    h = Log2Hist(tuple(slots), 60_000)
    snap = KernelSnapshot(
        1.0, {0: 111, 1: 222}, runq=RunqSnapshot(node=h + h, ranks={0: h, 1: Log2Hist()}),
        offcpu=OffCpuSnapshot({0: OffCpu(runnable_ns=2 * 10**9, blocked_ns=5 * 10**8)}),
        blockio=BlockIoSnapshot({(254 << 20): h}), tcp=TcpSnapshot(7, {0: 3}),
        faults=FaultSnapshot(100, {0: 40, 1: 2}), reclaim=ReclaimSnapshot(Reclaim(10**9, 2), {0: Reclaim(10**8, 1)}),
        exits=CountSnapshot(9, {1: 1}), ooms=CountSnapshot(1, {}), events_dropped=0,
        prog_runs={"tg_runq_switch": (1000, 2_000_000)})
    procs = {0: TrackedProcess(111, "j", 0, 0), 1: TrackedProcess(222, "j", 1, 1)}

    class Source:
        def collect(self):  # noqa: ANN202
            return families(snap, procs, lambda dev: "vda", {"runqlat": True, "oomkill": False})

    reg = CollectorRegistry()
    reg.register(Source())
    get = reg.get_sample_value
    node = {"scope": "node", "job": "", "rank": ""}
    r0 = {"scope": "rank", "job": "j", "rank": "0"}
    assert get("trainguard_runqueue_latency_seconds_count", node) == 10
    assert get("trainguard_runqueue_latency_seconds_bucket", {**r0, "le": "8e-06"}) == 0
    assert get("trainguard_runqueue_latency_seconds_bucket", {**r0, "le": "1.6e-05"}) == 5
    assert get("trainguard_runqueue_latency_seconds_sum", r0) == pytest.approx(60e-6)
    assert get("trainguard_offcpu_seconds_total", {"job": "j", "rank": "0", "kind": "runnable"}) == 2.0
    assert get("trainguard_block_io_latency_seconds_count", {"device": "vda"}) == 5
    assert get("trainguard_tcp_retransmits_total", r0) == 3 and get("trainguard_tcp_retransmits_total", node) == 7
    assert get("trainguard_page_faults_total", {"scope": "rank", "job": "j", "rank": "1"}) == 2
    assert get("trainguard_direct_reclaim_seconds_total", r0) == pytest.approx(0.1)
    assert get("trainguard_process_exits_total", {"scope": "rank", "job": "j", "rank": "1"}) == 1
    assert get("trainguard_oom_kills_total", node) == 1
    assert get("trainguard_ebpf_program_up", {"program": "oomkill"}) == 0
    assert get("trainguard_ebpf_program_run_seconds_total", {"function": "tg_runq_switch"}) == pytest.approx(0.002)
    names = {m.name for m in reg.collect()}
    for name, mtype, *_ in METRICS:
        assert (name[: -len("_total")] if mtype == "counter" else name) in names
    # a slot whose process is no longer tracked is not exported
    procs.pop(1)
    assert get("trainguard_page_faults_total", {"scope": "rank", "job": "j", "rank": "1"}) is None
