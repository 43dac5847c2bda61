"""Warm rank launcher ("zygote"): imports torch and the trainer once, then forks ranks on request.

Restarting a rank the cold way costs 9-15 s here, almost all of it imports and first-call set-up
(``import torch`` alone takes 3-4 s); a fork from a process that already holds them costs milliseconds. The
zygote stays single-threaded and runs no torch op, so forking it is safe.

Protocol (JSON lines): the agent writes ``{"op": "spawn", "rank": r, "env": {...}, "module": m,
(a module name, or ``path:/abs/script.py`` for a script)
"args": [...], "log": path, "cwd": dir}`` and ``{"op": "exit"}`` on stdin; the zygote answers
``{"ev": "ready", "pid": p, "import_s": t}`` once, then ``{"ev": "spawned", "rank": r, "pid": p}``
and ``{"ev": "exit", "pid": p, "code": c, "signal": s}`` on stdout, and ``{"ev": "spare", "pid": p}``
for each process it forks ahead of need (``Spares``: a later spawn's ``pid`` may be one;
``{"ev": "spare_gone", "pid": p}`` when one died before it was given work). A spawn may name
``"uid"`` and ``"gid"``: the rank drops to them (no supplementary groups) once its log is open and
before anything of the job runs, so a zygote kept as root for its own files never hands root on. A spawn
may name an ``"exit_file"``: the same end is written there too (``wire.write_exit_status``), which
an agent started after the rank ended (the one that spawned it killed meanwhile) reads instead.
"""

from __future__ import annotations

import atexit
import importlib
import io
import json
import os
import runpy
import select
import signal
import sys
import time
from typing import Any

from trainguard.agent.wire import ENV_HOST_STORE, ENV_STARTED_AT, process_start_ticks, write_exit_status

PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch.distributed.tensor.parallel",
    "torch.distributed.pipelining",
    "torch.nn.parallel",
    "torch._dynamo",
    "numpy",
)
# What a rank imports on its way to its first step, the API's torch-side modules included (a
# user's script forked from here needs them as much as the trainer): ~80 ms per rank otherwise.
TRAINER_PRELOAD = ("trainguard.trainer.worker", "trainguard.trainer.train", "trainguard.trainer.checkpoint",
                   "trainguard.checkpoint.tier", "trainguard.checkpoint.snapshot.writer", "trainguard.run.plansync",
                   "trainguard.run.computetime", "trainguard.trainer.faults")
# Rank set-up work that is the same for every rank and every attempt, done once before forking.
TRAINER_WARM = (("trainguard.trainer.data", "stdlib_digest"),)


_agent_gone = False


class DroppingFile(io.RawIOBase):
    """A rank's output file, under the text streams its ``print`` and ``logging`` write to: a
    write the disk refuses (full, an I/O error) is dropped and counted, never raised. A script
    does not catch an OSError from ``print``, so a full log disk would end training, and every
    restart with it. The next write that gets through first says how much was lost."""

    def __init__(self, fd: int) -> None:
        super().__init__()
        self.fd = fd
        self.dropped = 0
        self.why = ""

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self.fd

    @property
    def name(self) -> int:
        return self.fd  # as ``open(fd)``'s file names itself

    def write(self, data: Any) -> int:
        view = memoryview(data)
        try:
            if self.dropped:
                os.write(self.fd, f"[trainguard: {self.dropped} bytes of output dropped: {self.why}]\n".encode())
                self.dropped = 0
            return os.write(self.fd, view)
        except OSError as exc:
            self.dropped += len(view)
            self.why = exc.strerror or str(exc)
            return len(view)


def text_stream(fd: int, errors: str = "strict") -> io.TextIOWrapper:
    """``open(fd, "w", buffering=1)`` as a rank's stdout or stderr, over a ``DroppingFile``."""
    stream = io.TextIOWrapper(io.BufferedWriter(DroppingFile(fd)), errors=errors, line_buffering=True)
    stream.mode = "w"  # type: ignore[misc]  # what ``open`` sets, and code that sniffs streams reads
    return stream


def _say(out: Any, **msg: Any) -> None:
    """One line to the agent. When the agent is gone (killed, restarted) the pipe is broken: the
    zygote goes on reaping its ranks quietly, so they never become zombies of a dead launcher; a
    new agent adopts the ranks by pid (agent/lifecycle/records.py)."""
    global _agent_gone
    if _agent_gone:
        return
    try:
        out.write(json.dumps(msg) + "\n")
        out.flush()
    except (BrokenPipeError, OSError):
        _agent_gone = True


_STORE: Any = None
"""Rank 0's rendezvous store (``_host_rendezvous_store``): it lives as long as the rank."""


def _host_rendezvous_store() -> None:
    """The job's rendezvous store (a TCPStore server on MASTER_PORT), up before rank 0's code runs;
    every rank, rank 0 too, connects to it as a client (TORCHELASTIC_USE_AGENT_STORE, as under
    torchrun, where the agent hosts it). A TCPStore client that comes before its server waits
    ~0.4-0.5 s before it tries again (measured here): with the store made in rank 0's
    init_process_group, a restart whose ranks start together lost that wait to the race."""
    global _STORE
    # torch is in the zygote's preload, not imported by this module: the protocol side stays light.
    from datetime import timedelta

    import torch.distributed as dist

    try:
        _STORE = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["WORLD_SIZE"]),
                               is_master=True, wait_for_workers=False, timeout=timedelta(seconds=300))
    except (KeyError, ValueError, RuntimeError) as exc:
        # Its clients fail to connect, and say so; the rank's own rendezvous would have failed alike.
        print(f"trainguard: could not host the rendezvous store: {exc}", file=sys.stderr, flush=True)


def drop_privileges(uid: int, gid: int) -> None:
    """Become ``uid``/``gid`` with no supplementary groups; leaving root this way clears every
    capability. Raises when the process is still privileged afterwards."""
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
    if os.geteuid() != uid or os.getegid() != gid or (uid != 0 and _can_regain_root()):
        raise PermissionError(f"could not drop to uid {uid} gid {gid}")


def _can_regain_root() -> bool:
    try:
        os.setuid(0)
    except PermissionError:
        return False
    return True


def _child(req: dict[str, Any], started_at: float | None = None) -> None:
    """Runs in the forked child: becomes one rank and never returns. ``started_at``: when a spare
    was given this work (its process started earlier)."""
    code = 0
    try:
        os.setsid()
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.set_wakeup_fd(-1)
        log_fd = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o640)
        null_fd = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null_fd, 0)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.close(log_fd)
        os.close(null_fd)
        sys.stdin = open(0, closefd=False)  # noqa: SIM115 - lives as long as the process
        sys.stdout = text_stream(1)
        sys.stderr = text_stream(2, errors="backslashreplace")  # as the interpreter's own stderr
        if "uid" in req:
            drop_privileges(int(req["uid"]), int(req["gid"]))
        os.environ.clear()
        os.environ.update(req["env"])
        # The job's own PYTHONPATH (a zygote started without the job's environment lacks it).
        for search_dir in reversed(os.environ.get("PYTHONPATH", "").split(os.pathsep)):
            if search_dir and search_dir not in sys.path:
                sys.path.insert(1, search_dir)
        if started_at is not None:
            os.environ[ENV_STARTED_AT] = repr(started_at)
        if os.environ.get(ENV_HOST_STORE):
            _host_rendezvous_store()
        if req.get("cwd"):
            os.chdir(req["cwd"])
        module = req.get("module", "trainguard.trainer.worker")
        if module.startswith("path:"):
            # ``python script.py``: the script's directory leads sys.path, as the interpreter does it.
            script = module[len("path:"):]
            sys.argv = [script, *req.get("args", [])]
            sys.path[0] = os.path.dirname(os.path.abspath(script))
            runpy.run_path(script, run_name="__main__")
            return
        sys.argv = [module, *req.get("args", [])]
        # ``python -m module``: the working directory leads sys.path, as the interpreter does it.
        sys.path[0] = os.getcwd()
        preloaded = sys.modules.get(module)
        entry = getattr(preloaded, "main", None)
        if callable(entry):
            # Already imported before the fork: run its main() rather than executing it twice.
            result = entry()
            code = result if isinstance(result, int) else 0
        else:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - report like an interpreter would, then exit non-zero
        import traceback

        code = 1  # first: a traceback that cannot be written (a full log disk) must not make it 0
        try:
            traceback.print_exc()
        except Exception:  # noqa: BLE001 - the exit code still tells
            pass
    finally:
        try:
            # As the interpreter ends: the script's atexit handlers run (a logger's flush,
            # wandb.finish, trainguard's background checkpoint writer), which os._exit alone skips.
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


class Spares:
    """Ranks forked ahead of need: a restart hands each new rank's work to a process that is
    already there, instead of forking them one after another from the zygote (4-9 ms a fork of
    the warm interpreter here, so the last of 4 ranks reached the rendezvous ~25 ms after the first,
    and every rank waited for it there). As many as the zygote runs ranks, forked only once the
    zygote has had nothing to do for ``delay_s`` (not while a start or restart wants the CPU).

    A spare waits on a pipe of its own for one request line, then becomes that rank (``_child``);
    the zygote's end closed with no request (the zygote gone, or leaving), it exits. Each spare is
    reported (``{"ev": "spare", "pid": p}``) so that the agent spares it when it clears the job's
    cgroup of a previous attempt's leftovers."""

    def __init__(self, delay_s: float = 2.0) -> None:
        self.delay_s = delay_s
        self.waiting: dict[int, int] = {}
        """pid -> the write end of its request pipe, oldest first."""
        self.last_busy = time.monotonic()

    def wanted(self, ranks: int, now: float) -> bool:
        return len(self.waiting) < ranks and now - self.last_busy >= self.delay_s

    def timeout(self, ranks: int, now: float) -> float:
        """How long the zygote's loop may sleep: until a spare is due."""
        if len(self.waiting) >= ranks:
            return 1.0
        return max(0.01, min(1.0, self.last_busy + self.delay_s - now))

    def fork(self, close_in_child: tuple[int, ...]) -> int:
        """A new spare; returns its pid."""
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(write_fd)
            for fd in (*close_in_child, *self.waiting.values()):
                os.close(fd)
            _spare(read_fd)
        os.close(read_fd)
        self.waiting[pid] = write_fd
        return pid

    def hand_out(self, req: dict[str, Any]) -> int | None:
        """The pid of the spare that took ``req``, or None when none is left to take it."""
        self.last_busy = time.monotonic()
        line = json.dumps(req).encode() + b"\n"
        while self.waiting:
            pid = next(iter(self.waiting))
            fd = self.waiting.pop(pid)
            try:
                sent = os.write(fd, line) == len(line)
            except OSError:  # it died meanwhile (its end is reaped with the rest)
                sent = False
            os.close(fd)
            if sent:
                return pid
        return None

    def gone(self, pid: int) -> bool:
        """A spare ended before it was given work (reaped): True when ``pid`` was one."""
        fd = self.waiting.pop(pid, None)
        if fd is None:
            return False
        os.close(fd)
        return True

    def close(self) -> None:
        """No more work: each spare reads the end of its pipe and exits."""
        for fd in self.waiting.values():
            os.close(fd)
        self.waiting.clear()

    def fds(self) -> tuple[int, ...]:
        return tuple(self.waiting.values())


def _spare(read_fd: int) -> None:
    """Runs in a spare: waits for its request, then becomes that rank; never returns."""
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.set_wakeup_fd(-1)
        # Not the zygote's pipes to the agent: the agent tells the zygote's death by their end.
        null_fd = os.open(os.devnull, os.O_RDWR)
        os.dup2(null_fd, 0)
        os.dup2(null_fd, 1)
        os.close(null_fd)
        data = b""
        while not data.endswith(b"\n"):
            chunk = os.read(read_fd, 65536)
            if not chunk:
                os._exit(0)
            data += chunk
        started_at = time.time()
        os.close(read_fd)
        req = json.loads(data)
    except BaseException:  # noqa: BLE001 - a spare that cannot take work only goes away
        os._exit(0)
    _child(req, started_at)


def serve(stdin_fd: int = 0, out: Any = None) -> int:
    out = out or sys.stdout
    t0 = time.perf_counter()
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    for name in TRAINER_PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            _say(out, ev="warning", message=f"could not preload {name}: {exc}")
    for module, func in TRAINER_WARM:
        try:
            getattr(importlib.import_module(module), func)()
        except Exception as exc:  # noqa: BLE001 - a warm-up that fails leaves the work to the ranks
            _say(out, ev="warning", message=f"could not warm {module}.{func}: {exc}")
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    _say(out, ev="ready", pid=os.getpid(), import_s=round(time.perf_counter() - t0, 3))
    buf = b""
    children: dict[int, tuple[str, int | None]] = {}
    """pid -> (its exit file or "", its start time: the file names the very process)."""
    spares = Spares()
    running = True
    while running or children:
        ready, _, _ = select.select([stdin_fd, wake_r] if running else [wake_r], [], [],
                                    spares.timeout(len(children), time.monotonic()) if running else 1.0)
        if not ready and running and spares.wanted(len(children), time.monotonic()):
            # One at a time, each when there was nothing else to do.
            _say(out, ev="spare", pid=spares.fork((wake_r, wake_w)))
        if wake_r in ready:
            os.read(wake_r, 4096)
        # Reap every child that ended (SIGCHLD coalesces).
        while children or spares.waiting:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                children.clear()
                break
            if pid == 0:
                break
            if spares.gone(pid):
                _say(out, ev="spare_gone", pid=pid)
                continue
            exit_file, ticks = children.pop(pid, ("", None))
            sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
            code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + (sig or 0)
            if exit_file:
                write_exit_status(exit_file, pid, ticks, code, sig)
            _say(out, ev="exit", pid=pid, code=code, signal=sig)
        if running and stdin_fd in ready:
            chunk = os.read(stdin_fd, 65536)
            if not chunk:
                running = False  # the agent went away: let the ranks finish, then leave
                spares.close()
                continue
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                try:
                    req = json.loads(line)
                except ValueError:
                    _say(out, ev="error", message="bad request line")
                    continue
                if req.get("op") == "exit":
                    running = False
                    spares.close()
                elif req.get("op") == "spawn":
                    out.flush()
                    taken = spares.hand_out(req)
                    if taken is not None:
                        pid = taken
                    else:
                        pid = os.fork()
                        if pid == 0:
                            for fd in (wake_r, wake_w, *spares.fds()):
                                os.close(fd)
                            _child(req)
                    children[pid] = (str(req.get("exit_file") or ""), process_start_ticks(pid))
                    _say(out, ev="spawned", rank=req.get("rank"), pid=pid)
    return 0


if __name__ == "__main__":
    sys.exit(serve())
