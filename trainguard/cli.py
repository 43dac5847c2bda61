"""`trainguard` command line. Imports nothing heavy at module level:
the agent never loads torch, and `trainguard status` must answer in a blink."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from trainguard import jobcmds
from trainguard.agent.api.client import ApiClientError
from trainguard.agent.configerror import ConfigError
from trainguard.launch import torchrun_args

EXIT_USAGE = 2


def _add_target(p: argparse.ArgumentParser) -> None:
    p.add_argument("--state-dir", metavar="DIR", help="talk to the agent whose files are under DIR")
    p.add_argument("--agent", metavar="HOST:PORT", help="talk to a remote agent over TCP")
    p.add_argument("--token-file", metavar="FILE", help="bearer token file for --agent")
    _add_tls(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")


def _add_tls(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tls-ca", metavar="PEM", help="CA bundle the remote agent's certificate must chain to (HTTPS)")
    p.add_argument("--tls-cert", metavar="PEM", help="client certificate for an agent that requires one (mutual TLS)")
    p.add_argument("--tls-key", metavar="PEM", help="private key of --tls-cert")


_EXAMPLES = argparse.RawDescriptionHelpFormatter


def _examples(*lines: str) -> str:
    return "examples:\n" + "\n".join(f"  {line}" for line in lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trainguard", description="Keeps distributed PyTorch training healthy.")
    sub = parser.add_subparsers(dest="command", required=True)

    a = sub.add_parser("agent", help="run the node agent daemon", formatter_class=_EXAMPLES, epilog=_examples(
        "trainguard agent                                  # /etc/trainguard/agent.toml, /var/lib, /run",
        "trainguard agent --state-dir /tmp/tg --metrics-addr 127.0.0.1:0",
        "trainguard agent --check-config /etc/trainguard/agent.toml"))
    a.add_argument("--config", metavar="FILE", help="TOML config (default /etc/trainguard/agent.toml if present)")
    a.add_argument("--state-dir", metavar="DIR", help="put every file and socket of this agent under DIR")
    a.add_argument("--metrics-addr", metavar="HOST:PORT", help="Prometheus /metrics address (port 0: any)")
    a.add_argument("--check-config", metavar="FILE", help="validate FILE and exit (0 ok, 2 with the bad key)")
    a.add_argument("--print-bpf", action="store_true", help="print the generated eBPF programs and exit")

    t = sub.add_parser("train", help="run the embedded trainer (through the local agent, or --standalone)",
                       formatter_class=_EXAMPLES, epilog=_examples(
                           "trainguard train --nproc 4 --dp 2 --tp 2 --steps 200",
                           "trainguard train --nproc 2 --fault kill:rank=1,step=40 --fault slow:rank=0,factor=2",
                           "trainguard train --nproc 2 --standalone --json     # no agent; a JSON line per step"))
    t.add_argument("--nproc", type=int, required=True, metavar="N", help="ranks on this node")
    t.add_argument("--dp", type=int, metavar="N", help="data-parallel degree (default: nproc / (tp * pp))")
    t.add_argument("--tp", type=int, default=1, metavar="N", help="tensor-parallel degree (default 1)")
    t.add_argument("--pp", type=int, default=1, metavar="N", help="pipeline-parallel degree (default 1)")
    t.add_argument("--steps", type=int, default=100, metavar="N", help="optimizer steps to train (default 100)")
    t.add_argument("--standalone", action="store_true", help="run without an agent")
    t.add_argument("--state-dir", metavar="DIR", help="the agent whose files are under DIR")
    t.add_argument("--fault", action="append", default=[], metavar="SPEC", help="e.g. kill:rank=1,step=40")
    t.add_argument("--json", action="store_true", help="one JSON object per step on stdout")
    t.add_argument("--job", metavar="ID", help="job id (default: generated)")
    t.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="trainer config override, e.g. model.layers=4")
    t.add_argument("--detach", action="store_true", help="submit to the agent and return at once")
    t.add_argument("--nodes", type=int, default=1, metavar="N",
                   help="spread the ranks over this many nodes of the cluster (the leader places them; implies --detach)")
    t.add_argument("--agent", metavar="HOST:PORT", help="submit to a remote agent over TCP")
    t.add_argument("--token-file", metavar="FILE", help="bearer token file for --agent")
    _add_tls(t)

    r = sub.add_parser("run", help="run any training command as a job (torchrun's flags and environment, restarts)",
                       formatter_class=argparse.RawDescriptionHelpFormatter, epilog=torchrun_args.EPILOG,
                       description="Run SCRIPT (as torchrun does) or -- CMD on N local ranks with torchrun's environment\n"
                       "(RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT, TORCHELASTIC_RESTART_COUNT, ...) as a job\n"
                       "of the node agent: a rank that dies restarts the whole job; output is prefixed per rank;\n"
                       "the exit code is the job's.")
    torchrun_args.add_arguments(r)
    r.add_argument("--nodes", type=int, default=1, metavar="N",
                   help="spread over this many nodes of the cluster (the leader places them; implies --detach)")
    r.add_argument("--job", metavar="ID", help="job id (default: --rdzv-id, else generated)")
    r.add_argument("--max-restarts", "--max_restarts", dest="max_restarts", metavar="N",
                   help="restarts without progress before the job fails (default: the agent's recovery.max_restarts; "
                   "3 without an agent; PET_MAX_RESTARTS)")
    r.add_argument("--hang-timeout", type=float, default=0.0, metavar="S",
                   help="declare the job hung when none of its ranks used the CPU for S seconds (default: never)")
    r.add_argument("--detach", action="store_true", help="submit and print the job id")
    r.add_argument("--no-agent", action="store_true", help="no agent: run and restart the ranks from this process")
    r.add_argument("--state-dir", metavar="DIR", help="the agent whose files are under DIR (default: $TRAINGUARD_STATE_DIR)")
    r.add_argument("--metrics-addr", metavar="HOST:PORT",
                   help="/metrics of the agent this command hosts where no node agent runs (default: off)")
    r.add_argument("--agent", metavar="HOST:PORT", help="a remote agent over TCP")
    r.add_argument("--token-file", metavar="FILE", help="bearer token file for --agent")
    _add_tls(r)
    r.add_argument("cmd", nargs=argparse.REMAINDER, metavar="SCRIPT [ARGS...] | -- CMD [ARGS...]",
                   help="a python script (or module with -m, program with --no-python) and its arguments, as "
                   "torchrun takes them; or any command after --")

    for name, help_text, examples in (
            ("status", "agent, jobs and ranks", ("trainguard status", "trainguard status --json --state-dir /tmp/tg")),
            ("events", "the event log", ("trainguard events --kind restore_selected", "trainguard events -f")),
            ("checkpoints", "checkpoints per tier", ("trainguard checkpoints --job my-job",))):
        p = sub.add_parser(name, help=help_text, formatter_class=_EXAMPLES, epilog=_examples(*examples))
        _add_target(p)
        if name == "events":
            p.add_argument("--since", type=int, default=0, metavar="SEQ", help="only events after this sequence number")
            p.add_argument("--limit", type=int, default=100, metavar="N", help="at most N events (default 100)")
            p.add_argument("--kind", metavar="KIND", help="only events of this kind, e.g. rank_exit")
            p.add_argument("--follow", "-f", action="store_true", help="keep printing new events")
        if name == "checkpoints":
            p.add_argument("--job", metavar="ID", help="only this job's checkpoints")

    jobcmds.add_parsers(sub, _add_target)

    top = sub.add_parser("top", help="live terminal dashboard", formatter_class=_EXAMPLES,
                         epilog=_examples("trainguard top", "trainguard top --agent node2:7443 --token-file ~/.tg-token"))
    _add_target(top)

    d = sub.add_parser("demo", help="agent + a multi-rank job with a fault and a straggler, healed",
                       formatter_class=_EXAMPLES, epilog=_examples("trainguard demo", "trainguard demo --tui --quick"))
    d.add_argument("--tui", action="store_true", help="show the dashboard while the demo runs")
    d.add_argument("--quick", action="store_true", help="fewer steps")
    return parser


def _fail(message: str, code: int = 1) -> int:
    print(f"trainguard: {message}", file=sys.stderr)
    return code


def cmd_agent(args: argparse.Namespace) -> int:
    from trainguard.agent.config import DEFAULT_CONFIG_PATH, apply_state_dir, load_config

    if args.check_config:
        try:
            load_config(args.check_config, must_exist=True)
        except ConfigError as exc:
            print(f"trainguard: config error: {exc}", file=sys.stderr)
            return EXIT_USAGE
        print(f"{args.check_config}: ok")
        return 0
    if args.print_bpf:
        try:
            from trainguard.agent.collectors.ebpf import render_all
        except ImportError as exc:
            return _fail(f"eBPF programs unavailable: {exc}")
        print(render_all())
        return 0
    path = args.config or DEFAULT_CONFIG_PATH
    try:
        cfg = load_config(path, must_exist=args.config is not None)
        if args.state_dir:
            apply_state_dir(cfg, args.state_dir)
        if args.metrics_addr is not None:
            from trainguard.agent.config import _host_port

            _host_port("--metrics-addr", args.metrics_addr, allow_empty=True)
            cfg.metrics.addr = args.metrics_addr
    except ConfigError as exc:
        print(f"trainguard: config error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    import logging

    from trainguard.agent.daemon import Agent

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return Agent(cfg, config_path=path if os.path.exists(path) else None).run()
    except ConfigError as exc:  # found at start (a token file's contents): still a config error
        print(f"trainguard: config error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as exc:
        return _fail(f"agent could not start: {exc}")


def tls_from_args(args: argparse.Namespace) -> Any:
    """The SSL context of ``--tls-ca/--tls-cert/--tls-key`` (None: plain HTTP); ValueError on a bad file."""
    from trainguard.agent.api.tls import TlsConfigError, context_for_cli

    try:
        return context_for_cli(getattr(args, "tls_ca", None), getattr(args, "tls_cert", None),
                               getattr(args, "tls_key", None))
    except TlsConfigError as exc:
        raise ValueError(str(exc)) from None


def make_client(args: argparse.Namespace) -> Any:
    from trainguard.agent.api.client import ApiClient
    from trainguard.agent.paths import AgentPaths

    if getattr(args, "agent", None):
        host, _, port = args.agent.rpartition(":")
        if not args.token_file:
            raise ValueError("--agent needs --token-file")
        return ApiClient.remote(host or "127.0.0.1", int(port), args.token_file, tls=tls_from_args(args))
    return ApiClient.local(AgentPaths.for_state_dir(args.state_dir).control_socket)


def _format_age(ts: float) -> str:
    age = max(0.0, time.time() - ts)
    return f"{age:.0f}s" if age < 120 else f"{age / 60:.0f}m"


def cmd_status(args: argparse.Namespace) -> int:
    st = make_client(args).status()
    if args.json:
        print(json.dumps(st, indent=2))
        return 0
    print(f"node {st['node']}  agent {st['version']} pid {st['pid']}  up {st['uptime_s']:.0f}s  leader {st.get('leader')}")
    for t in st.get("threads", []):
        if not t.get("healthy", True):
            print(f"UNHEALTHY: agent thread {t['name']} {t['reason']} for {t['unhealthy_for_s']:.0f}s (watchdog not fed)")
    for name, c in sorted(st["collectors"].items()):
        print(f"  collector {name:<5} {'up' if c['up'] else 'down'}{'' if c['up'] else '  (' + str(c['reason']) + ')'}")
    for job in st["jobs"]:
        print(f"job {job['job']}  {job['state']}  attempt {job.get('attempt', '-')}  restarts {job.get('restarts', 0)}  step {job.get('progress_step', '-')}")
        if job.get("note"):
            print(f"  note: {job['note']}")
        for r in job.get("ranks", []):
            tel = r.get("telemetry") or {}
            state = "alive" if r.get("alive", True) else f"exit {r.get('exit_code')}"
            print(
                f"  rank {r['rank']:>3} pid {r.get('pid', '-'):>7} {state:<8} step {tel.get('step', '-'):>6} "
                f"step_s {tel.get('step_s', float('nan')):.3f} compute_s {tel.get('compute_s', float('nan')):.3f} "
                f"loss {tel.get('loss', float('nan')):.4f}"
            )
    _print_cluster(st.get("cluster"))
    return 0


def _print_cluster(cl: dict[str, Any] | None) -> None:
    if not cl or not cl.get("etcd"):
        return
    members = ", ".join(f"{n} ({m.get('slots') or '?'} slots)" for n, m in sorted(cl.get("members", {}).items()))
    print(f"cluster {cl['cluster']}  leader {cl.get('leader')}  etcd {'up' if cl.get('etcd_reachable') else 'UNREACHABLE'}  "
          f"members {members or '-'}  peer copy to {cl.get('peer') or '-'}")
    for job, g in sorted((cl.get("spanning_jobs") or {}).items()):
        blocks = "; ".join(f"{n}: ranks {o}-{o + k - 1}" for n, o, k in g.get("blocks", []))
        restore = f"  restored step {g['restore_step']}" if g.get("restore_step", -1) >= 0 else ""
        print(f"  spanning job {job}  {g.get('state')}  attempt {g.get('attempt')}  dp={g.get('dp')} tp={g.get('tp')} "
              f"pp={g.get('pp')}  {blocks or '-'}{restore}  ({g.get('cause')})")


def _print_event(e: dict[str, Any]) -> None:
    where = ""
    if e.get("job"):
        where = f" [{e['job']}" + (f" rank {e['rank']}" if e.get("rank") is not None else "") + "]"
    cause = f" (cause: {e['cause']})" if e.get("cause") else ""
    stamp = time.strftime("%H:%M:%S", time.localtime(e["ts"]))
    print(f"{e['seq']:>6} {stamp} {e['severity']:<8} {e['kind']:<22}{where} {e['message']}{cause}")


def cmd_events(args: argparse.Namespace) -> int:
    client = make_client(args)
    since = args.since
    while True:
        batch = client.events(since=since, limit=args.limit, kind=args.kind)
        for e in batch["events"]:
            if args.json:
                print(json.dumps(e))
            else:
                _print_event(e)
        since = batch["next"]
        if not args.follow:
            return 0
        time.sleep(0.5)


def cmd_checkpoints(args: argparse.Namespace) -> int:
    items = make_client(args).checkpoints(job=args.job)
    if args.json:
        print(json.dumps(items, indent=2))
        return 0
    if not items:
        print("no checkpoints")
    for c in items:
        print(f"{c.get('tier', '?'):<7} {c.get('job', '?'):<24} step {c.get('step', '?'):>7}  {c.get('size', 0) / 1e6:8.1f} MB  age {_format_age(c.get('created', time.time()))}")
    return 0


def _trainer_config(args: argparse.Namespace) -> dict[str, Any]:
    from trainguard.trainer.config import config_from_cli

    return config_from_cli(
        nproc=args.nproc, dp=args.dp, tp=args.tp, pp=args.pp, steps=args.steps, faults=args.fault, overrides=args.set
    )


def cmd_train(args: argparse.Namespace) -> int:
    try:
        trainer_cfg = _trainer_config(args)
    except ValueError as exc:
        print(f"trainguard: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.standalone:
        from trainguard.trainer.config import TrainConfig
        from trainguard.trainer.launch import run_standalone

        rc: int = run_standalone(TrainConfig.from_dict(trainer_cfg), args.nproc, json_out=args.json)
        return rc
    from trainguard.agent.lifecycle.follow import follow_job

    client = make_client(args)
    spec = {"nproc": args.nproc, "trainer": trainer_cfg, "faults": list(args.fault)}
    if args.nodes != 1:
        spec["nodes"] = args.nodes
    if args.job:
        spec["job"] = args.job
    job = client.submit_job(spec)
    if _submitted_only(job, args):
        return 0
    return follow_job(client, job, json_out=args.json)


def _submitted_only(job: str, args: argparse.Namespace) -> bool:
    """Say where a submitted job went when the command does not follow it (a cluster job, --detach)."""
    if args.nodes > 1:
        print(f"{job}: recorded in the cluster; the leader places it on {args.nodes} nodes "
              "(`trainguard status` on any agent shows where it runs)")
        return True
    if args.detach:
        print(job)
        return True
    return False


def cmd_run(args: argparse.Namespace) -> int:
    from trainguard.run.environment import ENV_STATE_DIR

    try:
        launch = torchrun_args.resolve(args, os.environ)
    except torchrun_args.UsageError as exc:
        return _fail(str(exc), EXIT_USAGE)
    if args.nodes < 1:
        return _fail("--nodes must be >= 1", EXIT_USAGE)
    for note in launch.notes:
        print(f"trainguard: {note}", file=sys.stderr)
    environ = dict(os.environ)
    if launch.rdzv is not None and (args.detach or args.nodes > 1):
        return _fail("--nnodes with --rdzv-endpoint runs this node's share in the foreground; --detach and --nodes "
                     "are for jobs the cluster places", EXIT_USAGE)
    if launch.no_agent and launch.rdzv is not None:
        return _run_nodes(launch, environ, None)
    if launch.no_agent:
        return _run_agentless(launch, args, environ)
    if args.agent:
        client = make_client(args)
        try:
            client.health()
        except ApiClientError as exc:
            return _fail(f"{exc}; leave --agent out and this command uses this node's agent or hosts one")
        if launch.rdzv is not None:
            return _run_nodes(launch, environ, client)
        return _submit_and_follow(client, launch, args, environ)
    from trainguard.launch.hosted_agent import NoAgent, local_agent

    try:
        with local_agent(args.state_dir, environ, job=launch.job or "run", metrics_addr=args.metrics_addr) as node:
            if node.state_dir:
                environ[ENV_STATE_DIR] = node.state_dir  # where the ranks' trainguard.init() looks
            if args.metrics_addr and not node.hosted:
                print("trainguard: --metrics-addr is for an agent this command hosts; the node agent serves its "
                      "own /metrics", file=sys.stderr)
            if node.hosted and (args.detach or args.nodes > 1):
                return _fail("--detach and --nodes need a node agent that outlives this command "
                             "(`trainguard agent`); none runs here", EXIT_USAGE)
            if launch.rdzv is not None:
                return _run_nodes(launch, environ, node.client)
            return _submit_and_follow(node.client, launch, args, environ)
    except NoAgent as exc:
        return _fail(str(exc))


def _submit_and_follow(client: Any, launch: torchrun_args.Launch, args: argparse.Namespace,
                       environ: dict[str, str]) -> int:
    """Submit the job and follow it (``follow`` stops the job on Ctrl-C or SIGTERM, as a scheduler
    ends a step, and exits 130 or 143)."""
    from trainguard.launch.runcmd import follow, job_spec

    spec = job_spec(launch.command, nproc=launch.nproc, nodes=args.nodes, job=launch.job,
                    max_restarts=launch.max_restarts, hang_timeout_s=args.hang_timeout, environ=environ)
    job = client.submit_job(spec)
    if _submitted_only(job, args):
        return 0
    return follow(client, job)


def _run_nodes(launch: torchrun_args.Launch, environ: dict[str, str], client: Any) -> int:
    from trainguard.launch.multinode import (
        run_nodes,  # imports torch (the rendezvous store): not for every command
    )

    return run_nodes(launch, environ, client)


def _run_agentless(launch: torchrun_args.Launch, args: argparse.Namespace, environ: dict[str, str]) -> int:
    from trainguard.launch.runcmd import resolve_command
    from trainguard.launch.standalone import run_standalone

    if args.detach or args.nodes > 1:
        return _fail("--detach and --nodes need an agent (it runs the job); start one with `trainguard agent`",
                     EXIT_USAGE)
    if args.hang_timeout:
        print("trainguard: --hang-timeout needs the agent (it watches the ranks); ignored without one", file=sys.stderr)
    print("trainguard: --no-agent: no snapshots, restores or hang verdicts; a restart starts the script "
          "from its beginning", file=sys.stderr)
    restarts = 3 if launch.max_restarts is None else launch.max_restarts
    return run_standalone(resolve_command(launch.command, environ.get("PATH")), launch.nproc, max_restarts=restarts,
                          job=launch.job, environ=environ)


def cmd_top(args: argparse.Namespace) -> int:
    try:
        from trainguard.tui.app import run_dashboard
    except ImportError as exc:
        return _fail(f"dashboard unavailable: {exc}")
    rc: int = run_dashboard(args)
    return rc


def cmd_demo(args: argparse.Namespace) -> int:
    from trainguard.demo.demo import run_demo

    return run_demo(tui=args.tui, quick=args.quick)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handlers = {
        "agent": cmd_agent,
        "train": cmd_train,
        "run": cmd_run,
        "status": cmd_status,
        "events": cmd_events,
        "checkpoints": cmd_checkpoints,
        "top": cmd_top,
        "stop": lambda a: jobcmds.cmd_stop(make_client(a), a),
        "logs": lambda a: jobcmds.cmd_logs(make_client(a), a),
        "checkpoint": lambda a: jobcmds.cmd_checkpoint(make_client(a), a),
        "drain": lambda a: jobcmds.cmd_drain(make_client(a), a),
        "demo": cmd_demo,
    }
    try:
        return handlers[args.command](args)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # noqa: BLE001 - one line for the user, never a traceback
        from trainguard.agent.api.client import ApiClientError

        if isinstance(exc, ApiClientError | ValueError):
            return _fail(str(exc))
        raise


if __name__ == "__main__":
    sys.exit(main())
