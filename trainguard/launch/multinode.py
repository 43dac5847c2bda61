"""``trainguard run --nnodes N ...`` on each node: the round loop that keeps every node's ranks
in one attempt, as torchrun's elastic agent does with its c10d rendezvous.

Each round (``rendezvous.Rendezvous.join``) gives this node its share of the ranks; they start
with torchrun's environment (TORCHELASTIC_RESTART_COUNT: the failures before the round,
cluster-wide). While they run the node polls them, and a watcher wakes it the moment another
node ends the round: a rank failing here ends the round for every node, a round another node
ended stops the ranks here, a peer whose beat stopped ends it too. Then all nodes meet again in the next round, fewer of them when one was lost and
``--nnodes MIN:MAX`` allows it. ``--max-restarts`` bounds the failures over the whole cluster;
where the ranks' progress is known (under an agent) only those in a row without progress count,
the crash-loop guard of one node.

The ranks run as ``Ranks``: child processes of this one (``--no-agent``) or the local agent's
(``noderanks``), which hands its snapshots to the restarted ranks.

Where ``TRAINGUARD_RDZV_PHASES`` names a file, each restart appends one JSON line with the
wall-clock times of its phases (``RestartPhases``): what the recovery bench reads to say where a
multi-node restart spends its time.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any, TextIO

from trainguard.agent.cluster.netif import interface_for
from trainguard.agent.lifecycle.jobs import JobSpec
from trainguard.agent.lifecycle.ranks import RankBlock
from trainguard.launch.forward import SignalQueue
from trainguard.launch.forward import name as forwarded_name
from trainguard.launch.noderanks import AgentRanks, ChildRanks, Ranks
from trainguard.launch.rendezvous import RdzvConfig, Rendezvous, RendezvousError, Round, Verdict
from trainguard.launch.runcmd import Terminated, raise_terminated, resolve_command
from trainguard.launch.torchrun_args import Launch


def round_block(rnd: Round, nproc: int, run_id: str, max_restarts: int, addr: str) -> RankBlock:
    """This node's ranks of ``rnd`` as the launcher takes them; the restart count and run id are
    torchrun's (failures, not rounds), so they override what the launcher derives. The ranks
    meet in the store the first node's launcher serves (``rendezvous.RankStore``)."""
    env = {"TORCHELASTIC_RESTART_COUNT": str(rnd.restart_count), "TORCHELASTIC_RUN_ID": run_id,
           "TORCHELASTIC_MAX_RESTARTS": str(max_restarts), "TORCHELASTIC_USE_AGENT_STORE": "True"}
    return RankBlock(rnd.rank_offset, nproc, rnd.world_size, rnd.master_addr, rnd.master_port, rnd.group_rank,
                     env, rnd.number + 1, socket_ifname=interface_for(addr))


PHASES_ENV = "TRAINGUARD_RDZV_PHASES"


@dataclass
class RestartPhases:
    """Wall-clock times (``time.time()``) of one restart on this node, from the moment it saw the
    round end to the moment its ranks of the next round were handed over; 0.0 where not reached."""

    node: str
    round: int
    """The round that ended."""
    seen: float = 0.0
    """This node saw the round end: a rank of its own failed, or another node ended it."""
    ended: float = 0.0
    """The verdict was read (this node's end, or the winner's)."""
    stopped: float = 0.0
    """This node's ranks of the round were stopped."""
    joined: float = 0.0
    """The next round closed with this node in it."""
    agreed: float = 0.0
    """Every node agreed on the snapshot step."""
    started: float = 0.0
    """The next round's ranks were handed to the agent (or forked)."""
    cause: str = ""


class Driver:
    """The round loop of one node (see the module doc); ``run`` returns the exit status."""

    def __init__(self, rdzv: Rendezvous, ranks: Ranks, *, nproc: int, run_id: str, max_restarts: int,
                 err: TextIO = sys.stderr, clock: Callable[[], float] = time.monotonic) -> None:
        self.rdzv, self.ranks, self.nproc, self.run_id = rdzv, ranks, nproc, run_id
        self.max_restarts, self.err, self.clock = max_restarts, err, clock
        self.wake = threading.Event()
        """Set by the round's watcher when another node ends it, or by a signal to pass on to the
        ranks: the loop looks at once."""
        self.signals = SignalQueue(self.wake.set)
        self.phases_path = os.environ.get(PHASES_ENV, "")
        self.phases: RestartPhases | None = None

    def say(self, text: str) -> None:
        self.err.write(f"trainguard: {text}\n")
        self.err.flush()

    def run(self) -> int:
        self.signals.install()
        try:
            while True:
                rnd = self.rdzv.join()
                self._mark("joined")
                self.say(f"round {rnd.number}: node {rnd.group_rank} of {rnd.nodes}, ranks {rnd.rank_offset}-"
                         f"{rnd.rank_offset + self.nproc - 1} of {rnd.world_size}, master "
                         f"{rnd.master_addr}:{rnd.master_port}, restart {rnd.restart_count}")
                verdict = self._round(rnd)
                self._mark("stopped")
                if verdict is None:
                    return 0
                if verdict.failure and verdict.streak > self.max_restarts:
                    if verdict.streak == verdict.failures:
                        self.say(f"{verdict.cause}; no restarts left (--max-restarts {self.max_restarts}, counted "
                                 "over every node)")
                    else:
                        self.say(f"{verdict.cause}; crash loop: {verdict.streak - 1} restarts without progress "
                                 f"(--max-restarts {self.max_restarts}), giving up")
                    return verdict.code or 1
                what = (f"restart {verdict.failures}, {verdict.streak} of {self.max_restarts} without progress"
                        if verdict.failure else "not a failure")
                self.say(f"{verdict.cause}; every node restarts its ranks ({what})")
        except RendezvousError as exc:
            self.ranks.stop()
            self.say(str(exc))
            return 1
        except (KeyboardInterrupt, Terminated) as exc:
            self.ranks.stop()
            return 143 if isinstance(exc, Terminated) else 130  # as on one node
        except RuntimeError as exc:  # the store went away: c10d's errors are RuntimeErrors
            self.ranks.stop()
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            self.say(f"rendezvous store {self.rdzv.cfg.host}:{self.rdzv.cfg.port} lost ({first}); stopped this "
                     "node's ranks")
            return 1
        finally:
            self.signals.restore()
            self.ranks.close()

    def _round(self, rnd: Round) -> Verdict | None:
        """Run one round; None when every node's ranks finished, else why the round ended."""
        block = round_block(rnd, self.nproc, self.run_id, self.max_restarts, self.rdzv.addr)
        agreed = self.rdzv.agree(rnd, self.ranks.offer(block))
        self._mark("agreed")
        if agreed.snapshot_step is not None:
            self.say(f"round {rnd.number}: every node's ranks resume from their snapshots of step "
                     f"{agreed.snapshot_step}")
        elif agreed.checkpoint_step is not None:
            holders = ", ".join(str(g) for g in agreed.holders)
            self.say(f"round {rnd.number}: every node's ranks resume from the checkpoint of step "
                     f"{agreed.checkpoint_step}, which node(s) {holders} hold and send to the others")
        self.wake.clear()
        release = self.rdzv.watch(rnd, self.wake.set)
        try:
            self.ranks.start(rnd, replace(block, snapshot_step=agreed.snapshot_step,
                                          restore_step=agreed.checkpoint_step,
                                          restore_here=rnd.group_rank in agreed.holders))
            self._mark("started")
            self._flush_phases()
            verdict = self._watch(rnd)
            if verdict is not None and self.phases is not None:
                self.phases.ended, self.phases.cause = time.time(), verdict.cause
            return verdict
        finally:
            release()
            self.ranks.stop()

    def _watch(self, rnd: Round) -> Verdict | None:
        next_beat = 0.0
        host = rnd.members[rnd.group_rank]["host"]
        while True:
            outcome = self.ranks.poll()
            if outcome is not None and not outcome.ok:
                self._seen(rnd)
                return self.rdzv.end(rnd.number, f"rank {outcome.rank} on {host} exited with {outcome.code}",
                                     code=outcome.code, progressed=self.ranks.progressed())
            if outcome is not None:
                if self.rdzv.finish(rnd):
                    return None
                self._seen(rnd)
                return self.rdzv.verdict(rnd.number)
            if self.signals.pending:
                self._forward()
                if not self.rdzv.ended(rnd.number):
                    self.wake.clear()  # the round goes on: the store says so on the next look too
            if self.wake.is_set() or self.rdzv.ended(rnd.number):
                self._seen(rnd)
                return self.rdzv.verdict(rnd.number)
            if self.clock() >= next_beat:
                next_beat = self.clock() + self.rdzv.cfg.keepalive_s
                lost = self.rdzv.beat(rnd)
                if lost:
                    self._seen(rnd)
                    names = ", ".join(str(rnd.members[g]["host"]) for g in lost)
                    return self.rdzv.end(rnd.number, f"node(s) {names} lost (no keep-alive)",
                                         progressed=self.ranks.progressed())
            self.wake.wait(self.rdzv.cfg.poll_s)

    def _forward(self) -> None:
        for signum in self.signals.take():
            try:
                sent = self.ranks.signal(signum)
            except Exception as exc:  # noqa: BLE001 - an agent that cannot be reached says so, training goes on
                self.say(f"could not forward {forwarded_name(signum)} to this node's ranks: {exc}")
                continue
            self.say(f"{forwarded_name(signum)} forwarded to {sent} rank(s) of this node")

    # --- restart phases (TRAINGUARD_RDZV_PHASES) --------------------------------------------------
    def _seen(self, rnd: Round) -> None:
        if self.phases_path:
            self.phases = RestartPhases(str(rnd.members[rnd.group_rank]["host"]), rnd.number, seen=time.time())

    def _mark(self, phase: str) -> None:
        if self.phases is not None:
            setattr(self.phases, phase, time.time())

    def _flush_phases(self) -> None:
        if self.phases is None:
            return
        try:
            with open(self.phases_path, "a", encoding="utf-8") as fh:
                fh.write(json.dumps(asdict(self.phases)) + "\n")
        except OSError as exc:
            self.say(f"cannot write the restart phases to {self.phases_path}: {exc.strerror}")
        self.phases = None


def run_nodes(launch: Launch, environ: dict[str, str], client: Any | None, *, out: TextIO = sys.stdout,
              err: TextIO = sys.stderr) -> int:
    """``trainguard run`` on one of several nodes: meet the others and run this node's ranks,
    under the local agent's ``client`` or, with None, as child processes."""
    assert launch.rdzv is not None and launch.job is not None
    r = launch.rdzv
    max_restarts = 3 if launch.max_restarts is None else launch.max_restarts
    try:
        cfg = RdzvConfig(r.host, r.port, launch.job, r.min_nodes, r.max_nodes, launch.nproc, r.node_rank,
                         **r.conf)  # type: ignore[arg-type]
        rdzv = Rendezvous(cfg)
    except (ValueError, RendezvousError) as exc:
        err.write(f"trainguard: {exc}\n")
        return 1
    command = resolve_command(launch.command, environ.get("PATH"))
    spec = JobSpec(launch.job, launch.nproc, command=command, max_restarts=max_restarts)
    base = dict(environ)
    if launch.nproc > 1:
        base.setdefault("OMP_NUM_THREADS", "1")
    ranks: Ranks
    if client is None:
        ranks = ChildRanks(command, spec, base, out=out)
    else:
        ranks = AgentRanks(client, command, launch.job, launch.nproc, max_restarts, environ, out=out, err=err)
    # A batch system ends a step with SIGTERM: this node's ranks stop with it, as on Ctrl-C.
    signal.signal(signal.SIGTERM, raise_terminated)
    return Driver(rdzv, ranks, nproc=launch.nproc, run_id=launch.job, max_restarts=max_restarts, err=err).run()
