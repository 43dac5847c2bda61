"""``trainguard run -- CMD ...`` with a node agent: submit any command as a job, stream what its
ranks print (each line prefixed with its rank, as torchrun's ``--tee`` logs are), say what the
agent did (restarts, hangs), and exit with the job's exit code.

The job runs the command unchanged in the caller's working directory and environment, with
torchrun's variables set per rank (``agent.lifecycle.ranks.torchrun_env``). The agent restarts the whole
job when a rank dies, up to ``--max-restarts`` restarts without progress, and keeps every rank's
output in ``<state>/jobs/<job>/rank<N>.log``. Ctrl-C stops the job.

An agent that goes away meanwhile (killed, crashed, restarted by systemd) does not take the job
with it: its ranks train on, and an agent started again on the state directory adopts them. So
the command waits for it and follows on from where it was, while any of the job's ranks on this
node still runs and for ``AGENT_GRACE_S`` after.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TextIO

from trainguard.agent.api.client import ApiClientError
from trainguard.agent.wire import process_start_ticks
from trainguard.launch.forward import SignalQueue
from trainguard.launch.forward import name as forwarded_name

FINISHED = {"succeeded", "failed", "stopped"}
# What the agent says about a job that a user running it wants to see as it happens.
NOTABLE = {"job_restart", "rank_exit", "hang_detected", "crash_loop", "job_resumed", "straggler_detected",
           "shard_migration", "batch_sizes_applied", "restore_selected", "job_failed", "rank_excluded",
           "checkpoint_write_failed"}
# The environment a job should not take from the shell that submitted it.
_NOT_INHERITED = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
                  "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID", "NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID",
                  "LISTEN_FDS", "LISTEN_PID", "TRAINGUARD_JOB", "TRAINGUARD_SOCKET", "TRAINGUARD_PLAN",
                  "TRAINGUARD_RESTORE", "TRAINGUARD_ATTEMPT"}


def resolve_command(command: list[str], path: str | None = None) -> list[str]:
    """The command with its program found on the caller's PATH (the agent's PATH differs)."""
    if not command:
        raise ValueError("no command given: trainguard run [OPTIONS] -- CMD [ARGS...]")
    program = command[0]
    if os.sep in program:
        return [os.path.abspath(program), *command[1:]]
    found = shutil.which(program, path=path)
    if found is None:
        raise ValueError(f"{program}: command not found")
    return [found, *command[1:]]


def job_spec(command: list[str], *, nproc: int, nodes: int = 1, job: str | None = None,
             max_restarts: int | None = None, hang_timeout_s: float = 0.0, cwd: str | None = None,
             environ: dict[str, str] | None = None) -> dict[str, Any]:
    env = {k: v for k, v in (os.environ if environ is None else environ).items() if k not in _NOT_INHERITED}
    spec: dict[str, Any] = {
        "nproc": nproc, "command": resolve_command(command, env.get("PATH")), "env": env,
        "cwd": os.path.abspath(cwd or os.getcwd()), "hang_timeout_s": float(hang_timeout_s),
    }
    if nodes != 1:
        spec["nodes"] = nodes
    if job:
        spec["job"] = job
    if max_restarts is not None:
        spec["max_restarts"] = max_restarts
    return spec


def prefixed(rank: int, text: str) -> str:
    return "".join(f"[rank{rank}]:{line}\n" for line in text.splitlines())


class OutputFollower:
    """Writes the new output of every rank of one job, prefixed, as the agent hands it out."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.offsets: dict[int, int] = {}

    def take(self, chunks: list[dict[str, Any]]) -> bool:
        """Write what ``chunks`` (one ``job_output`` answer per rank) hold; True when some rank
        has more than one answer could carry."""
        more = False
        for got in chunks:
            rank = int(got["rank"])
            if got["text"]:
                self.out.write(prefixed(rank, got["text"]))
            self.offsets[rank] = int(got["next"])
            more = more or (got["next"] < got["size"] and got["next"] > got["offset"])
        self.out.flush()
        return more


AGENT_GRACE_S = 60.0
"""How long ``follow`` waits for a lost agent once none of the job's ranks on this node runs: an
agent restarted meanwhile still tells how the job ended (while a rank runs, it waits on)."""


class Terminated(Exception):
    """SIGTERM to ``trainguard run``: a scheduler ending the step (Slurm's ``scancel``, its time
    limit). The ranks are the agent's children, outside the step, so the job is stopped as on Ctrl-C."""


def raise_terminated(signum: int, frame: object) -> None:
    raise Terminated


def _forward(client: Any, job: str, signals: SignalQueue, err: TextIO) -> None:
    """Pass on what a batch system sent ``trainguard run`` (SIGUSR1/2) to the job's ranks."""
    for signum in signals.take():
        try:
            sent = client.signal_job(job, forwarded_name(signum))["ranks"]
            err.write(f"trainguard: {forwarded_name(signum)} forwarded to {sent} rank(s) of job {job}\n")
        except ApiClientError as exc:
            err.write(f"trainguard: could not forward {forwarded_name(signum)} to job {job}: {exc}\n")
        err.flush()


class AgentAway:
    """The job's ranks on this node when the agent went away (pid and start time, so that a pid
    used again by another process is not taken for a rank), to tell how long to wait for it."""

    def __init__(self, info: dict[str, Any], now: float, grace_s: float,
                 start_ticks: Callable[[int], int | None] = process_start_ticks) -> None:
        self.start_ticks = start_ticks
        self.ranks = {int(r["pid"]): t for r in info.get("ranks", [])
                      if r.get("alive") and r.get("pid") and (t := start_ticks(int(r["pid"]))) is not None}
        self.grace_s = grace_s
        self.last_running = now

    def running(self) -> list[int]:
        return [pid for pid, ticks in self.ranks.items() if self.start_ticks(pid) == ticks]

    def give_up(self, now: float) -> bool:
        if self.running():
            self.last_running = now
            return False
        return now - self.last_running >= self.grace_s


def follow(client: Any, job: str, *, out: TextIO = sys.stdout, err: TextIO = sys.stderr, poll_s: float = 0.2,
           idle_poll_s: float = 1.0, agent_grace_s: float = AGENT_GRACE_S,
           clock: Callable[[], float] = time.monotonic) -> int:
    """Stream the job's output and notable events until it ends; return its exit code. Polls every
    ``poll_s`` while the job prints, backing off to ``idle_poll_s`` while it is quiet: each poll is
    one request to the agent (the job, each rank's new output, the events), CPU that a busy
    training node's ranks would otherwise have. Rides out an agent that goes away (``AgentAway``)."""
    follower = OutputFollower(out)
    seen = client.events(since=0, limit=1)["next"]
    info: dict[str, Any] = {}
    wait = poll_s
    away: AgentAway | None = None
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, raise_terminated)
    signals = SignalQueue().install()
    try:
        while True:
            _forward(client, job, signals, err)
            before = dict(follower.offsets)
            try:
                got = client.follow_job(job, seen, follower.offsets)
            except ApiClientError as exc:
                if exc.status != 0:  # the agent answered (e.g. the job is unknown): not a lost agent
                    raise
                if away is None:
                    away = AgentAway(info, clock(), agent_grace_s)
                    err.write(f"trainguard: {exc} -- the job's ranks train on without it; waiting for the agent "
                              "to come back and adopt them (Ctrl-C stops waiting, not the job)\n")
                    err.flush()
                elif away.give_up(clock()):
                    err.write(f"trainguard: no agent came back and job {job}'s ranks on this node have ended; "
                              "`trainguard status` tells how it ended once an agent runs on this state directory\n")
                    return 1
                time.sleep(idle_poll_s)
                continue
            if away is not None:
                err.write("trainguard: the agent is back; following the job again\n")
                away = None
            info = got["job"]
            more = follower.take(got["output"])
            for e in got["events"]:
                if e["kind"] in NOTABLE and not (e["kind"] == "rank_exit" and e["severity"] == "info"):
                    err.write(f"trainguard: {e['kind']}: {e['message']}\n")
            err.flush()
            seen = got["next"]
            if more:
                continue  # a rank printed more than one answer carries: read on at once
            if info.get("state") in FINISHED:
                break  # read after the job's state: its output is complete
            wait = poll_s if follower.offsets != before else min(idle_poll_s, wait * 2)
            time.sleep(wait)
    except (KeyboardInterrupt, Terminated) as exc:
        rc = 143 if isinstance(exc, Terminated) else 130
        if away is not None:
            pids = " ".join(map(str, away.running())) or "none left"
            err.write(f"trainguard: stopped waiting; job {job} was not stopped (no agent to stop it): its ranks on "
                      f"this node (pids {pids}) run on until an agent adopts them (`trainguard stop {job}` then)\n")
            return rc
        why = "terminated (SIGTERM)" if rc == 143 else "interrupted by the user (Ctrl-C)"
        err.write(f"trainguard: stopping job {job}: {why}\n")
        err.flush()
        if previous is not None:
            # a second SIGTERM (Slurm signals every process of the step) must not cut the request short
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        client.stop_job(job, reason=why)
        return rc
    finally:
        signals.restore()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    code = info.get("exit_code")
    state = info.get("state")
    reason = f" ({info['reason']})" if info.get("reason") else ""
    err.write(f"trainguard: job {job} {state} after {info.get('restarts', 0)} restart(s), exit code {code}{reason}\n")
    return int(code) if isinstance(code, int) else 1
