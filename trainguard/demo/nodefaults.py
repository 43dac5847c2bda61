"""What a node does to a training job from outside it: a CPU cgroup with a quota or a weight, CPU
hogs pinned to a core. The demo, the benchmarks and the tests make their stragglers with these, so
that the cause is one the agent's collectors can see (cgroup throttling, run-queue delay) rather
than the trainer slowing itself down.

cgroup v2 is used where its ``cpu`` controller is enabled at the root, v1's ``cpu`` hierarchy
otherwise (as on this machine kind). Needs root.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

V2_ROOT = Path("/sys/fs/cgroup")
V1_ROOT = Path("/sys/fs/cgroup/cpu")
_PERIOD_US = 100_000

HOG_PROGRAM = "import os, sys\ncpu = int(sys.argv[1])\nif cpu >= 0:\n    os.sched_setaffinity(0, {cpu})\nwhile True:\n    pass\n"


def cpu_cgroup_root() -> tuple[Path, str]:
    """(root directory, "v2" | "v1") of the CPU controller; OSError when there is none."""
    controllers = V2_ROOT / "cgroup.controllers"
    if controllers.exists() and "cpu" in controllers.read_text().split():
        return V2_ROOT, "v2"
    if (V1_ROOT / "cpu.cfs_quota_us").exists():
        return V1_ROOT, "v1"
    raise OSError("no CPU cgroup controller (neither cgroup v2 with cpu enabled nor v1 cpu)")


def cpu_cgroup_unavailable() -> str | None:
    """Why CpuCgroup cannot be used here, or None when it can."""
    if os.geteuid() != 0:
        return "moving processes between CPU cgroups needs root"
    try:
        root, _ = cpu_cgroup_root()
    except OSError as exc:
        return str(exc)
    if not os.access(root, os.W_OK):
        return f"{root} is not writable"
    return None


def own_cpu_cgroup() -> Path:
    """The CPU cgroup directory this process runs in (the hierarchy's root when it cannot tell):
    groups made inside it keep whatever share of the machine the caller was given."""
    root, version = cpu_cgroup_root()
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return root
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        controllers, path = parts[1], parts[2]
        if (version == "v2" and controllers == "") or (version == "v1" and "cpu" in controllers.split(",")):
            here = root / path.lstrip("/")
            return here if here.is_dir() else root
    return root


class CpuCgroup:
    """A CPU cgroup made for one purpose and removed after (its processes go back to the parent)."""

    def __init__(self, prefix: str = "tg", parent: CpuCgroup | Path | None = None) -> None:
        root, self.version = cpu_cgroup_root()
        self.parent: Path = parent.path if isinstance(parent, CpuCgroup) else (parent or root)
        self.path: Path = self.parent / f"{prefix}-{uuid.uuid4().hex[:8]}"
        self.path.mkdir()
        self.members: list[int] = []

    def quota(self, fraction: float) -> None:
        """At most ``fraction`` of one CPU (CFS bandwidth control)."""
        if self.version == "v2":
            (self.path / "cpu.max").write_text(f"{int(fraction * _PERIOD_US)} {_PERIOD_US}\n")
        else:
            (self.path / "cpu.cfs_period_us").write_text(f"{_PERIOD_US}\n")
            (self.path / "cpu.cfs_quota_us").write_text(f"{int(fraction * _PERIOD_US)}\n")

    def weight(self, times: int) -> None:
        """CPU weight ``times`` the default (v1 cpu.shares 1024, v2 cpu.weight 100)."""
        if self.version == "v2":
            (self.path / "cpu.weight").write_text(f"{min(10000, 100 * times)}\n")
        else:
            (self.path / "cpu.shares").write_text(f"{1024 * times}\n")

    def add(self, pid: int) -> None:
        """Move a process, all its threads, into the group (its later children start there)."""
        (self.path / "cgroup.procs").write_text(f"{pid}\n")
        self.members.append(pid)

    def throttled_s(self) -> float:
        """Seconds the group's tasks were held back by the quota so far."""
        text = (self.path / "cpu.stat").read_text()
        stats = dict(line.split() for line in text.splitlines() if len(line.split()) == 2)
        if "throttled_usec" in stats:
            return int(stats["throttled_usec"]) / 1e6
        return int(stats.get("throttled_time", 0)) / 1e9

    def remove(self) -> None:
        """Every process still in the group (members and their children) back to the parent, then
        the group itself."""
        try:
            inside = [int(p) for p in (self.path / "cgroup.procs").read_text().split()]
        except (OSError, ValueError):
            inside = []
        for pid in dict.fromkeys([*self.members, *inside]):
            try:
                (self.parent / "cgroup.procs").write_text(f"{pid}\n")
            except OSError:
                pass  # the process is gone
        for _ in range(50):  # a process that just exited leaves the group a moment later
            try:
                # Groups made inside this one (an agent under test nests its job cgroups in its own) first.
                for child in sorted((d for d in self.path.rglob("*") if d.is_dir()), key=lambda d: -len(d.parts)):
                    child.rmdir()
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.1)


def pin(pid: int, cpu: int) -> None:
    """Every thread of ``pid`` onto one CPU (threads started later inherit the caller's mask)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), {cpu})
        except OSError:
            pass  # the thread ended


def start_cpu_hog(cpu: int | None = None) -> subprocess.Popen[bytes]:
    """A process that spins on one CPU (any, when ``cpu`` is None) until killed."""
    return subprocess.Popen([sys.executable, "-c", HOG_PROGRAM, str(-1 if cpu is None else cpu)])
