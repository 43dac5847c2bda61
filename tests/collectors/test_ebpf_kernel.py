"""The eBPF collector for real: bcc programs attached to this kernel, with a known answer each.

Needs root, bcc and kernel headers (make setup); elsewhere these skip with the collector's own
reason. All tests share one collector (one compile) and run in one xdist worker; other tests may
load the machine meanwhile, so every assertion is a lower bound or a generous window.
"""

from __future__ import annotations

import io
import mmap
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.core import CollectorRegistry

from trainguard.agent.collectors.base import CollectorUnavailable, TrackedProcess
from trainguard.agent.collectors.ebpf import METRICS, EbpfCollector, bpfstats, render_all
from trainguard.agent.collectors.ebpf.programs import PageFaults, Program

pytestmark = [pytest.mark.ebpf, pytest.mark.xdist_group("ebpf")]

PY = [sys.executable, "-S", "-c"]


class Events:
    """Collects emitted events; waiters wake as soon as a matching one arrives."""

    def __init__(self) -> None:
        self.items: list[tuple[float, str, dict[str, Any]]] = []
        self.cond = threading.Condition()

    def emit(self, kind: str, fields: dict[str, Any]) -> None:
        with self.cond:
            self.items.append((time.monotonic(), kind, fields))
            self.cond.notify_all()

    def wait_for(self, kind: str, pid: int, timeout: float) -> tuple[float, dict[str, Any]] | None:
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                for t, k, f in self.items:
                    if k == kind and f.get("pid") == pid:
                        return t, f
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self.cond.wait(left)

    def matching(self, kind: str, pid: int) -> list[dict[str, Any]]:
        with self.cond:
            return [f for _, k, f in self.items if k == kind and f.get("pid") == pid]


@pytest.fixture(scope="module")
def kernel() -> Iterator[tuple[EbpfCollector, Events, str]]:
    events = Events()
    printed = io.StringIO()
    c = EbpfCollector(events.emit, interval=1.0, print_bpf=True, out=printed)
    try:
        c.start()
    except CollectorUnavailable as exc:
        pytest.skip(f"eBPF unavailable here: {exc}")
    yield c, events, printed.getvalue()
    c.stop()


def spawn(code: str, **kw: Any) -> subprocess.Popen[str]:
    return subprocess.Popen(PY + [code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, **kw)


def reap(*procs: subprocess.Popen[str]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_all_programs_load_here(kernel: tuple[EbpfCollector, Events, str]) -> None:
    c, _, printed = kernel
    assert c.skipped == {}, c.skipped
    assert {p.name for p in c.programs} == {"runqlat", "offcpu", "biolatency", "tcpretrans", "pagefaults",
                                            "directreclaim", "exits", "oomkill"}
    # --print-bpf printed what was compiled; render_all() renders the same programs
    assert "int tg_runq_switch(struct tg_args_sched_switch *args)" in printed
    text = render_all()
    for fn in ("tg_runq_switch", "tg_offcpu_switch", "tg_bio_complete", "tg_tcp_retransmit", "tg_fault_user",
               "tg_reclaim_end", "tg_exit", "tg_oom"):
        assert f"int {fn}(" in text


BUSY = "import os, sys\nos.sched_setaffinity(0, {%d})\nprint('ready', flush=True)\nwhile True: pass"
# The rank under test spins in a thread it starts only after it is tracked: threads count as the rank.
BUSY_THREAD = """import os, sys, threading
os.sched_setaffinity(0, {%d})
print('ready', flush=True)
sys.stdin.readline()
def spin():
    while True:
        pass
threading.Thread(target=spin).start()
"""
SLEEPER = "import time\nprint('ready', flush=True)\nwhile True: time.sleep(0.01)"


def test_runqueue_latency_of_a_rank_sharing_its_core(kernel: tuple[EbpfCollector, Events, str]) -> None:
    c, _, _ = kernel
    cpu = max(os.sched_getaffinity(0))
    a, b, s = spawn(BUSY_THREAD % cpu), spawn(BUSY % cpu), spawn(SLEEPER)
    try:
        for p in (a, b, s):
            assert p.stdout is not None and p.stdout.readline() == "ready\n"
        c.track({p.pid: TrackedProcess(p.pid, "rq", r, r) for r, p in enumerate((a, b, s))})
        assert a.stdin is not None
        a.stdin.write("go\n")
        a.stdin.flush()
        time.sleep(0.2)
        c.poll(time.monotonic())
        node_before = c.snapshot.runq.node.count if c.snapshot and c.snapshot.runq else 0
        b_cpu0 = cpu_seconds(b.pid)
        deadline = time.monotonic() + 10  # others' tests may crowd the core: wait for B's time
        time.sleep(1.0)
        while cpu_seconds(b.pid) - b_cpu0 < 0.3 and time.monotonic() < deadline:
            time.sleep(0.25)
        c.poll(time.monotonic())
        b_cpu = cpu_seconds(b.pid) - b_cpu0
        ra, rs = c.rank_stats("rq", 0), c.rank_stats("rq", 2)
    finally:
        c.track({})
        reap(a, b, s)
    assert ra is not None and rs is not None
    # While B ran on the shared core, A (always runnable) waited in the run queue: A's summed
    # wait covers at least most of B's CPU time (other load on the core only adds to it).
    assert b_cpu >= 0.2, f"B barely ran ({b_cpu:.2f} s): machine too loaded to measure"
    assert ra.runq_count >= 10
    assert ra.runq_total_s >= 0.6 * b_cpu, (ra, b_cpu)
    assert ra.runq_total_s <= ra.interval_s + 0.5
    assert 0 < ra.runq_p50_s <= ra.runq_p99_s
    # ...and was off CPU as runnable (preempted), while the sleeper was off CPU blocked
    assert ra.offcpu_runnable_s >= 0.6 * b_cpu
    assert rs.offcpu_blocked_s >= 0.5 * rs.interval_s
    assert rs.offcpu_blocked_s > 5 * rs.offcpu_runnable_s
    assert rs.offcpu_io_s < 0.1 * rs.offcpu_blocked_s, rs  # a timer sleep is no I/O wait
    assert c.snapshot is not None and c.snapshot.runq is not None
    assert c.snapshot.runq.node.count - node_before >= ra.runq_count


def _real_disk_dir(candidates: list[Path]) -> tuple[Path, int] | None:
    """A directory on a block device (not tmpfs/overlay) and that device's kernel dev_t (whole disk)."""
    for d in candidates:
        st = os.stat(d)
        major, minor = os.major(st.st_dev), os.minor(st.st_dev)
        sysdev = Path(f"/sys/dev/block/{major}:{minor}")
        if major == 0 or not sysdev.exists():
            continue
        if (sysdev / "partition").exists():  # requests are reported against the whole disk
            major, minor = (int(x) for x in (sysdev.resolve().parent / "dev").read_text().split(":"))
        return d, (major << 20) | minor
    return None


def test_block_io_count_grows_by_synchronous_writes(kernel: tuple[EbpfCollector, Events, str],
                                                     tmp_path: Path) -> None:
    c, _, _ = kernel
    found = _real_disk_dir([tmp_path, Path("/var/tmp"), Path(__file__).resolve().parent])
    if found is None:
        pytest.skip("no directory on a real block device (tmp, /var/tmp and the repo are tmpfs/overlay)")
    where, dev = found
    n = 20
    path = where / f"tg-bio-{uuid.uuid4().hex}"
    c.poll(time.monotonic())
    before = c.snapshot.blockio.devices.get(dev) if c.snapshot and c.snapshot.blockio else None
    try:
        with open(path, "wb") as f:
            for i in range(n):
                f.write(os.urandom(4096) + bytes([i]))
                f.flush()
                os.fsync(f.fileno())
    finally:
        path.unlink(missing_ok=True)
    time.sleep(0.1)
    c.poll(time.monotonic())
    assert c.snapshot is not None and c.snapshot.blockio is not None
    after = c.snapshot.blockio.devices.get(dev)
    assert after is not None, f"no I/O seen on dev {dev >> 20}:{dev & 0xFFFFF}: {c.snapshot.blockio.devices}"
    grew = after.count - (before.count if before else 0)
    assert grew >= n
    assert after.sum_ns > (before.sum_ns if before else 0)
    assert c.device_name(dev) != ""


FSYNC_WRITER = """import os, sys
print('ready', flush=True)
path = sys.argv[1]
with open(path, 'wb') as f:
    for i in range(int(sys.argv[2])):
        f.write(os.urandom(65536))
        f.flush()
        os.fsync(f.fileno())
os.unlink(path)
"""
# Sleeps the way a fast rank waits for a slow one (a socket read) and an idle helper thread does
# (a condition variable): interruptibly, never in D state.
PEER_WAITER = """import socket, threading
a, b = socket.socketpair()
cv = threading.Condition()
def peer():
    while True:
        with cv:
            cv.wait(0.01)
        b.send(b'x')
threading.Thread(target=peer, daemon=True).start()
print('ready', flush=True)
while True:
    a.recv(1)
"""


def test_io_wait_is_uninterruptible_sleep_not_a_peers_wait(kernel: tuple[EbpfCollector, Events, str],
                                                          tmp_path: Path) -> None:
    """The straggler detector's io_wait evidence: a rank that waits for the disk (fsync) is off CPU
    in uninterruptible sleep; one that waits on a socket for a peer is as long off CPU, but none
    of it counts as I/O wait."""
    c, _, _ = kernel
    found = _real_disk_dir([tmp_path, Path("/var/tmp"), Path(__file__).resolve().parent])
    if found is None:
        pytest.skip("no directory on a real block device (tmp, /var/tmp and the repo are tmpfs/overlay)")
    where, _ = found
    waiter = spawn(PEER_WAITER)
    writer = subprocess.Popen([sys.executable, "-c", FSYNC_WRITER, str(where / f"tg-io-{uuid.uuid4().hex}"), "40"],
                              stdout=subprocess.PIPE, text=True)
    try:
        for p in (waiter, writer):
            assert p.stdout is not None and p.stdout.readline() == "ready\n"
        c.track({p.pid: TrackedProcess(p.pid, "io", r, r) for r, p in enumerate((waiter, writer))})
        slots = c.slot_of("io", 0), c.slot_of("io", 1)
        c.poll(time.monotonic())
        writer.wait(60)
        time.sleep(0.2)
        c.poll(time.monotonic())
        offcpu = c.snapshot.offcpu.ranks if c.snapshot and c.snapshot.offcpu else {}
    finally:
        c.track({})
        reap(waiter)
        if writer.poll() is None:
            writer.kill()
            writer.wait()
    assert None not in slots and all(s in offcpu for s in slots), (slots, offcpu)
    w, d = offcpu[slots[0]], offcpu[slots[1]]
    assert d.io_n >= 10 and d.io_ns > 0, d  # 40 fsyncs: each a wait for the disk
    assert d.io_ns <= d.blocked_ns
    assert w.blocked_ns > 0 and w.io_ns == 0, w


def test_sigkill_yields_an_exit_event_within_100ms(kernel: tuple[EbpfCollector, Events, str]) -> None:
    c, events, _ = kernel
    code = "import threading, time\nfor _ in range(3): threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\nprint('ready', flush=True)\ntime.sleep(60)"
    child = spawn(code)
    try:
        assert child.stdout is not None and child.stdout.readline() == "ready\n"
        c.track({child.pid: TrackedProcess(child.pid, "ex", 3, 1)})
        t0, killed_at = time.monotonic(), time.time()
        os.kill(child.pid, signal.SIGKILL)
        got = events.wait_for("rank_exit", child.pid, timeout=5)
    finally:
        reap(child)
    assert got is not None, "no rank_exit event"
    t, fields = got
    assert t - t0 < 0.1, f"exit event after {1000 * (t - t0):.1f} ms"
    assert fields["signal"] == 9 and fields["exit_code"] == -9
    # The kernel's time of the exit on the wall clock (a recovery's clock starts there): after the kill.
    assert killed_at <= fields["exited_at"] <= killed_at + (t - t0) + 0.001, (killed_at, fields["exited_at"])
    assert (fields["job"], fields["rank"], fields["local_rank"]) == ("ex", 3, 1)
    time.sleep(0.05)
    assert len(events.matching("rank_exit", child.pid)) == 1  # four threads died, one group exit
    c.track({})


def test_normal_exit_reports_the_status(kernel: tuple[EbpfCollector, Events, str]) -> None:
    c, events, _ = kernel
    child = spawn("import sys\nprint('ready', flush=True)\nsys.stdin.readline()\nsys.exit(3)")
    try:
        assert child.stdout is not None and child.stdout.readline() == "ready\n"
        c.track({child.pid: TrackedProcess(child.pid, "ex", 0, 0)})
        assert child.stdin is not None
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.wait(10) == 3
        got = events.wait_for("rank_exit", child.pid, timeout=5)
    finally:
        reap(child)
        c.track({})
    assert got is not None
    assert got[1]["exit_code"] == 3 and got[1]["signal"] == 0


def test_untracked_exits_are_not_reported(kernel: tuple[EbpfCollector, Events, str]) -> None:
    c, events, _ = kernel
    c.track({})
    p = subprocess.run(["true"], check=True)
    assert p.returncode == 0
    time.sleep(0.1)
    assert all(f.get("comm") != "true" for _, k, f in events.items if k == "rank_exit")


def test_page_faults_of_a_rank_touching_fresh_pages(kernel: tuple[EbpfCollector, Events, str]) -> None:
    c, _, _ = kernel
    n = 2000
    code = f"""import mmap, sys
m = mmap.mmap(-1, {n} * 4096)
m.madvise(mmap.MADV_NOHUGEPAGE)  # one fault per 4 KiB page, not per 2 MiB
print('ready', flush=True)
sys.stdin.readline()
for i in range(0, {n} * 4096, 4096):
    m[i] = 1
print('done', flush=True)
sys.stdin.readline()
"""
    child = spawn(code)
    try:
        assert child.stdout is not None and child.stdin is not None
        assert child.stdout.readline() == "ready\n"
        c.track({child.pid: TrackedProcess(child.pid, "pf", 0, 0)})
        c.poll(time.monotonic())
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline() == "done\n"
        c.poll(time.monotonic())
        stats = c.rank_stats("pf", 0)
    finally:
        reap(child)
        c.track({})
    assert stats is not None
    assert n <= stats.faults <= 3 * n  # its own faults, not the node's


def _memory_cgroup(tag: str) -> tuple[Path, Path] | None:
    """(new cgroup dir, file to write a pid into), nested under our own cgroup; v2 first, then v1."""
    own = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, ctrls, path = line.split(":", 2)
        own[ctrls] = path
    v2 = Path("/sys/fs/cgroup")
    if "memory" in (v2 / "cgroup.controllers").read_text(errors="ignore").split() if (
            v2 / "cgroup.controllers").exists() else False:
        parent = v2 / own.get("", "/").lstrip("/")
        d = parent / tag
        d.mkdir()
        (d / "memory.max").write_text(str(32 << 20))
        (d / "memory.swap.max").write_text("0") if (d / "memory.swap.max").exists() else None
        return d, d / "cgroup.procs"
    v1 = Path("/sys/fs/cgroup/memory")
    if (v1 / "memory.limit_in_bytes").exists():
        d = v1 / own.get("memory", "/").lstrip("/") / tag
        d.mkdir()
        (d / "memory.limit_in_bytes").write_text(str(32 << 20))
        return d, d / "cgroup.procs"
    return None


def test_oom_kill_in_a_memory_limited_cgroup(kernel: tuple[EbpfCollector, Events, str]) -> None:
    c, events, _ = kernel
    try:
        cg = _memory_cgroup(f"tg-oom-{uuid.uuid4().hex[:8]}")
    except OSError as exc:
        pytest.skip(f"cannot create a memory cgroup here: {exc}")
    if cg is None:
        pytest.skip("no memory cgroup controller (neither v2 nor v1) to confine an OOM")
    cgdir, procs_file = cg
    code = f"""import os, sys
open({str(procs_file)!r}, 'w').write(str(os.getpid()))
print('ready', flush=True)
sys.stdin.readline()
hog = bytearray(256 << 20)  # zero-filled: every page touched, 8x the cgroup's limit
"""
    child = spawn(code)
    try:
        assert child.stdout is not None and child.stdin is not None
        assert child.stdout.readline() == "ready\n"
        c.track({child.pid: TrackedProcess(child.pid, "oom", 7, 0)})
        child.stdin.write("go\n")
        child.stdin.flush()
        rc = child.wait(30)
        got = events.wait_for("oom_kill", child.pid, timeout=5)
        exit_ev = events.wait_for("rank_exit", child.pid, timeout=5)
        c.poll(time.monotonic())
        slot = c.slot_of("oom", 7)
        snap = c.snapshot
    finally:
        reap(child)
        c.track({})
        for _ in range(50):
            try:
                cgdir.rmdir()
                break
            except OSError:
                time.sleep(0.1)
    assert rc == -signal.SIGKILL
    assert got is not None, "no oom_kill event"
    fields = got[1]
    assert fields["tracked"] is True and (fields["job"], fields["rank"]) == ("oom", 7)
    assert fields["anon_rss_kb"] > 0 or fields["total_vm_kb"] > 0
    assert exit_ev is not None and exit_ev[1]["signal"] == 9
    assert snap is not None and snap.ooms is not None and slot is not None
    assert snap.ooms.node >= 1 and snap.ooms.ranks[slot] == 1
    # before the kill, the cgroup's limit made the rank reclaim its own memory, stalled
    assert snap.reclaim is not None and snap.reclaim.ranks[slot].count >= 1
    assert snap.reclaim.ranks[slot].ns > 0


def test_tcp_retransmits_of_a_rank_are_attributed_by_socket(kernel: tuple[EbpfCollector, Events, str]) -> None:
    """Loopback only: a listener with a full accept queue drops further SYNs, so the rank's
    connects retransmit their SYN after the initial 1 s RTO, from a timer, not from the rank."""
    c, _, _ = kernel
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        port = listener.getsockname()[1]
        code = f"""import socket, sys
print('ready', flush=True)
sys.stdin.readline()
socks = [socket.socket() for _ in range(3)]
for s in socks:
    s.setblocking(False)
    s.connect_ex(('127.0.0.1', {port}))
print('connecting', flush=True)
sys.stdin.readline()
"""
        child = spawn(code)
        try:
            assert child.stdout is not None and child.stdin is not None
            assert child.stdout.readline() == "ready\n"
            c.track({child.pid: TrackedProcess(child.pid, "net", 2, 0)})
            c.poll(time.monotonic())
            child.stdin.write("go\n")
            child.stdin.flush()
            assert child.stdout.readline() == "connecting\n"
            # The SYN retransmits fire after the 1 s RTO; on a loaded machine the timers and the
            # perf-buffer reads run late, so poll until they are in (or 8 s passed).
            deadline = time.monotonic() + 8.0
            time.sleep(1.2)
            while True:
                c.poll(time.monotonic())
                stats = c.rank_stats("net", 2)
                snap = c.snapshot
                if (stats is not None and stats.tcp_retransmits >= 2) or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
        finally:
            reap(child)
            c.track({})
    assert stats is not None and snap is not None and snap.tcp is not None
    assert stats.tcp_retransmits >= 2
    assert snap.tcp.node >= stats.tcp_retransmits


def test_metric_families_after_a_poll(kernel: tuple[EbpfCollector, Events, str]) -> None:
    c, _, _ = kernel
    child = spawn(SLEEPER)
    try:
        assert child.stdout is not None and child.stdout.readline() == "ready\n"
        c.track({child.pid: TrackedProcess(child.pid, "m", 4, 0)})
        stats_fd = bpfstats.enable_stats()  # the kernel counts program runs while this is open
        try:
            time.sleep(0.2)
            c.poll(time.monotonic())
        finally:
            os.close(stats_fd)

        class Source:
            def collect(self):  # noqa: ANN202
                return c.metrics()

        reg = CollectorRegistry()
        reg.register(Source())
        names = {m.name for m in reg.collect()}
        node_count = reg.get_sample_value("trainguard_runqueue_latency_seconds_count",
                                          {"scope": "node", "job": "", "rank": ""})
        rank_inf = reg.get_sample_value("trainguard_runqueue_latency_seconds_bucket",
                                        {"scope": "rank", "job": "m", "rank": "4", "le": "+Inf"})
        rank_count = reg.get_sample_value("trainguard_runqueue_latency_seconds_count",
                                          {"scope": "rank", "job": "m", "rank": "4"})
        blocked = reg.get_sample_value("trainguard_offcpu_seconds_total", {"job": "m", "rank": "4", "kind": "blocked"})
        up = reg.get_sample_value("trainguard_ebpf_program_up", {"program": "runqlat"})
        runs = reg.get_sample_value("trainguard_ebpf_program_runs_total", {"function": "tg_runq_switch"})
        run_s = reg.get_sample_value("trainguard_ebpf_program_run_seconds_total", {"function": "tg_runq_switch"})
    finally:
        reap(child)
        c.track({})
    for name, mtype, *_ in METRICS:
        base = name[: -len("_total")] if mtype == "counter" and name.endswith("_total") else name
        assert base in names, f"{name} missing from {sorted(names)}"
    assert node_count is not None and node_count > 0
    assert rank_inf is not None and rank_inf == rank_count and rank_count > 0
    assert blocked is not None and blocked > 0.05
    assert up == 1.0
    assert runs is not None and runs > 0 and run_s is not None and 0 < run_s < runs * 1e-3  # seconds, not ns


class Broken(Program):
    name = "broken"
    hooks = (("sched:sched_switch", "tg_broken"),)

    def body(self) -> str:
        return "int tg_broken(struct tg_args_sched_switch *args) { return undefined_thing; }"

    def read(self, module: Any, idxs: Any) -> None:
        return None


def test_a_program_that_does_not_compile_is_skipped_with_its_reason() -> None:
    c = EbpfCollector(lambda k, f: None, programs=(PageFaults, Broken))
    try:
        c.start()
    except CollectorUnavailable as exc:
        pytest.skip(f"eBPF unavailable here: {exc}")
    try:
        assert [p.name for p in c.programs] == ["pagefaults"]
        assert "undefined_thing" in c.skipped["broken"]
        c.poll(time.monotonic())
        assert c.snapshot is not None and c.snapshot.faults is not None
        # stop, start again: the tracked set carries over into the fresh maps
        c.track({os.getpid(): TrackedProcess(os.getpid(), "self", 0, 0)})
        c.stop()
        c.stop()  # twice is fine
        c.start()
        c.poll(time.monotonic())
        touched = mmap.mmap(-1, 2048 * 4096)  # fresh anonymous pages: one fault each on first touch
        touched.madvise(mmap.MADV_NOHUGEPAGE)
        for i in range(0, len(touched), 4096):
            touched[i] = 1
        touched.close()
        c.poll(time.monotonic())
        stats = c.rank_stats("self", 0)
        assert stats is not None and stats.faults >= 1000
    finally:
        c.stop()


def test_missing_tracefs_is_a_reason_not_a_crash(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("probe order: not root fails earlier, see test_ebpf_nonroot")
    c = EbpfCollector(lambda k, f: None, tracefs_roots=(tmp_path / "nowhere",))
    with pytest.raises(CollectorUnavailable, match="tracefs"):
        c.start()
    assert c.down_reason is not None and "tracefs" in c.down_reason
