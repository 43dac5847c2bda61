"""Job control from the command line: `trainguard stop`, `logs`, `checkpoint` and `drain`, each a
thin call of the agent API that `status` and the dashboard use too."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

FINISHED = {"succeeded", "failed", "stopped"}


def add_parsers(sub: Any, add_target: Callable[[argparse.ArgumentParser], None]) -> None:
    """The four job commands on the `trainguard` parser; ``add_target`` adds --state-dir/--agent."""
    s = sub.add_parser("stop", help="stop a job (on every node it spans)",
                       epilog="example: trainguard stop train-3f2a --reason 'bad data'")
    s.add_argument("job", metavar="JOB", help="job id, as `trainguard status` shows it")
    s.add_argument("--reason", metavar="TEXT", default="stopped from the command line", help="recorded in the event")
    add_target(s)

    lg = sub.add_parser("logs", help="what a job's ranks printed",
                        epilog="example: trainguard logs train-3f2a -f --rank 0")
    lg.add_argument("job", metavar="JOB", help="job id")
    lg.add_argument("--rank", type=int, metavar="N", help="only this rank (default: every rank, lines prefixed)")
    lg.add_argument("-f", "--follow", action="store_true", help="keep printing until the job ends")
    add_target(lg)

    c = sub.add_parser("checkpoint", help="ask a job to checkpoint at its next step",
                       epilog="example: trainguard checkpoint train-3f2a")
    c.add_argument("job", metavar="JOB", help="job id")
    add_target(c)

    d = sub.add_parser("drain", help="move a job's ranks off a node at its next restart point",
                       epilog="example: trainguard drain train-3f2a --node node-b")
    d.add_argument("job", metavar="JOB", help="job id")
    d.add_argument("--node", required=True, metavar="NODE", help="the node to move the job off")
    add_target(d)


def _print(result: dict[str, Any], args: argparse.Namespace, line: str) -> int:
    print(json.dumps(result, indent=2) if getattr(args, "json", False) else line)
    return 0


def cmd_stop(client: Any, args: argparse.Namespace) -> int:
    result = client.stop_job(args.job, reason=args.reason)
    return _print(result, args, f"{args.job}: {result.get('state', 'stopping')}")


def cmd_checkpoint(client: Any, args: argparse.Namespace) -> int:
    result = client.checkpoint_now(args.job)
    return _print(result, args, f"{args.job}: checkpoint requested (plan v{result.get('plan_version')}); "
                  "ranks take it at their next step")


def cmd_drain(client: Any, args: argparse.Namespace) -> int:
    result = client.drain(args.job, node=args.node)
    moves = result.get("moves_to")
    return _print(result, args, f"{args.job}: drain of {args.node} {result.get('state', 'recorded')}"
                  + (f"; it may move to {', '.join(moves)}" if moves else ""))


def cmd_logs(client: Any, args: argparse.Namespace, out: TextIO = sys.stdout, poll_s: float = 0.5) -> int:
    """Print each rank's output from its start; with ``--follow`` until the job has ended and
    everything it printed is out."""
    offsets: dict[int, int] = {}
    while True:
        job = client.job(args.job)
        ranks = sorted({int(r["rank"]) for r in job.get("ranks", [])} | set(offsets))
        if args.rank is not None:
            ranks = [args.rank]
        prefix = args.rank is None and len(ranks) > 1
        printed = False
        for rank in ranks:
            while True:
                chunk = client.job_output(args.job, rank, offset=offsets.get(rank, 0))
                text = chunk.get("text", "")
                offsets[rank] = int(chunk.get("next", offsets.get(rank, 0)))
                if not text:
                    break
                printed = True
                for line in text.splitlines(keepends=True):
                    out.write(f"[rank {rank}] {line}" if prefix else line)
                if offsets[rank] >= int(chunk.get("size", 0)):
                    break
        out.flush()
        if not args.follow or (job.get("state") in FINISHED and not printed):
            return 0
        time.sleep(poll_s)
