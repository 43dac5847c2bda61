"""Each job in a cgroup of its own (agent/lifecycle/cgroups.py): the logic on fake v1 and v2
trees, and for real on this machine's cgroups (root): a stray process that left the rank's session
dies with the job, usage is the job's own, a memory ceiling ends in an OOM kill the agent pins on
the job, and the cgroup is gone afterwards."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.waiting import wait_for
from trainguard.agent.lifecycle.cgroups import JOIN_SCRIPT, CgroupError, JobCgroup, JobCgroups, cpu_limit
from trainguard.agent.lifecycle.launcher import Launcher

CGROUP_ROOT = Path("/sys/fs/cgroup")


def _fake_v1(root: Path) -> Path:
    for name in ("cpu", "cpuacct", "memory", "pids", "freezer"):
        (root / name).mkdir(parents=True)
        (root / name / "cgroup.procs").write_text("")
    return root


def _proc_cgroup(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "proc-self-cgroup"
    path.write_text(text)
    return path


def test_v1_tree_one_directory_per_controller_under_the_agents_own_limits_and_usage(tmp_path: Path) -> None:
    root = _fake_v1(tmp_path / "fs")
    (root / "memory" / "box").mkdir()
    own = _proc_cgroup(tmp_path, "5:memory:/box\n4:cpu:/\n3:cpuacct:/\n2:pids:/\n1:name=systemd:/x\n0::/\n")
    groups = JobCgroups.detect(root, own)
    assert groups.version == "v1" and set(groups.bases) == {"cpu", "cpuacct", "memory", "pids"}
    cg = groups.for_job("train")
    # Inside the agent's own memory cgroup (a container's limit is never escaped), at the root elsewhere.
    assert cg.dirs["memory"] == root / "memory" / "box" / "trainguard" / "train"
    assert cg.dirs["cpu"] == root / "cpu" / "trainguard" / "train"
    assert len(cg.procs_files()) == 4
    cg.limit(cpus=1.5, memory_max=1 << 30)
    assert (cg.dirs["cpu"] / "cpu.cfs_quota_us").read_text() == "150000\n"
    assert (cg.dirs["memory"] / "memory.limit_in_bytes").read_text() == f"{1 << 30}\n"
    cg.limit()  # back to no limits
    assert (cg.dirs["cpu"] / "cpu.cfs_quota_us").read_text() == "-1\n"
    (cg.dirs["cpuacct"] / "cpuacct.usage").write_text("2500000000\n")
    (cg.dirs["memory"] / "memory.usage_in_bytes").write_text("1048576\n")
    (cg.dirs["memory"] / "memory.max_usage_in_bytes").write_text("2097152\n")
    (cg.dirs["memory"] / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 2\n")
    (cg.dirs["memory"] / "cgroup.procs").write_text("11\n12\n")
    use = cg.usage()
    assert (use.cpu_s, use.memory_bytes, use.memory_peak_bytes, use.oom_kills) == (2.5, 1 << 20, 2 << 20, 2)
    assert use.processes == 2 and cg.pids() == {11, 12}


class _SlowZygote:
    """A warm launcher whose exit takes a while (CI under load), releasing when told."""

    def __init__(self) -> None:
        self.closing = threading.Event()
        self.release = threading.Event()

    def close(self) -> None:
        self.closing.set()
        self.release.wait(10)


def test_a_job_forgotten_while_its_close_is_in_flight_leaves_no_reading_behind(tmp_path: Path, monkeypatch: Any) -> None:
    # A fake tree's directories hold real files: rmdir would only wait out its timeout.
    monkeypatch.setattr(JobCgroup, "remove", lambda self, timeout_s=5.0: True)
    root = _fake_v1(tmp_path / "fs")
    groups = JobCgroups.detect(root, _proc_cgroup(tmp_path, "4:memory:/\n3:cpu:/\n2:cpuacct:/\n1:pids:/\n"))
    launcher = Launcher(mode="cold", cgroups=groups)
    launcher.job_cgroups["done"] = cg = groups.for_job("done")
    (cg.dirs["cpuacct"] / "cpuacct.usage").write_text("4000000000\n")
    zygote = launcher.zygotes["done"] = _SlowZygote()  # type: ignore[assignment]
    closer = threading.Thread(target=launcher.close_job, args=("done",))
    closer.start()
    assert zygote.closing.wait(5)
    launcher.forget("done")  # the retention ran out before the close did
    assert "done" not in launcher.cgroup_usage()  # the cgroup is still held, its use not shown
    zygote.release.set()
    closer.join(10)
    assert "done" not in launcher.cgroup_usage()
    # Forgotten before its close thread even ran: the close takes no reading either.
    launcher.job_cgroups["late"] = late = groups.for_job("late")
    (late.dirs["cpuacct"] / "cpuacct.usage").write_text("3000000000\n")
    launcher.forget("late")
    assert "late" not in launcher.cgroup_usage()
    launcher.close_job("late")
    assert "late" not in launcher.cgroup_usage() and "late" not in launcher.job_cgroups
    # Without a forget the ended job's reading stays for /metrics until the retention ends.
    launcher.job_cgroups["kept"] = kept = groups.for_job("kept")
    (kept.dirs["cpuacct"] / "cpuacct.usage").write_text("1000000000\n")
    launcher.close_job("kept")
    assert launcher.cgroup_usage()["kept"].cpu_s == 1.0


def test_v2_tree_a_leaf_for_the_agent_and_controllers_enabled_below_its_cgroup(tmp_path: Path) -> None:
    root = tmp_path / "fs"
    home = root / "system.slice" / "trainguard-agent.service"
    home.mkdir(parents=True)
    (root / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    (home / "cgroup.controllers").write_text("cpu memory pids\n")
    (home / "cgroup.procs").write_text("4242\n")
    groups = JobCgroups.detect(root, _proc_cgroup(tmp_path, "0::/system.slice/trainguard-agent.service\n"))
    assert groups.version == "v2"
    assert (home / "agent" / "cgroup.procs").read_text() == "4242\n"  # the agent moved into a leaf
    assert (home / "cgroup.subtree_control").read_text() == "+cpu +memory +pids\n"
    assert (home / "trainguard" / "cgroup.subtree_control").read_text() == "+cpu +memory +pids\n"
    cg = groups.for_job("j")
    assert cg.paths == [home / "trainguard" / "j"]
    cg.limit(cpus=0.5, memory_max=256 << 20)
    assert (cg.paths[0] / "cpu.max").read_text() == "50000 100000\n"
    assert (cg.paths[0] / "memory.max").read_text() == f"{256 << 20}\n"
    (cg.paths[0] / "cpu.stat").write_text("usage_usec 1500000\nuser_usec 1000000\n")
    (cg.paths[0] / "memory.current").write_text("4096\n")
    (cg.paths[0] / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n")
    use = cg.usage()
    assert use.cpu_s == 1.5 and use.memory_bytes == 4096 and use.oom_kills == 1
    assert use.memory_peak_bytes != use.memory_peak_bytes  # NaN: memory.peak absent (kernel < 5.19)


def test_no_cgroup_filesystem_says_why(tmp_path: Path) -> None:
    with pytest.raises(CgroupError, match="no cgroup v2 and no v1 cpu and memory controllers"):
        JobCgroups.detect(tmp_path)


# --- for real --------------------------------------------------------------------------------

needs_cgroups = pytest.mark.skipif(
    os.geteuid() != 0 or not ((CGROUP_ROOT / "memory" / "cgroup.procs").exists()
                              or (CGROUP_ROOT / "cgroup.controllers").exists()),
    reason="needs root and a cgroup filesystem (the fake-tree tests above cover the logic)")


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


@needs_cgroups
@pytest.mark.slow
def test_a_stopped_job_takes_its_strays_with_it_and_its_usage_is_its_own(agent_factory: Any) -> None:
    agent = agent_factory(config="[collectors]\nebpf = false\ngpu = false\n")
    client = agent.client()
    # The rank starts a helper in a session of its own (killpg of the rank cannot reach it), then works.
    script = "setsid sleep 600 & python3 -c 'x = bytearray(40 << 20)\nimport time\nwhile True: sum(range(10**5))'"
    submitted = time.monotonic()
    client.submit_job({"job": "cg", "nproc": 1, "command": ["/bin/sh", "-c", script], "cpus": 0.5})
    job = wait_for(lambda: (j := client.job("cg")).get("cgroup") and j["cgroup"]["processes"] >= 3 and j, 30, "cgroup")
    cg = job["cgroup"]
    assert cg["limits"]["cpus"] == 0.5 and all("/trainguard-" in p and p.endswith("/cg") for p in cg["paths"])
    pids = {int(p) for path in cg["paths"] for p in Path(path, "cgroup.procs").read_text().split()}
    stray = next(p for p in pids if _cmdline(p).startswith("sleep 600"))
    rank = job["ranks"][0]["pid"]
    assert rank in pids and os.getsid(stray) != os.getsid(rank)
    use = wait_for(lambda: (u := client.job("cg")["cgroup"])["cpu_s"] > 0.3 and u, 60, "the job's CPU time")
    assert use["memory_bytes"] > 30 << 20
    # The half-CPU quota holds: never more than half of the time since the job was submitted (plus
    # one quota period of 0.1 s), however loaded the machine is.
    assert use["cpu_s"] <= 0.5 * (time.monotonic() - submitted) + 0.1
    with urllib.request.urlopen(agent.metrics_url(), timeout=10) as resp:
        text = resp.read().decode()
    assert 'trainguard_job_cpu_seconds_total{job="cg"}' in text and 'trainguard_job_memory_bytes{job="cg"}' in text

    client.stop_job("cg")
    wait_for(lambda: client.job("cg")["state"] == "stopped", 30, "job stopped")
    wait_for(lambda: not os.path.exists(f"/proc/{stray}") or _cmdline(stray) == "", 10, "the stray killed")
    wait_for(lambda: not any(Path(p).exists() for p in cg["paths"]), 10, "the cgroup removed")


@needs_cgroups
@pytest.mark.slow
def test_a_memory_ceiling_ends_in_an_oom_kill_pinned_on_the_job(agent_factory: Any) -> None:
    agent = agent_factory(config="[collectors]\nebpf = false\ngpu = false\n")
    client = agent.client()
    hog = "import time\nx = []\nwhile True:\n    x.append(bytearray(8 << 20)); time.sleep(0.01)"
    client.submit_job({"job": "oom", "nproc": 1, "command": ["python3", "-c", hog], "memory_max": 64 << 20,
                       "max_restarts": 0})
    ev = wait_for(lambda: [e for e in client.events(since=0, limit=1000, kind="job_oom_kill")["events"]
                        if e.get("job") == "oom"], 60, "job_oom_kill")
    f = ev[0]["fields"]
    assert f["oom_kills"] >= 1 and f["memory_limit_bytes"] == 64 << 20 and f["memory_peak_bytes"] >= 60 << 20
    wait_for(lambda: client.job("oom")["state"] == "failed", 30, "the job failed (no restarts allowed)")
    exits = client.job("oom")["ranks"]
    assert exits[0]["exit_signal"] == 9


def test_cpu_limit_is_the_tightest_quota_over_the_process_cgroup_and_its_ancestors(tmp_path: Path) -> None:
    v2 = tmp_path / "v2"
    job = v2 / "kubepods" / "pod1" / "rank"
    job.mkdir(parents=True)
    (v2 / "cgroup.controllers").write_text("cpu memory\n")
    (v2 / "kubepods" / "cpu.max").write_text("max 100000\n")
    (v2 / "kubepods" / "pod1" / "cpu.max").write_text("250000 100000\n")  # the pod's limit: 2.5 CPUs
    (job / "cpu.max").write_text("max 100000\n")
    own = _proc_cgroup(tmp_path, "0::/kubepods/pod1/rank\n")
    assert cpu_limit(v2, own) == 2.5
    (job / "cpu.max").write_text("50000 100000\n")
    assert cpu_limit(v2, own) == 0.5
    (job / "cpu.max").write_text("garbage\n")  # unreadable: the ancestors still count
    assert cpu_limit(v2, own) == 2.5
    assert cpu_limit(v2, _proc_cgroup(tmp_path, "0::/kubepods\n")) is None

    v1 = _fake_v1(tmp_path / "v1")
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    (v1 / "cpu" / "job").mkdir()
    (v1 / "cpu" / "job" / "cpu.cfs_quota_us").write_text("300000\n")
    (v1 / "cpu" / "job" / "cpu.cfs_period_us").write_text("100000\n")
    assert cpu_limit(v1, _proc_cgroup(tmp_path, "3:cpu:/job\n2:memory:/\n")) == 3.0
    assert cpu_limit(v1, _proc_cgroup(tmp_path, "3:cpu:/\n")) is None
    assert cpu_limit(tmp_path / "absent", own) is None


def test_a_rank_in_a_job_cgroup_with_a_cpu_quota_counts_the_quota_not_the_host_cores(tmp_path: Path) -> None:
    """For real: a process started into a job cgroup limited to half a CPU (the agent's ``cpus``)
    reads 0.5, and the snapshots' helper thread does not pay there however many cores it sees."""
    groups = JobCgroups.detect(CGROUP_ROOT, parent=f"trainguard-test-{os.getpid()}")
    cg = groups.for_job("cpu-limit")
    try:
        cg.limit(cpus=0.5)
        code = ("from trainguard.checkpoint.snapshot.cost import overlap_pays, usable_cpus; "
                "print(usable_cpus(), overlap_pays(1, threads=1))")
        files = cg.procs_files()
        out = subprocess.run(["/bin/sh", "-c", JOIN_SCRIPT, "sh", str(len(files)), *files, sys.executable, "-c", code],
                             capture_output=True, text=True, timeout=120, cwd=tmp_path,
                             env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.split() == ["0.5", "False"], (out.stdout, len(os.sched_getaffinity(0)))
    finally:
        cg.remove()
        groups.close()
