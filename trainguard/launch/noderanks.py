"""This node's ranks of one rendezvous round (``multinode``): child processes of ``trainguard
run`` (``--no-agent``), or the local agent's, handed each round as an attempt
(``agent.lifecycle.rdzvjobs``) so the ranks get its telemetry, snapshots and restore.

The agent is reached through an ``ApiClient`` (a daemon found by ``--state-dir``, or one this
process hosts), only through its API.
"""

from __future__ import annotations

import signal
import sys
import threading
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Protocol, TextIO

from trainguard.agent.api.client import ApiClientError
from trainguard.agent.lifecycle.jobs import JobSpec
from trainguard.agent.lifecycle.ranks import RankBlock
from trainguard.launch.resumepoint import Holdings
from trainguard.launch.runcmd import NOTABLE, OutputFollower, job_spec
from trainguard.launch.standalone import LocalRanks

if TYPE_CHECKING:
    from trainguard.launch.rendezvous import Round


@dataclass(frozen=True)
class Outcome:
    """How this node's ranks of a round ended: all succeeded, or ``rank`` failed with ``code``."""

    ok: bool
    rank: int = -1
    code: int = 0


class Ranks(Protocol):
    """This node's ranks, one round at a time."""

    def start(self, rnd: Round, block: RankBlock) -> None: ...

    def poll(self) -> Outcome | None:
        """None while they run; how they ended otherwise."""

    def progressed(self) -> bool | None:
        """Whether this round's ranks trained past the newest step before it (None: not known)."""

    def offer(self, block: RankBlock) -> Holdings:
        """What this node's ranks of ``block`` could resume from here."""

    def signal(self, signum: int) -> int:
        """Pass ``signum`` on to this node's running ranks; how many got it."""

    def stop(self) -> None: ...

    def close(self) -> None:
        """The launcher ends."""


class ChildRanks:
    """``--no-agent``: the ranks are child processes of this one."""

    def __init__(self, command: list[str], spec: JobSpec, base: dict[str, str], *, cwd: str | None = None,
                 out: TextIO = sys.stdout, grace_s: float = 5.0) -> None:
        self.command, self.spec, self.base, self.cwd, self.out, self.grace_s = command, spec, base, cwd, out, grace_s
        self.lock = threading.Lock()
        self.ranks: LocalRanks | None = None

    def start(self, rnd: Round, block: RankBlock) -> None:
        self.ranks = LocalRanks(self.command, self.spec, block, rnd.number + 1, self.base, cwd=self.cwd,
                                out=self.out, lock=self.lock)

    def poll(self) -> Outcome | None:
        assert self.ranks is not None
        failed = self.ranks.failed()
        if failed is not None:
            return Outcome(False, *failed)
        return None if self.ranks.running() else Outcome(True)

    def offer(self, block: RankBlock) -> Holdings:
        return Holdings()  # no snapshots or checkpoints without an agent

    def signal(self, signum: int) -> int:
        return self.ranks.signal(signum) if self.ranks is not None else 0

    def progressed(self) -> bool | None:
        return None  # no telemetry without an agent: every failure counts, as torchrun counts them

    def stop(self) -> None:
        if self.ranks is not None:
            self.ranks.stop(self.grace_s)

    def close(self) -> None:
        self.stop()


# Rank exits and restart requests are the launcher's to tell (it speaks for every node).
_QUIET = {"rank_exit", "job_restart"}


def block_body(block: RankBlock) -> dict[str, Any]:
    body = asdict(block)
    body.pop("restore", None)
    body.pop("rendezvous", None)
    return body


class AgentRanks:
    """``multinode.Ranks`` run by the local agent."""

    def __init__(self, client: Any, command: list[str], job: str, nproc: int, max_restarts: int,
                 environ: dict[str, str], *, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> None:
        self.client, self.job, self.out, self.err = client, job, out, err
        self.spec = job_spec(command, nproc=nproc, job=job, max_restarts=max_restarts, environ=environ)
        self.follower = OutputFollower(out)
        self.seen = int(client.events(since=0, limit=1)["next"])
        self.attempt = 0
        self.step_before = self.step_now = -1
        """The job's newest reported step when this round started, and now (the agent's telemetry)."""
        self.failed: tuple[int, int] | None = None

    def offer(self, block: RankBlock) -> Holdings:
        if not self.attempt:
            # This launcher's first round starts fresh, as torchrun's does: snapshots the agent holds
            # from an earlier run with the same id are not this run's.
            return Holdings()
        got = self.client.job_attempt(self.job, {"offer": block_body(block)})
        checkpoint = got.get("checkpoint")
        return Holdings(tuple(int(s) for s in got["steps"]), int(checkpoint) if checkpoint is not None else None)

    def signal(self, signum: int) -> int:
        sent: int = self.client.signal_job(self.job, signal.Signals(signum).name)["ranks"]
        return sent

    def start(self, rnd: Round, block: RankBlock) -> None:
        self.attempt, self.failed = block.attempt, None
        info = self.client.job_attempt(self.job, {"start": block_body(block), "spec": self.spec})
        self.step_before = self.step_now = int(info.get("progress_step", -1))

    def progressed(self) -> bool | None:
        return self.step_now > self.step_before

    def poll(self) -> Outcome | None:
        got = self.client.follow_job(self.job, self.seen, self.follower.offsets)
        self.follower.take(got["output"])
        self.seen = int(got["next"])
        for e in got["events"]:
            if e.get("job") != self.job:
                continue
            if e["kind"] == "rank_exit" and e.get("severity") == "error" and (self.failed or (0, 1))[1] == 1:
                # Exit 1 is how a rank dies of a peer's death: the rank that exited otherwise is the cause.
                fields = e.get("fields") or {}
                code = 128 + int(fields["signal"]) if fields.get("signal") else int(fields.get("exit_code") or 1)
                self.failed = (int(e["rank"]), code)
            elif e["kind"] in NOTABLE and e["kind"] not in _QUIET:
                self.err.write(f"trainguard: {e['kind']}: {e['message']}\n")
        info = got["job"]
        self.step_now = max(self.step_now, int(info.get("progress_step", -1)))
        state = info.get("state")
        if state == "succeeded":
            return Outcome(True)
        if state in ("restarting", "failed", "stopped") and info.get("attempt") == self.attempt:
            rank, code = self.failed or (-1, 1)
            return Outcome(False, rank, code)
        return None

    def stop(self) -> None:
        try:
            self.client.job_attempt(self.job, {"hold": True})
            got = self.client.follow_job(self.job, self.seen, self.follower.offsets)
            self.follower.take(got["output"])
        except ApiClientError as exc:
            self.err.write(f"trainguard: the agent did not stop this node's ranks: {exc}\n")

    def close(self) -> None:
        """The launcher ends: a job the agent still holds (no restarts left) ends with it."""
        try:
            if self.client.job(self.job).get("state") not in ("succeeded", "failed", "stopped"):
                self.client.stop_job(self.job, reason="trainguard run --nnodes ended")
        except ApiClientError:
            pass
