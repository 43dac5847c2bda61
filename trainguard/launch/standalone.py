"""``trainguard run --no-agent ...``: the same contract with no agent, like
``torchrun --max-restarts``.

Starts ``nproc`` copies of the command on this machine with torchrun's environment (a fresh
rendezvous port per attempt), streams their output prefixed with the rank, and when a rank
fails stops the others and starts all of them again, at most ``max_restarts`` times; returns
0 when every rank finished, else the failing rank's exit status (128 + N for signal N). No
telemetry, checkpoints or hang verdicts: those need the agent.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from typing import IO, TextIO

from trainguard.agent.lifecycle.jobs import JobSpec
from trainguard.agent.lifecycle.launcher import free_port
from trainguard.agent.lifecycle.ranks import SOCKET_IFNAME_VARS, RankBlock, torchrun_env
from trainguard.launch.forward import SignalQueue
from trainguard.launch.forward import name as forwarded_name
from trainguard.launch.runcmd import Terminated, prefixed, raise_terminated


def _pump(rank: int, stream: IO[bytes], out: TextIO, lock: threading.Lock) -> None:
    for raw in iter(stream.readline, b""):
        text = raw.decode("utf-8", errors="replace")
        with lock:
            out.write(prefixed(rank, text))
            out.flush()
    stream.close()


def _status(code: int) -> int:
    return 128 - code if code < 0 else code


def _stop(procs: list[subprocess.Popen[bytes]], grace_s: float) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()


class LocalRanks:
    """One attempt's ranks of this node as child processes of this one, their output prefixed
    with the rank on ``out``: ranks ``block.rank_offset`` .. ``+ block.nproc - 1`` of
    ``block.world_size``, with torchrun's environment for ``attempt``."""

    def __init__(self, command: list[str], spec: JobSpec, block: RankBlock, attempt: int, base: dict[str, str], *,
                 cwd: str | None = None, out: TextIO = sys.stdout, lock: threading.Lock | None = None) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        self.pumps: list[threading.Thread] = []
        self.offset = block.rank_offset
        lock = lock or threading.Lock()
        for local in range(block.nproc):
            rank = block.rank_offset + local
            env = dict(base)
            env.update({"RANK": str(rank), "LOCAL_RANK": str(local), "WORLD_SIZE": str(block.world_size),
                        "LOCAL_WORLD_SIZE": str(block.nproc), "GROUP_RANK": str(block.group_rank),
                        "MASTER_ADDR": block.master_addr, "MASTER_PORT": str(block.master_port)})
            env.update(torchrun_env(spec, block, attempt, rank))
            env.update(block.env)
            if block.socket_ifname:
                for key in SOCKET_IFNAME_VARS:
                    env.setdefault(key, block.socket_ifname)
            proc = subprocess.Popen(command, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            assert proc.stdout is not None
            t = threading.Thread(target=_pump, args=(rank, proc.stdout, out, lock), daemon=True)
            t.start()
            self.procs.append(proc)
            self.pumps.append(t)

    def failed(self) -> tuple[int, int] | None:
        """(global rank, exit status) of a rank that exited non-zero, if any."""
        for local, p in enumerate(self.procs):
            code = p.poll()
            if code not in (None, 0):
                return self.offset + local, _status(code)
        return None

    def running(self) -> bool:
        return any(p.poll() is None for p in self.procs)

    def signal(self, signum: int) -> int:
        """Send ``signum`` to each running rank's process group; how many got it."""
        sent = 0
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signum)
                    sent += 1
                except ProcessLookupError:
                    pass
        return sent

    def stop(self, grace_s: float) -> None:
        _stop(self.procs, grace_s)
        for t in self.pumps:
            t.join(timeout=2)


def run_standalone(command: list[str], nproc: int, *, max_restarts: int = 3, job: str | None = None,
                   cwd: str | None = None, environ: dict[str, str] | None = None, out: TextIO = sys.stdout,
                   err: TextIO = sys.stderr, grace_s: float = 5.0) -> int:
    spec = JobSpec(job or f"standalone-{uuid.uuid4().hex[:8]}", nproc, command=list(command),
                   max_restarts=max_restarts)
    base = dict(os.environ if environ is None else environ)
    if nproc > 1:
        base.setdefault("OMP_NUM_THREADS", "1")
    lock = threading.Lock()
    signals = SignalQueue().install()
    # A batch system ends a step with SIGTERM: the ranks (in sessions of their own) stop with it.
    previous = signal.signal(signal.SIGTERM, raise_terminated) if threading.current_thread() is threading.main_thread() \
        else None
    try:
        return _attempts(command, nproc, spec, base, signals, max_restarts, cwd, out, err, grace_s, lock)
    finally:
        signals.restore()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _attempts(command: list[str], nproc: int, spec: JobSpec, base: dict[str, str], signals: SignalQueue,
              max_restarts: int, cwd: str | None, out: TextIO, err: TextIO, grace_s: float,
              lock: threading.Lock) -> int:
    attempt = 0
    while True:
        attempt += 1
        block = RankBlock(0, nproc, nproc, "127.0.0.1", free_port())
        ranks = LocalRanks(command, spec, block, attempt, base, cwd=cwd, out=out, lock=lock)
        failed: tuple[int, int] | None = None
        try:
            while failed is None and ranks.running():
                for signum in signals.take():
                    sent = ranks.signal(signum)
                    err.write(f"trainguard: {forwarded_name(signum)} forwarded to {sent} rank(s)\n")
                failed = ranks.failed()
                time.sleep(0.05)
            if failed is None:
                failed = ranks.failed()
        except (KeyboardInterrupt, Terminated) as exc:
            ranks.stop(grace_s)
            return 143 if isinstance(exc, Terminated) else 130
        ranks.stop(grace_s)
        if failed is None:
            return 0
        rank, code = failed
        if attempt > max_restarts:
            err.write(f"trainguard: rank {rank} exited with {code}; no restarts left (--max-restarts {max_restarts})\n")
            return code
        err.write(f"trainguard: rank {rank} exited with {code}; restarting all {nproc} ranks "
                  f"(restart {attempt} of {max_restarts})\n")
        err.flush()
