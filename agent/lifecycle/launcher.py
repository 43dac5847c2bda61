"""Starts a job's local ranks as the agent's own children, watches them, stops them.

Each start attempt gets a fresh rendezvous port, so restarted ranks never read a dead attempt's
addresses from the store (torchrun's gloo restarts fail that way). A user's command gets torchrun's environment
contract (``torchrun_env``), its own working directory and its own ``PYTHONPATH`` (nothing of
trainguard's is put on it, so its own ``agent.py`` or ``trainer.py`` stay its own). Ranks never inherit the agent's capabilities: they
run as a configured user, or through ``setpriv`` with every capability set cleared, and they start from an
allow-listed environment, not the agent's (``agent.lifecycle.rankenv``).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Literal

from trainguard.agent.lifecycle.cgroups import JOIN_SCRIPT, CgroupError, JobCgroup, JobCgroups, JobUsage
from trainguard.agent.lifecycle.jobs import JobSpec
from trainguard.agent.lifecycle.rankenv import (
    RESTORE_SCRIPT,
    RankUser,
    RankUserError,
    agent_env_for_ranks,
    can_drop,
    defer_unsecure,
    drop_argv,
    unsecure,
    user_env,
)
from trainguard.agent.lifecycle.ranklogs import RankLogRotator
from trainguard.agent.lifecycle.ranks import (
    SOCKET_IFNAME_VARS,
    LaunchContext,
    RankBlock,
    RankProcess,
    torchrun_env,
    visible_gpus,
)
from trainguard.agent.lifecycle.reach import Identity, R, X, blocker, program_blocker
from trainguard.agent.lifecycle.units import (
    UnitProcess,
    run_prefix,
    set_slice_limits,
    slice_name,
    slice_usage,
    unit_name,
    write_env_file,
)
from trainguard.agent.lifecycle.zygote_client import Zygote, ZygoteError
from trainguard.agent.wire import ENV_HOST_STORE, ENV_JOB, ENV_JOB_SPEC, ENV_PLAN, ENV_SOCKET

log = logging.getLogger("trainguard.agent.launcher")

# The directory that holds the ``trainguard`` package (the checkout, or site-packages).
PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _same_interpreter(command: str, python: str, path: str | None) -> bool:
    found = shutil.which(command, path=path) if os.sep not in command else command
    if not found:
        return False
    try:
        return os.path.samefile(found, python) or os.path.realpath(found) == os.path.realpath(python)
    except OSError:
        return False


def _nth(items: tuple[int, ...] | None, i: int) -> int | None:
    return items[i] if items is not None and i < len(items) else None


def _privilege_wrapper(user: RankUser | None) -> tuple[list[str], dict[str, object]]:
    """argv prefix and Popen kwargs that start a rank without the agent's privileges: ``setpriv``
    when the agent is root (the prefix runs after the cgroup join, which needs root), else Popen's
    own user switch (a non-root agent can only start ranks as itself anyway)."""
    if can_drop():
        return drop_argv(user), {}
    if user is not None:
        return [], {"user": user.uid, "group": user.gid, "extra_groups": []}
    return [], {}


class Launcher:
    """Cold mode starts each rank as a fresh interpreter; warm mode forks ranks from a per-job
    zygote that already imported torch and the trainer (restart in ~1 s instead of ~10 s)."""

    def __init__(self, mode: Literal["warm", "cold"] = "warm", clock: Callable[[], float] = time.monotonic,
                 cgroups: JobCgroups | None = None, units: bool = False, *, log_max_bytes: int = 64 << 20,
                 log_keep: int = 3) -> None:
        """``cgroups``: give each job a cgroup of its own (None: ranks stay in the agent's);
        ``units``: start each rank as a transient systemd unit (``agent.lifecycle.units``);
        ``log_max_bytes``/``log_keep``: rank logs are rotated past this size, this many kept."""
        self.units = units
        self.logs = RankLogRotator(log_max_bytes, log_keep)
        self.env_dirs: dict[str, str] = {}
        """job -> the directory of its rank units' environment files (removed with the job)."""
        if units:
            mode, cgroups = "cold", None  # systemd makes each rank's cgroup; a zygote would pin them in one
        self.mode = mode
        self.clock = clock
        self.zygotes: dict[str, Zygote] = {}
        self._closing: set[Zygote] = set()
        """Warm launchers a job's end is closing on its own thread (``close_all`` waits for them)."""
        self.warm_failures = 0
        self.cgroups = cgroups
        self.job_cgroups: dict[str, JobCgroup] = {}
        self.final_usage: dict[str, JobUsage] = {}
        """What a job's cgroup had used when the job ended (kept until ``forget``)."""
        self.final_limits: dict[str, dict[str, float]] = {}
        self.unit_jobs: set[str] = set()
        # close_job runs on its own thread (a zygote's exit can take seconds under load) and may not
        # have run, or be in flight, when the job is forgotten: the job's cgroup is still held then,
        # but neither its live use nor the final reading close_job takes may show after that.
        self._close_lock = threading.Lock()
        self._forgotten: set[str] = set()

    def job_cgroup(self, spec: JobSpec, ctx: LaunchContext) -> JobCgroup | None:
        """The job's cgroup with its limits applied; leftovers of a previous attempt (but the
        warm launcher's zygote) killed. Raises CgroupError: the launch fails, saying why."""
        if self.cgroups is None:
            return None
        with self._close_lock:
            self._forgotten.discard(spec.job)  # the same name submitted again
        cg = self.job_cgroups.get(spec.job)
        if cg is None:
            cg = self.job_cgroups[spec.job] = self.cgroups.for_job(spec.job)
        cg.limit(spec.cpus or ctx.cpus, spec.memory_max or ctx.memory_max)
        zygote = self.zygotes.get(spec.job)
        strays = cg.kill_all(spare=zygote.own_pids() if zygote is not None and zygote.alive else ())
        if strays:
            log.warning("job %s: killed %d process(es) the previous attempt left in its cgroup", spec.job, len(strays))
        return cg

    def reattach_cgroup(self, spec: JobSpec) -> None:
        """An adopted job: the cgroup the previous agent made for it (nothing in it is killed)."""
        if self.cgroups is None or spec.job in self.job_cgroups:
            return
        try:
            self.job_cgroups[spec.job] = self.cgroups.for_job(spec.job)
        except CgroupError as exc:
            log.warning("job %s: its cgroup cannot be found again: %s", spec.job, exc)

    def owns_pid(self, job: str, pid: int) -> bool:
        """Proof that process ``pid`` is one of ``job``'s: it sits in the job's systemd slice or
        in the job's cgroup (a pid alone may have been used again by anyone)."""
        try:
            with open(f"/proc/{pid}/cgroup") as fh:
                paths = [line.split(":", 2)[2].strip() for line in fh if line.count(":") >= 2]
        except OSError:
            return False
        if any(slice_name(job) in p.split("/") for p in paths):
            return True
        if self.cgroups is None:
            return False
        cg = self.job_cgroups.get(job)
        if cg is None:
            try:
                cg = self.cgroups.for_job(job)
            except CgroupError:
                return False
        return pid in cg.pids()

    def cgroup_usage(self, units: bool = True) -> dict[str, JobUsage]:
        """Each job's use: live for running jobs, the last reading for ended ones. ``units=False``
        leaves out jobs whose ranks are systemd units (a ``systemctl show`` each, and no OOM count)."""
        out = dict(self.final_usage)
        for job in list(self.unit_jobs) if units else ():
            use = slice_usage(job)
            out[job] = JobUsage(use["cpu_s"], use["memory_bytes"], float("nan"), 0, 0)
        with self._close_lock:
            held = [(job, cg) for job, cg in self.job_cgroups.items() if job not in self._forgotten]
        for job, cg in held:
            out[job] = cg.usage()
        return out

    def limits(self, job: str) -> dict[str, float]:
        cg = self.job_cgroups.get(job)
        return dict(cg.limits) if cg is not None else dict(self.final_limits.get(job, {}))

    def forget(self, job: str) -> None:
        with self._close_lock:
            if job in self.job_cgroups:
                self._forgotten.add(job)  # close_job still to run, or running
            self.unit_jobs.discard(job)
            self.final_usage.pop(job, None)
            self.final_limits.pop(job, None)
    def _zygote(self, spec: JobSpec, ctx: LaunchContext, argv_prefix: list[str], env: dict[str, str],
                cwd: str) -> Zygote | None:
        zygote = self.zygotes.get(spec.job)
        if zygote is not None and zygote.alive:
            return zygote
        zygote_log = os.path.join(ctx.log_dir, "zygote.log")
        self.logs.watch(spec.job, zygote_log)
        try:
            zygote = Zygote(
                argv_prefix + [ctx.python or sys.executable, "-m", "trainguard.trainer.zygote"],
                env,
                cwd,
                zygote_log,
            )
        except (OSError, ZygoteError):
            self.warm_failures += 1
            return None
        self.zygotes[spec.job] = zygote
        return zygote

    @staticmethod
    def warm_module(spec: JobSpec, python: str = "") -> tuple[str, list[str]] | None:
        """What the warm launcher can fork for this job: ``(module, args)`` for ``python -m module``,
        ``("path:" + script, args)`` for ``python script.py``; None for anything else, or when the
        command's interpreter is not the warm launcher's (a user's own venv: started cold, as is)."""
        if not spec.command:
            return "trainguard.trainer.worker", []
        cmd = spec.command
        if len(cmd) < 2 or not _same_interpreter(cmd[0], python or sys.executable, spec.env.get("PATH")):
            return None
        if any(unsecure(k) for k in spec.env):
            return None  # LD_PRELOAD and kin act when a process starts: only a fresh one has them
        if cmd[1] == "-u":  # torchrun's unbuffered python: the warm launcher's rank output is line-buffered
            cmd = [cmd[0], *cmd[2:]]
        if len(cmd) >= 3 and cmd[1] == "-m":
            return cmd[2], list(cmd[3:])
        if len(cmd) >= 2 and cmd[1].endswith(".py") and not cmd[1].startswith("-"):
            script = cmd[1] if os.path.isabs(cmd[1]) else os.path.join(spec.cwd or os.getcwd(), cmd[1])
            return f"path:{script}", list(cmd[2:])
        return None

    def close_all(self, timeout: float = 5.0) -> None:
        """Agent shutdown: every job's warm launcher and cgroup goes, and no warm launcher a job's
        end is still closing outlives the agent (an agent run by ``trainguard run`` leaves nothing)."""
        for job in set(self.zygotes) | set(self.job_cgroups):
            self.close_job(job)
        for zygote in list(self._closing):
            try:
                zygote.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                zygote.proc.kill()
                zygote.proc.wait()
        if self.cgroups is not None:
            self.cgroups.close()

    def close_job(self, job: str) -> None:
        """The job ended: its warm launcher goes, then everything left in its cgroup, then the cgroup."""
        try:
            zygote = self.zygotes.pop(job, None)
            if zygote is not None:
                self._closing.add(zygote)
                zygote.close()
                self._closing.discard(zygote)
            self.logs.forget(job)
            env_dir = self.env_dirs.pop(job, None)
            if env_dir is not None:
                shutil.rmtree(env_dir, ignore_errors=True)  # the job's secrets go with it
            cg = self.job_cgroups.get(job)
            if cg is not None:
                use = cg.usage()  # read before the cgroup goes (an OOM kill at the end)
                with self._close_lock:
                    if job not in self._forgotten:
                        self.final_usage[job] = use
                        self.final_limits[job] = dict(cg.limits)
                    self.job_cgroups.pop(job, None)
                strays = cg.kill_all()
                if strays:
                    log.warning("job %s ended: killed %d process(es) left in its cgroup: %s", job, len(strays), strays)
                cg.remove()
        finally:
            with self._close_lock:
                self._forgotten.discard(job)

    @staticmethod
    def rank_cwd(spec: JobSpec, ctx: LaunchContext) -> str:
        if spec.is_command:
            return spec.cwd or ctx.log_dir
        return PACKAGE_PARENT

    def rank_command(self, spec: JobSpec, ctx: LaunchContext) -> list[str]:
        if spec.command:
            return list(spec.command)
        return [ctx.python or sys.executable, "-m", "trainguard.trainer.worker"]

    def unreachable(self, spec: JobSpec, ctx: LaunchContext) -> str | None:
        """Why ``launcher.user`` cannot start this job's ranks (None: it can, or there is no such
        user): the program a cold or unit rank execs, the script a warm rank reads, the directory
        it starts in."""
        if not ctx.user:
            return None
        try:
            user = RankUser.lookup(ctx.user)
        except RankUserError:
            return None  # the agent refused to start with it; nothing to add here
        who = Identity.of(user.uid, user.gid)
        warm = self.warm_module(spec, ctx.python) if self.mode == "warm" else None
        if warm is None:
            why = program_blocker(self.rank_command(spec, ctx)[0], spec.env.get("PATH"), who)
        elif warm[0].startswith("path:"):
            why = blocker(warm[0][len("path:"):], who, R)
        else:
            why = None
        if why is None and spec.cwd:
            why = blocker(os.path.join(spec.cwd, "."), who, X)
        return f"launcher.user {user.name} cannot start this job's ranks: {why}" if why else None

    def start(self, spec: JobSpec, ctx: LaunchContext, attempt: int, env_overrides: dict[str, str] | None = None,
              block: RankBlock | None = None) -> list[RankProcess]:
        """Start the job's ranks on this node: all of them, or only ``block`` of a job that spans
        nodes (global RANK = offset + local rank, the block's master address and port)."""
        os.makedirs(ctx.log_dir, exist_ok=True)
        if block is None:
            block = RankBlock(0, spec.nproc, spec.nproc, ctx.master_addr, free_port(ctx.master_addr))
        elif block.attempt > 0:
            attempt = block.attempt  # every node's ranks of a spanning job agree on the cluster's attempt
        user = RankUser.lookup(ctx.user) if ctx.user else None
        drop, popen_kwargs = _privilege_wrapper(user)
        cg = self.job_cgroup(spec, ctx)
        join: list[str] = []
        if cg is not None:
            # Joined before the privilege drop (the cgroup is root's) and before anything can fork.
            files = cg.procs_files()
            join = ["/bin/sh", "-c", JOIN_SCRIPT, "sh", str(len(files)), *files]
            if popen_kwargs:
                # Popen's own switch would drop before the join, which then fails (exit 126).
                raise RuntimeError("launcher.user with job cgroups needs setpriv (util-linux) on this host")
        base_env = agent_env_for_ranks()
        if user is not None:
            base_env.update(user_env(user))
        if not spec.is_command:
            # The embedded trainer is trainguard's own code: find it even from a plain checkout.
            pythonpath = base_env.get("PYTHONPATH", "")
            base_env["PYTHONPATH"] = PACKAGE_PARENT + (os.pathsep + pythonpath if pythonpath else "")
        base_env.update(ctx.extra_env)
        # What the agent, not the job, chose: all that a root warm launcher of a launcher.user job gets.
        agent_env = dict(base_env)
        base_env.update(spec.env)
        if block.socket_ifname:
            for key in SOCKET_IFNAME_VARS:
                base_env.setdefault(key, block.socket_ifname)
        gpus = visible_gpus(ctx.gpus, base_env.get("CUDA_VISIBLE_DEVICES"))
        if gpus is not None:
            base_env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))
        if spec.is_command and block.nproc > 1:
            # As torchrun does: one intra-op thread per rank unless the user chose otherwise.
            base_env.setdefault("OMP_NUM_THREADS", "1")
        cwd = self.rank_cwd(spec, ctx)
        if spec.faults:
            base_env["TRAINGUARD_FAULTS"] = ";".join(spec.faults)
            # An injected fault fires once per job, not again in every restarted attempt.
            marker = base_env.setdefault("TRAINGUARD_FAULT_MARKER_DIR", os.path.join(ctx.log_dir, "faults-fired"))
            if user is not None and marker == os.path.join(ctx.log_dir, "faults-fired"):
                os.makedirs(marker, mode=0o700, exist_ok=True)
                os.chown(marker, user.uid, user.gid, follow_symlinks=False)
        zygote = None
        rank_uid: tuple[int, int] | None = None
        warm_target = self.warm_module(spec, ctx.python)
        if self.mode == "warm" and warm_target is not None:
            if user is not None and drop:
                # The warm launcher stays root with CAP_SETUID/CAP_SETGID only (it writes the rank
                # logs and exit files in the agent's tree), in a directory and environment of the
                # agent's choosing; each rank it forks drops to the user before the job's code runs.
                rank_uid = (user.uid, user.gid)
                zygote = self._zygote(spec, ctx, join + drop_argv(None, keep_setuid=True), agent_env, PACKAGE_PARENT)
            else:
                zygote = self._zygote(spec, ctx, join + drop, base_env, cwd)
        ranks: list[RankProcess] = []
        for local in range(block.nproc):
            rank = block.rank_offset + local
            env = dict(base_env)
            env.update(
                {
                    "MASTER_ADDR": block.master_addr,
                    "MASTER_PORT": str(block.master_port),
                    "RANK": str(rank),
                    "LOCAL_RANK": str(local),
                    "WORLD_SIZE": str(block.world_size),
                    "LOCAL_WORLD_SIZE": str(block.nproc),
                    "GROUP_RANK": str(block.group_rank),
                    "TRAINGUARD_ATTEMPT": str(attempt),
                    ENV_SOCKET: ctx.telemetry_socket,
                    ENV_PLAN: ctx.plan_path,
                    ENV_JOB: spec.job,
                }
            )
            if not spec.is_command or spec.trainer:
                # A command's own TRAINGUARD_JOB_SPEC stays (the trainer's worker run as a command).
                env[ENV_JOB_SPEC] = json.dumps(spec.trainer)
            if spec.is_command:
                env.update(torchrun_env(spec, block, attempt, rank))
            if env_overrides:
                env.update(env_overrides)
            env.update(block.env)
            log_path = os.path.join(ctx.log_dir, f"rank{rank}.log")
            self.logs.watch(spec.job, log_path)
            if zygote is not None:
                # The rendezvous store is up before any rank's code runs (trainer/zygote.py).
                env["TORCHELASTIC_USE_AGENT_STORE"] = "True"
                if rank == 0 and not block.rendezvous:  # trainguard run --nnodes serves it
                    env[ENV_HOST_STORE] = "1"
                assert warm_target is not None
                child = zygote.spawn(rank, env, log_path, cwd, warm_target[0], warm_target[1], user=rank_uid)
                ranks.append(RankProcess(rank, local, child, self.clock(), log_path, gpu=_nth(gpus, local)))
                continue
            if self.units:
                ranks.append(self._start_unit(spec, ctx, attempt, rank, local, env, cwd, log_path, gpus))
                continue
            argv = self.rank_command(spec, ctx)
            popen_env = env
            if join or drop:
                # Root runs the join and setpriv: the job's loader variables wait until it has left.
                popen_env, deferred = defer_unsecure(env)
                argv = join + drop + (["/bin/sh", "-c", RESTORE_SCRIPT, "sh"] if deferred else []) + argv
            log = open(log_path, "ab")
            try:
                popen = subprocess.Popen(  # type: ignore[call-overload]
                    argv,
                    env=popen_env,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=cwd,
                    start_new_session=True,
                    **popen_kwargs,
                )
            finally:
                log.close()
            ranks.append(RankProcess(rank, local, popen, self.clock(), log_path, gpu=_nth(gpus, local)))
        self.logs.start()
        return ranks

    def _env_dir(self, spec: JobSpec, ctx: LaunchContext) -> str:
        """The job's directory of unit environment files: root's, 0700, never through a link."""
        path = self.env_dirs.get(spec.job)
        if path is None:
            # The job id as is (``wire.valid_job_id``): systemd unescapes ``\x2d`` in a property value.
            path = (os.path.join(ctx.run_dir, "env", spec.job) if ctx.run_dir
                    else os.path.join(ctx.log_dir, ".env"))
            os.makedirs(path, mode=0o700, exist_ok=True)
            if os.path.islink(path):
                raise OSError(f"{path} is a symbolic link: refusing to write a job's environment there")
            os.chmod(path, 0o700)
            self.env_dirs[spec.job] = path
        return path

    def _start_unit(self, spec: JobSpec, ctx: LaunchContext, attempt: int, rank: int, local: int, env: dict[str, str],
                    cwd: str, log_path: str, gpus: tuple[int, ...] | None) -> RankProcess:
        """One rank as a transient systemd unit in the job's slice (see agent/lifecycle/units.py)."""
        if spec.job not in self.unit_jobs:
            set_slice_limits(spec.job, spec.cpus or ctx.cpus, spec.memory_max or ctx.memory_max)
            self.unit_jobs.add(spec.job)
        unit = unit_name(spec.job, attempt, rank)
        env_file = os.path.join(self._env_dir(spec, ctx), f"a{attempt}-r{rank}.env")
        write_env_file(env_file, env)
        argv = run_prefix(unit, spec.job, log_path=log_path, cwd=cwd, env_file=env_file, user=ctx.user,
                          properties=spec.unit_properties) + self.rank_command(spec, ctx)
        with open(log_path, "ab") as log:
            popen = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        return RankProcess(rank, local, UnitProcess(popen, unit), self.clock(), log_path, gpu=_nth(gpus, local))

    def reap(self, ranks: list[RankProcess]) -> list[RankProcess]:
        """Collect exit statuses without blocking; returns the ranks that ended since the last call."""
        ended = []
        for r in ranks:
            if not r.alive:
                continue
            code = r.popen.poll()
            if code is None:
                continue
            if code < 0:
                r.exit_signal = -code
                r.exit_code = 128 - code
            else:
                r.exit_code = code
            r.ended = self.clock()
            ended.append(r)
        return ended

    def signal(self, ranks: list[RankProcess], signum: int) -> int:
        """Send ``signum`` to each running rank's process group; how many got it."""
        sent = 0
        for r in ranks:
            if r.popen.poll() is None:
                try:
                    os.killpg(r.pid, signum)
                    sent += 1
                except ProcessLookupError:
                    pass
        return sent

    def stop(self, ranks: list[RankProcess], grace_s: float, *, hard: bool = False) -> None:
        """SIGTERM (or SIGKILL when hard), wait up to grace_s, then SIGKILL what is left."""
        first = signal.SIGKILL if hard else signal.SIGTERM
        for r in ranks:
            if r.popen.poll() is None:
                try:
                    os.killpg(r.pid, first)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace_s
        for r in ranks:
            remaining = max(0.0, deadline - time.monotonic())
            try:
                r.popen.wait(timeout=remaining)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(r.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                r.popen.wait()
        for r in ranks:
            if isinstance(r.popen, UnitProcess):
                r.popen.stop_unit()  # whatever else the rank left in its unit
        self.reap(ranks)
