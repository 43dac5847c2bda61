"""The agent's handle on a warm rank launcher (trainer/zygote.py), without importing torch.

The zygote is started once per job and kept across restarts; it forks ranks in milliseconds.
Its children are not the agent's, so their exit statuses come from the zygote's ``exit`` reports
(and their exits are also seen at once through pidfds and the eBPF exit event). A zygote that dies
(killed, OOM) leaves its ranks training, orphans of init: their ends are then seen through /proc
and their statuses come from the eBPF exit event, or count as failures when none came.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import threading
import time
from collections.abc import Callable
from typing import IO, Any

from trainguard.agent.lifecycle.records import AdoptedProcess, RankRecord
from trainguard.agent.wire import exit_status_path, process_start_ticks


class ZygoteError(RuntimeError):
    pass


class ZygoteChild:
    """A rank forked by the zygote; quacks like ``subprocess.Popen`` for the supervisor."""

    def __init__(self, pid: int, args: list[str], log_path: str, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.pid = pid
        self.args = args
        self.log_path = log_path
        self.returncode: int | None = None
        self.start_ticks = process_start_ticks(pid)
        self.orphaned = False
        """Its zygote died: no ``exit`` report will come."""
        self.status_hint: int | None = None
        """The status from the eBPF exit event (Popen's convention): ``exit_seen``."""
        self.status_source = ""
        self.clock = clock
        self._watch: AdoptedProcess | None = None
        self._done = threading.Event()

    def _ended(self, code: int, sig: int | None) -> None:
        self.returncode = -sig if sig else code
        self._done.set()

    def exit_seen(self, status: int | None) -> None:
        """The eBPF exit event's status (Popen's convention): the kernel's word that the process
        ended (its thread group's exit, with the wait status), which ``poll`` gives from now on.
        It comes ~15-25 ms before the zygote's report on a busy node, and a crash is told by it."""
        if status is not None and self.status_hint is None:
            self.status_hint = status

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        if not self.orphaned:
            if self.status_hint is not None:
                self.status_source = "ebpf"
            return self.status_hint
        if self._watch is None:
            # Watched from now on as a rank an agent adopted is: its end through /proc, its status
            # from the eBPF exit event, else a failure (no report will say otherwise).
            record = RankRecord(-1, -1, self.pid, self.start_ticks, self.log_path)
            self._watch = AdoptedProcess(record, lambda: 1, clock=self.clock)
        self._watch.status_hint = self.status_hint
        code = self._watch.poll()
        if code is not None:
            self.status_source = self._watch.status_source
            self._ended(code, None)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Until the zygote reported the end (the process reaped: a stopped job leaves no zombie
        behind), or, an orphan, until it is gone from /proc."""
        deadline = math.inf if timeout is None else self.clock() + timeout
        while True:
            if self.orphaned:
                code = self.poll()
            else:
                code = self.returncode if self._done.is_set() else None
            if code is not None:
                return code
            left = deadline - self.clock()
            if left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            # The zygote's report ends the wait at once; an orphan's end is found by looking.
            self._done.wait(min(left, 0.02 if self.orphaned else 0.5))


class Zygote:
    def __init__(self, argv: list[str], env: dict[str, str], cwd: str, log_path: str, *, start_timeout_s: float = 120.0) -> None:
        self._log = open(log_path, "ab")
        self.proc = subprocess.Popen(
            argv,
            env=env,
            cwd=cwd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            start_new_session=True,
        )
        self._children: dict[int, ZygoteChild] = {}
        self._early_exits: dict[int, tuple[int, int | None]] = {}
        self._replies: list[dict[str, Any]] = []
        self._spares: set[int] = set()
        """Processes the zygote forked ahead of need (``trainer.zygote.Spares``), not yet ranks."""
        self._cond = threading.Condition()
        self._lock = threading.Lock()
        self.import_s: float | None = None
        self._reader = threading.Thread(target=self._read, name="zygote-reader", daemon=True)
        self._reader.start()
        ready = self._next_reply(start_timeout_s)
        if ready.get("ev") != "ready":
            raise ZygoteError(f"warm launcher did not start: {ready}")
        self.import_s = ready.get("import_s")

    def _read(self) -> None:
        out: IO[bytes] | None = self.proc.stdout
        assert out is not None
        for line in out:
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if msg.get("ev") == "exit":
                pid, code, sig = msg["pid"], msg["code"], msg.get("signal")
                with self._cond:
                    child = self._children.get(pid)
                    if child is None:
                        self._early_exits[pid] = (code, sig)
                if child is not None:
                    child._ended(code, sig)
                continue
            if msg.get("ev") == "warning":
                continue
            if msg.get("ev") in ("spare", "spare_gone"):
                with self._cond:
                    if msg["ev"] == "spare":
                        self._spares.add(int(msg["pid"]))
                    else:
                        self._spares.discard(int(msg["pid"]))
                continue
            with self._cond:
                if msg.get("ev") == "spawned":
                    self._spares.discard(int(msg.get("pid", -1)))
                self._replies.append(msg)
                self._cond.notify_all()
        with self._cond:
            self._replies.append({"ev": "gone"})
            self._cond.notify_all()
            # The zygote died: its ranks train on as orphans, watched through /proc from now on.
            for child in self._children.values():
                child.orphaned = True

    def _next_reply(self, timeout: float) -> dict[str, Any]:
        with self._cond:
            if not self._cond.wait_for(lambda: bool(self._replies), timeout):
                raise ZygoteError("warm launcher did not answer in time")
            return self._replies.pop(0)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def own_pids(self) -> set[int]:
        """The zygote and its spares: what clearing the job's cgroup must leave alone."""
        with self._cond:
            return {self.proc.pid, *self._spares}

    def spawn(self, rank: int, env: dict[str, str], log: str, cwd: str, module: str, args: list[str],
              user: tuple[int, int] | None = None) -> ZygoteChild:
        """Fork one rank; ``user``: the (uid, gid) it drops to before the job's code runs (a root
        zygote that kept only CAP_SETUID/CAP_SETGID for this)."""
        req: dict[str, Any] = {"op": "spawn", "rank": rank, "env": env, "log": log, "cwd": cwd, "module": module,
                               "args": args, "exit_file": exit_status_path(log)}
        if user is not None:
            req["uid"], req["gid"] = user
        with self._lock:
            if not self.alive or self.proc.stdin is None:
                raise ZygoteError("warm launcher is not running")
            self.proc.stdin.write(json.dumps(req).encode() + b"\n")
            self.proc.stdin.flush()
            reply = self._next_reply(30.0)
        if reply.get("ev") != "spawned":
            raise ZygoteError(f"warm launcher could not fork rank {rank}: {reply}")
        child = ZygoteChild(int(reply["pid"]), ["-m", module, *args], log)
        with self._cond:
            self._children[child.pid] = child
            early = self._early_exits.pop(child.pid, None)
        if early is not None:
            child._ended(*early)
        return child

    def close(self, timeout: float = 5.0) -> None:
        if self.alive and self.proc.stdin is not None:
            try:
                self.proc.stdin.write(b'{"op": "exit"}\n')
                self.proc.stdin.close()
            except OSError:
                pass
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()

    def __del__(self) -> None:  # pragma: no cover - best effort
        try:
            if os.getpid() and self.alive:
                self.proc.kill()
        except Exception:  # noqa: BLE001
            pass
