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
from trainguard.agent.lifecycle.launcher import RankBlock, free_port, torchrun_env
from trainguard.runcmd import prefixed


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


def run_standalone(command: list[str], nproc: int, *, max_restarts: int = 3, job: str | None = None,
                   cwd: str | None = None, environ: dict[str, str] | None = None, out: TextIO = sys.stdout,
                   err: TextIO = sys.stderr, grace_s: float = 5.0) -> int:
    spec = JobSpec(job or f"standalone-{uuid.uuid4().hex[:8]}", nproc, command=list(command),
                   max_restarts=max_restarts)
    base = dict(os.environ if environ is None else environ)
    if nproc > 1:
        base.setdefault("OMP_NUM_THREADS", "1")
    lock = threading.Lock()
    attempt = 0
    while True:
        attempt += 1
        block = RankBlock(0, nproc, nproc, "127.0.0.1", free_port())
        procs: list[subprocess.Popen[bytes]] = []
        pumps: list[threading.Thread] = []
        for rank in range(nproc):
            env = dict(base)
            env.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
                        "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0", "MASTER_ADDR": block.master_addr,
                        "MASTER_PORT": str(block.master_port)})
            env.update(torchrun_env(spec, block, attempt, rank))
            proc = subprocess.Popen(command, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            assert proc.stdout is not None
            t = threading.Thread(target=_pump, args=(rank, proc.stdout, out, lock), daemon=True)
            t.start()
            procs.append(proc)
            pumps.append(t)
        failed: tuple[int, int] | None = None
        try:
            while failed is None and any(p.poll() is None for p in procs):
                for rank, p in enumerate(procs):
                    code = p.poll()
                    if code not in (None, 0):
                        failed = (rank, _status(code))
                        break
                time.sleep(0.05)
            if failed is None:
                failed = next(((r, _status(p.returncode)) for r, p in enumerate(procs) if p.returncode), None)
        except KeyboardInterrupt:
            _stop(procs, grace_s)
            return 130
        _stop(procs, grace_s)
        for t in pumps:
            t.join(timeout=2)
        if failed is None:
            return 0
        rank, code = failed
        if attempt > max_restarts:
            err.write(f"trainguard: rank {rank} exited with {code}; no restarts left (--max-restarts {max_restarts})\n")
            return code
        err.write(f"trainguard: rank {rank} exited with {code}; restarting all {nproc} ranks "
                  f"(restart {attempt} of {max_restarts})\n")
        err.flush()
