"""``trainguard run --nnodes N ...`` on each node: the round loop that keeps every node's ranks
in one attempt, as torchrun's elastic agent does with its c10d rendezvous.

Each round (``rendezvous.Rendezvous.join``) gives this node its share of the ranks; they start
with torchrun's environment (TORCHELASTIC_RESTART_COUNT: the failures before the round,
cluster-wide). While they run the node polls them and the round: a rank failing here ends the
round for every node, a round another node ended stops the ranks here, a peer whose beat stopped
ends it too. Then all nodes meet again in the next round, fewer of them when one was lost and
``--nnodes MIN:MAX`` allows it. ``--max-restarts`` bounds the failures over the whole cluster;
where the ranks' progress is known (under an agent) only those in a row without progress count,
the crash-loop guard of one node.

The ranks run as ``Ranks``: child processes of this one (``--no-agent``) or the local agent's
(``noderanks``), which hands its snapshots to the restarted ranks.
"""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any, TextIO

from trainguard.agent.cluster.netif import interface_for
from trainguard.agent.lifecycle.jobs import JobSpec
from trainguard.agent.lifecycle.launcher import RankBlock
from trainguard.noderanks import AgentRanks, ChildRanks, Ranks
from trainguard.rendezvous import RdzvConfig, Rendezvous, RendezvousError, Round, Verdict
from trainguard.runcmd import resolve_command
from trainguard.torchrun_args import Launch


def round_block(rnd: Round, nproc: int, run_id: str, max_restarts: int, addr: str) -> RankBlock:
    """This node's ranks of ``rnd`` as the launcher takes them; the restart count and run id are
    torchrun's (failures, not rounds), so they override what the launcher derives."""
    env = {"TORCHELASTIC_RESTART_COUNT": str(rnd.restart_count), "TORCHELASTIC_RUN_ID": run_id,
           "TORCHELASTIC_MAX_RESTARTS": str(max_restarts)}
    return RankBlock(rnd.rank_offset, nproc, rnd.world_size, rnd.master_addr, rnd.master_port, rnd.group_rank,
                     env, rnd.number + 1, socket_ifname=interface_for(addr))


class Driver:
    """The round loop of one node (see the module doc); ``run`` returns the exit status."""

    def __init__(self, rdzv: Rendezvous, ranks: Ranks, *, nproc: int, run_id: str, max_restarts: int,
                 err: TextIO = sys.stderr, clock: Callable[[], float] = time.monotonic) -> None:
        self.rdzv, self.ranks, self.nproc, self.run_id = rdzv, ranks, nproc, run_id
        self.max_restarts, self.err, self.clock = max_restarts, err, clock

    def say(self, text: str) -> None:
        self.err.write(f"trainguard: {text}\n")
        self.err.flush()

    def run(self) -> int:
        try:
            while True:
                rnd = self.rdzv.join()
                self.say(f"round {rnd.number}: node {rnd.group_rank} of {rnd.nodes}, ranks {rnd.rank_offset}-"
                         f"{rnd.rank_offset + self.nproc - 1} of {rnd.world_size}, master "
                         f"{rnd.master_addr}:{rnd.master_port}, restart {rnd.restart_count}")
                verdict = self._round(rnd)
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
        except KeyboardInterrupt:
            self.ranks.stop()
            return 130
        except RuntimeError as exc:  # the store went away: c10d's errors are RuntimeErrors
            self.ranks.stop()
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            self.say(f"rendezvous store {self.rdzv.cfg.host}:{self.rdzv.cfg.port} lost ({first}); stopped this "
                     "node's ranks")
            return 1
        finally:
            self.ranks.close()

    def _round(self, rnd: Round) -> Verdict | None:
        """Run one round; None when every node's ranks finished, else why the round ended."""
        block = round_block(rnd, self.nproc, self.run_id, self.max_restarts, self.rdzv.addr)
        step = self.rdzv.agree_step(rnd, self.ranks.offer(block))
        if step is not None:
            self.say(f"round {rnd.number}: every node's ranks resume from their snapshots of step {step}")
        self.ranks.start(rnd, replace(block, snapshot_step=step))
        next_beat = 0.0
        try:
            while True:
                outcome = self.ranks.poll()
                if outcome is not None and not outcome.ok:
                    host = rnd.members[rnd.group_rank]["host"]
                    return self.rdzv.end(rnd.number, f"rank {outcome.rank} on {host} exited with {outcome.code}",
                                         code=outcome.code, progressed=self.ranks.progressed())
                if outcome is not None:
                    if self.rdzv.finish(rnd):
                        return None
                    return self.rdzv.verdict(rnd.number)
                if self.rdzv.ended(rnd.number):
                    return self.rdzv.verdict(rnd.number)
                if self.clock() >= next_beat:
                    next_beat = self.clock() + self.rdzv.cfg.keepalive_s
                    lost = self.rdzv.beat(rnd)
                    if lost:
                        names = ", ".join(str(rnd.members[g]["host"]) for g in lost)
                        return self.rdzv.end(rnd.number, f"node(s) {names} lost (no keep-alive)",
                                             progressed=self.ranks.progressed())
                time.sleep(self.rdzv.cfg.poll_s)
        finally:
            self.ranks.stop()


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
    signal.signal(signal.SIGTERM, _interrupt)
    return Driver(rdzv, ranks, nproc=launch.nproc, run_id=launch.job, max_restarts=max_restarts, err=err).run()


def _interrupt(_signum: int, _frame: object) -> None:
    raise KeyboardInterrupt
