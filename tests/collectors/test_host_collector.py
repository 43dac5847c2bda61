"""Host collector against a fake /proc tree and against the real one."""

from __future__ import annotations

import os
import time
from pathlib import Path

import psutil
import pytest
from prometheus_client.registry import CollectorRegistry

from trainguard.agent.collectors.base import CollectorUnavailable, TrackedProcess
from trainguard.agent.collectors.host import HostCollector
from trainguard.agent.exporter import AgentExporter

STAT = """cpu  1000 20 300 5000 40 0 6 8 0 0
cpu0 500 10 150 2500 20 0 3 4 0 0
cpu1 500 10 150 2500 20 0 3 4 0 0
intr 12345 0 0
ctxt 999
procs_running 7
procs_blocked 2
"""
MEMINFO = """MemTotal:       16000000 kB
MemFree:         1000000 kB
MemAvailable:    8000000 kB
Dirty:              1234 kB
SwapTotal:       2000000 kB
SwapFree:        1500000 kB
HugePages_Total:       0
"""
VMSTAT = """pgfault 100
pgmajfault 7
pgscan_kswapd 11
pgscan_direct 13
pgsteal_kswapd 5
pgsteal_direct 3
allocstall_dma32 2
allocstall_normal 5
oom_kill 1
workingset_refault_anon 4
workingset_refault_file 6
"""
DISKSTATS = """ 254       0 vda 100 2 4000 50 200 3 8000 60 0 1500 2500 0 0 0 0 0 0
 254       1 vda1 90 2 3600 45 190 3 7600 55 0 1400 2300 0 0 0 0 0 0
   7       0 loop0 5 0 10 1 0 0 0 0 0 1 1 0 0 0 0 0 0
 259       0 nvme0n1 10 0 80 1 20 0 160 2 1 30 40
 259       1 nvme0n1p1 10 0 80 1 20 0 160 2 1 30 40
"""
NETDEV = """Inter-|   Receive                                                |  Transmit
 face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs drop fifo colls carrier compressed
    lo: 1000 10 0 0 0 0 0 0 1000 10 0 0 0 0 0 0
  eth0: 5000 50 1 2 0 0 0 0 7000 70 3 4 0 0 0 0
"""
PRESSURE_CPU = """some avg10=1.00 avg60=0.50 avg300=0.10 total=2500000
full avg10=0.00 avg60=0.00 avg300=0.00 total=0
"""
PID_STAT = ("4242 (python (rank 0)) S 1 4242 4242 0 -1 4194560 5000 0 12 0 250 50 0 0 20 0 9 0 123456 "
            "1000000000 25000 18446744073709551615 1 1 0 0 0 0 0 16781312 17638 0 0 0 17 1 0 0 0 0 0")
PID_STATUS = """Name:\tpython
State:\tS (sleeping)
Threads:\t9
VmRSS:\t  102400 kB
voluntary_ctxt_switches:\t300
nonvoluntary_ctxt_switches:\t40
"""


def fake_proc(root: Path) -> Path:
    (root / "net").mkdir(parents=True)
    (root / "pressure").mkdir()
    (root / "4242").mkdir()
    for rel, text in {"stat": STAT, "meminfo": MEMINFO, "vmstat": VMSTAT, "diskstats": DISKSTATS,
                      "loadavg": "1.50 0.75 0.25 3/400 999\n", "net/dev": NETDEV,
                      "pressure/cpu": PRESSURE_CPU, "4242/stat": PID_STAT, "4242/status": PID_STATUS}.items():
        (root / rel).write_text(text)
    return root


def registry_for(collector: HostCollector) -> CollectorRegistry:
    """Scraped the way the agent does it: through the exporter."""
    return AgentExporter([collector], {"version": "test"}, lambda: {"host": (True, None)}).registry


RANK0 = {4242: TrackedProcess(pid=4242, job="job-a", rank=0, local_rank=0)}


def test_fake_proc_values(tmp_path: Path) -> None:
    root = fake_proc(tmp_path)
    host = HostCollector(proc_root=str(root), clock_ticks=100)
    host.start()
    host.track(RANK0)
    host.poll(10.0)
    reg = registry_for(host)
    v = reg.get_sample_value
    assert v("trainguard_host_cpu_seconds_total", {"mode": "user"}) == 10.0
    assert v("trainguard_host_cpu_seconds_total", {"mode": "steal"}) == 0.08
    assert v("trainguard_host_cpus") == 2
    assert v("trainguard_host_procs_running") == 7 and v("trainguard_host_procs_blocked") == 2
    assert v("trainguard_host_load1") == 1.5 and v("trainguard_host_load15") == 0.25
    assert v("trainguard_host_memory_total_bytes") == 16000000 * 1024
    assert v("trainguard_host_memory_available_bytes") == 8000000 * 1024
    assert v("trainguard_host_swap_used_bytes") == 500000 * 1024
    assert v("trainguard_host_vmstat_total", {"field": "allocstall"}) == 7
    assert v("trainguard_host_vmstat_total", {"field": "pgscan_direct"}) == 13
    assert v("trainguard_host_vmstat_total", {"field": "workingset_refault"}) == 10
    assert v("trainguard_host_vmstat_total", {"field": "pgfault"}) is None  # not reclaim-related
    assert v("trainguard_host_pressure_stalled_seconds_total", {"resource": "cpu", "kind": "some"}) == 2.5
    assert v("trainguard_host_disk_read_bytes_total", {"device": "vda"}) == 4000 * 512
    assert v("trainguard_host_disk_written_bytes_total", {"device": "nvme0n1"}) == 160 * 512
    assert v("trainguard_host_disk_io_time_seconds_total", {"device": "vda"}) == 1.5
    assert v("trainguard_host_disk_io_time_weighted_seconds_total", {"device": "vda"}) == 2.5
    for partition_or_loop in ("vda1", "loop0", "nvme0n1p1"):
        assert v("trainguard_host_disk_read_bytes_total", {"device": partition_or_loop}) is None
    assert v("trainguard_host_network_receive_bytes_total", {"device": "eth0"}) == 5000
    assert v("trainguard_host_network_receive_drop_total", {"device": "eth0"}) == 2
    assert v("trainguard_host_network_transmit_packets_total", {"device": "eth0"}) == 70
    assert v("trainguard_host_network_transmit_errors_total", {"device": "eth0"}) == 3
    rank = {"job": "job-a", "rank": "0"}
    assert v("trainguard_process_cpu_seconds_total", {**rank, "mode": "user"}) == 2.5
    assert v("trainguard_process_cpu_seconds_total", {**rank, "mode": "system"}) == 0.5
    assert v("trainguard_process_resident_memory_bytes", rank) == 102400 * 1024
    assert v("trainguard_process_context_switches_total", {**rank, "kind": "voluntary"}) == 300
    assert v("trainguard_process_context_switches_total", {**rank, "kind": "involuntary"}) == 40
    assert v("trainguard_process_major_faults_total", rank) == 12
    assert v("trainguard_process_threads", rank) == 9
    assert v("trainguard_process_state", {**rank, "state": "S"}) == 1
    assert v("trainguard_process_state", {**rank, "state": "D"}) == 0


def test_unreadable_or_bad_files_leave_only_their_metrics_out(tmp_path: Path) -> None:
    root = fake_proc(tmp_path)
    (root / "diskstats").unlink()
    (root / "meminfo").unlink()
    (root / "meminfo").mkdir()  # open() raises IsADirectoryError, an OSError, even for root
    (root / "loadavg").write_text("garbage\n")
    (root / "4242" / "status").unlink()
    host = HostCollector(proc_root=str(root), clock_ticks=100)
    host.track({**RANK0, 999999: TrackedProcess(999999, "job-a", 1, 1)})  # 999999: gone
    host.poll(1.0)
    reg = registry_for(host)
    v = reg.get_sample_value
    assert v("trainguard_host_disk_read_bytes_total", {"device": "vda"}) is None
    assert v("trainguard_host_memory_total_bytes") is None
    assert v("trainguard_host_load1") is None
    assert v("trainguard_host_cpu_seconds_total", {"mode": "user"}) == 10.0
    assert v("trainguard_host_network_receive_bytes_total", {"device": "eth0"}) == 5000
    rank0 = {"job": "job-a", "rank": "0"}
    assert v("trainguard_process_cpu_seconds_total", {**rank0, "mode": "user"}) == 2.5
    assert v("trainguard_process_resident_memory_bytes", rank0) is None  # status unreadable
    assert v("trainguard_process_cpu_seconds_total", {"job": "job-a", "rank": "1", "mode": "user"}) is None


def test_untracked_process_disappears(tmp_path: Path) -> None:
    host = HostCollector(proc_root=str(fake_proc(tmp_path)), clock_ticks=100)
    host.track(RANK0)
    host.poll(1.0)
    reg = registry_for(host)
    assert reg.get_sample_value("trainguard_process_threads", {"job": "job-a", "rank": "0"}) == 9
    host.track({})
    host.poll(2.0)
    assert reg.get_sample_value("trainguard_process_threads", {"job": "job-a", "rank": "0"}) is None


def test_start_without_proc_is_unavailable(tmp_path: Path) -> None:
    with pytest.raises(CollectorUnavailable, match="cannot read"):
        HostCollector(proc_root=str(tmp_path / "missing")).start()
    host = HostCollector(proc_root=str(tmp_path / "missing"))
    host.poll(1.0)  # nothing readable: no metrics, no exception
    assert all(not fam.samples for fam in host.metrics())


def test_real_proc_own_process() -> None:
    me = os.getpid()
    host = HostCollector()
    host.start()
    host.track({me: TrackedProcess(me, "self", 0, 0)})
    host.poll(time.time())
    reg = registry_for(host)
    v = reg.get_sample_value
    assert v("trainguard_host_memory_total_bytes") == pytest.approx(psutil.virtual_memory().total, rel=0.01)
    assert v("trainguard_host_cpus") == psutil.cpu_count()
    assert v("trainguard_host_cpu_seconds_total", {"mode": "idle"}) > 0
    assert v("trainguard_host_network_receive_bytes_total", {"device": "lo"}) is not None
    rank = {"job": "self", "rank": "0"}
    rss = v("trainguard_process_resident_memory_bytes", rank)
    assert rss == pytest.approx(psutil.Process(me).memory_info().rss, rel=0.2)
    assert v("trainguard_process_state", {**rank, "state": "R"}) == 1  # it is running this very code

    def cpu() -> float:
        return sum(v("trainguard_process_cpu_seconds_total", {**rank, "mode": m}) or 0.0 for m in ("user", "system"))

    before = cpu()
    deadline = time.process_time() + 0.25  # this process's CPU time, so a busy machine only slows it
    while time.process_time() < deadline:
        pass
    host.poll(time.time())
    assert 0.15 <= cpu() - before < 5
