"""One cgroup per job, made by the agent (cgroup v2 where mounted, v1 controllers otherwise).

Ranks are the agent's children: without a cgroup of their own they share the agent's, so the
node's CPU and memory accounting mixes the agent with every job, an OOM kill cannot be pinned on
a job, and a process a rank left behind (a data-loader worker that called setsid, a user's
background helper) outlives the job. Each job gets ``trainguard/<job>`` under the cpu, cpuacct,
memory and pids controllers (v1) or the unified hierarchy (v2):

* ranks join it before they run anything (the cold launcher execs them through a two-line shell
  that writes its own pid into ``cgroup.procs``; the warm launcher's zygote lives in it, so the
  ranks it forks are born there);
* CPU (``cpus``: CFS quota) and memory (``memory_max``) limits per job;
* usage for /metrics and status: CPU seconds, memory now and at peak, OOM kills;
* when the job ends, is stopped or restarts, whatever is still in it is killed: no stray process.

The filesystem root is passed in (tests point it at a tmpdir tree); the kernel's files are read
and written as text, one value each.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("trainguard.agent.cgroups")

CONTROLLERS = ("cpu", "cpuacct", "memory", "pids")
_PERIOD_US = 100_000
PARENT = "trainguard"

# The shell prefix that puts a rank into its job's cgroup before exec: no window in which it could
# fork outside, and no preexec_fn in a multi-threaded agent. Arguments: N, N procs files, argv.
JOIN_SCRIPT = ('n=$1; shift; while [ "$n" -gt 0 ]; do echo $$ > "$1" || '
               '{ echo "trainguard: cannot join cgroup $1" >&2; exit 126; }; shift; n=$((n-1)); done; exec "$@"')


class CgroupError(OSError):
    """The job's cgroup cannot be made or used; the message says which file and why."""


@dataclass(frozen=True)
class JobUsage:
    cpu_s: float
    memory_bytes: float
    memory_peak_bytes: float
    oom_kills: int
    processes: int


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _number(path: Path, scale: float = 1.0) -> float:
    text = _read(path)
    try:
        return float(text.split()[0]) * scale if text else math.nan
    except (ValueError, IndexError):
        return math.nan


def _keyed(path: Path, key: str) -> float:
    """``key value`` lines (memory.events, cpu.stat, memory.oom_control)."""
    for line in (_read(path) or "").splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == key:
            try:
                return float(parts[1])
            except ValueError:
                return math.nan
    return math.nan


class JobCgroup:
    """The cgroup of one job: a directory per hierarchy (one on v2)."""

    def __init__(self, job: str, version: str, dirs: dict[str, Path]) -> None:
        self.job = job
        self.version = version
        self.dirs = dirs
        """controller -> directory (on v2 every controller maps to the same one)."""
        self.limits: dict[str, float] = {}

    @property
    def paths(self) -> list[Path]:
        return sorted(set(self.dirs.values()))

    def procs_files(self) -> list[str]:
        return [str(d / "cgroup.procs") for d in self.paths]

    def add(self, pid: int) -> None:
        for f in self.procs_files():
            try:
                Path(f).write_text(f"{pid}\n")
            except OSError as exc:
                raise CgroupError(f"cannot move pid {pid} into {f}: {exc.strerror or exc}") from None

    def pids(self) -> set[int]:
        out: set[int] = set()
        for f in self.procs_files():
            for line in (_read(Path(f)) or "").split():
                if line.isdigit():
                    out.add(int(line))
        return out

    def limit(self, cpus: float = 0.0, memory_max: int = 0) -> None:
        """CPU quota in CPUs (0: none) and memory ceiling in bytes (0: none)."""
        try:
            if self.version == "v2":
                d = self.dirs["cpu"]
                (d / "cpu.max").write_text(f"{int(cpus * _PERIOD_US)} {_PERIOD_US}\n" if cpus > 0 else f"max {_PERIOD_US}\n")
                (d / "memory.max").write_text(f"{memory_max}\n" if memory_max > 0 else "max\n")
            else:
                cpu, mem = self.dirs.get("cpu"), self.dirs.get("memory")
                if cpu is not None:
                    (cpu / "cpu.cfs_period_us").write_text(f"{_PERIOD_US}\n")
                    (cpu / "cpu.cfs_quota_us").write_text(f"{int(cpus * _PERIOD_US)}\n" if cpus > 0 else "-1\n")
                if mem is not None:
                    (mem / "memory.limit_in_bytes").write_text(f"{memory_max}\n" if memory_max > 0 else "-1\n")
        except OSError as exc:
            raise CgroupError(f"job {self.job}: cannot set cgroup limits: {exc}") from None
        self.limits = {"cpus": cpus, "memory_max": float(memory_max)}

    def usage(self) -> JobUsage:
        if self.version == "v2":
            d = self.dirs["cpu"]
            return JobUsage(
                cpu_s=_keyed(d / "cpu.stat", "usage_usec") / 1e6,
                memory_bytes=_number(d / "memory.current"),
                memory_peak_bytes=_number(d / "memory.peak"),
                oom_kills=int(_nan_to(_keyed(d / "memory.events", "oom_kill"), 0)),
                processes=len(self.pids()),
            )
        acct, mem = self.dirs.get("cpuacct"), self.dirs.get("memory")
        return JobUsage(
            cpu_s=_number(acct / "cpuacct.usage", 1e-9) if acct is not None else math.nan,
            memory_bytes=_number(mem / "memory.usage_in_bytes") if mem is not None else math.nan,
            memory_peak_bytes=_number(mem / "memory.max_usage_in_bytes") if mem is not None else math.nan,
            oom_kills=int(_nan_to(_keyed(mem / "memory.oom_control", "oom_kill"), 0)) if mem is not None else 0,
            processes=len(self.pids()),
        )

    def kill_all(self, spare: Iterable[int] = (), timeout_s: float = 5.0) -> list[int]:
        """SIGKILL every process in the job's cgroup but ``spare``; returns the pids killed."""
        keep = set(spare)
        killed: list[int] = []
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            left = self.pids() - keep
            if not left:
                break
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                    if pid not in killed:
                        killed.append(pid)
                except ProcessLookupError:
                    pass
            time.sleep(0.02)  # a process forking as we kill it shows up on the next read
        return killed

    def remove(self, timeout_s: float = 5.0) -> bool:
        """Kill what is left and remove the directories (a dying process holds them a moment)."""
        self.kill_all(timeout_s=timeout_s)
        deadline = time.monotonic() + timeout_s
        pending = self.paths
        while pending and time.monotonic() < deadline:
            still = []
            for d in pending:
                try:
                    d.rmdir()
                except FileNotFoundError:
                    pass
                except OSError:
                    still.append(d)
            pending = still
            if pending:
                time.sleep(0.05)
        if pending:
            log.warning("job %s: cgroup directories left behind: %s", self.job, ", ".join(map(str, pending)))
        return not pending


def _nan_to(value: float, default: float) -> float:
    return default if math.isnan(value) else value


def own_cgroups(proc_cgroup: Path) -> dict[str, str]:
    """controller -> this process's cgroup path in that controller's hierarchy (``/proc/self/cgroup``);
    ``"unified"`` for the v2 hierarchy. Empty when the file cannot be read (taken as the root)."""
    out: dict[str, str] = {}
    for line in (_read(proc_cgroup) or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if not controllers:
            out["unified"] = path
        for c in controllers.split(","):
            if c and not c.startswith("name="):
                out[c] = path
    return out


def cpu_limit(root: Path = Path("/sys/fs/cgroup"), proc_cgroup: Path = Path("/proc/self/cgroup")) -> float | None:
    """The tightest CFS quota, in CPUs, over this process's cgroup and its ancestors (a job's own
    ``cpus``, a container's or a pod's limit); None where there is none or it cannot be read. The
    affinity mask does not show it: a rank limited to 2 CPUs on a 64-core host sees 64."""
    own = own_cgroups(proc_cgroup)
    found: list[float] = []
    if (root / "cgroup.controllers").exists():
        top = root
        here = root / own.get("unified", "/").lstrip("/")
        files: tuple[str, ...] = ("cpu.max",)
    else:
        mount = next((d for d in sorted(root.iterdir()) if not d.is_symlink() and "cpu" in d.name.split(",")), None) \
            if root.is_dir() else None
        if mount is None:
            return None
        top = mount
        here = mount / own.get("cpu", "/").lstrip("/")
        files = ("cpu.cfs_quota_us", "cpu.cfs_period_us")
    while True:
        texts = [_read(here / f) for f in files]
        try:
            if len(texts) == 1 and texts[0] is not None:
                quota, period = texts[0].split()[:2]
                if quota != "max":
                    found.append(int(quota) / int(period))
            elif len(texts) == 2 and texts[0] is not None and texts[1] is not None and int(texts[0]) > 0:
                found.append(int(texts[0]) / int(texts[1]))
        except (ValueError, ZeroDivisionError):
            pass  # a file this kernel writes otherwise: no limit read from it
        if here == top or top not in here.parents:
            break
        here = here.parent
    return min(found) if found else None


class JobCgroups:
    """Makes and finds job cgroups: ``<the agent's own cgroup>/trainguard/<job>`` in each hierarchy.

    Nested under the agent's own cgroup, not at the root: under systemd that is the unit's
    delegated subtree (``Delegate=yes``), in a container the container's own, so a job never
    escapes the limits and the CPU weight the agent itself runs under."""

    def __init__(self, version: str, bases: dict[str, Path]) -> None:
        self.version = version
        self.bases = bases
        """controller -> the ``trainguard`` parent directory in its hierarchy."""

    @classmethod
    def detect(cls, root: Path = Path("/sys/fs/cgroup"), proc_cgroup: Path = Path("/proc/self/cgroup"),
               parent: str = PARENT) -> JobCgroups:
        """The hierarchy here; raises CgroupError saying why none can be used (no root, no mount).
        ``parent``: the directory the job cgroups go in (one per agent: agents side by side on
        one host must not kill each other's ranks when a job of the same name ends)."""
        own = own_cgroups(proc_cgroup)
        if (root / "cgroup.controllers").exists():
            return cls._detect_v2(root, own.get("unified", "/"), parent)
        bases: dict[str, Path] = {}
        if root.is_dir():
            for d in sorted(root.iterdir()):
                if d.is_symlink() or not (d / "cgroup.procs").exists():
                    continue
                for c in d.name.split(","):
                    if c in CONTROLLERS and c not in bases:
                        bases[c] = d / own.get(c, "/").lstrip("/") / parent
        if "memory" not in bases or "cpu" not in bases:
            raise CgroupError(f"no cgroup v2 and no v1 cpu and memory controllers under {root}")
        try:
            for base in set(bases.values()):
                base.mkdir(exist_ok=True)
        except OSError as exc:
            raise CgroupError(f"cannot make the trainguard cgroups under {root}: {exc.strerror or exc}") from None
        return cls("v1", bases)

    @classmethod
    def _detect_v2(cls, root: Path, own: str, parent: str) -> JobCgroups:
        home = root / own.lstrip("/")
        available = set((_read(home / "cgroup.controllers") or "").split())
        wanted = [c for c in ("cpu", "memory", "pids") if c in available]
        base = home / parent
        try:
            if own != "/" and (_read(home / "cgroup.procs") or "").split():
                # v2 allows no processes in a cgroup whose controllers its children use: the agent
                # (and whatever shares its cgroup) moves into a leaf of its own first.
                leaf = home / "agent"
                leaf.mkdir(exist_ok=True)
                for pid in (_read(home / "cgroup.procs") or "").split():
                    try:
                        (leaf / "cgroup.procs").write_text(f"{pid}\n")
                    except OSError:
                        pass  # a process that ended meanwhile
            base.mkdir(exist_ok=True)
            for d in (home, base):
                (d / "cgroup.subtree_control").write_text(" ".join(f"+{c}" for c in wanted) + "\n")
        except OSError as exc:
            raise CgroupError(f"cannot make {base} or enable {wanted} in it: {exc.strerror or exc} "
                              "(under systemd the unit needs Delegate=yes)") from None
        return cls("v2", {c: base for c in CONTROLLERS})

    def close(self) -> None:
        """The agent stops: remove the empty ``trainguard`` parents it made (best effort)."""
        for base in set(self.bases.values()):
            try:
                base.rmdir()
            except OSError:
                pass

    def for_job(self, job: str) -> JobCgroup:
        """The job's cgroup, made if absent (an agent restart finds the one it left)."""
        dirs: dict[str, Path] = {}
        made: dict[Path, Path] = {}
        for c, base in self.bases.items():
            d = made.get(base)
            if d is None:
                d = made[base] = base / job
                try:
                    d.mkdir(exist_ok=True)
                except OSError as exc:
                    raise CgroupError(f"cannot make cgroup {d}: {exc.strerror or exc}") from None
            dirs[c] = d
        return JobCgroup(job, self.version, dirs)
