"""torchrun's launch flags on ``trainguard run``: a torchrun command line with ``torchrun``
replaced by ``trainguard run`` runs the same way on one node.

``add_arguments`` puts torchrun's flags (both spellings, ``--nproc-per-node`` and
``--nproc_per_node``) on the ``run`` parser; ``resolve`` turns what was parsed, with torchrun's
``PET_*`` environment as the defaults (flags win, as in torchrun), into one ``Launch``: the rank
command, the rank count, the job id and how to run it. Bad values raise ``UsageError`` with one
line for the user. Several nodes (``--nnodes`` above 1, or ``MIN:MAX`` with MAX above 1 and an
endpoint) meet through the c10d backend: ``Launch.rdzv`` says how (``trainguard.launch.multinode``).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from trainguard.agent.wire import valid_job_id

# torchrun's rendezvous backends that mean "meet on one node" here (static is torchrun's default).
BACKENDS = ("c10d", "static")
NPROC_WORDS = ("gpu", "cpu", "auto")
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}

EPILOG = """\
a torchrun command line runs unchanged with `torchrun` replaced by `trainguard run`:
  torchrun --standalone --nproc-per-node 2 train.py --lr 0.1
  trainguard run --standalone --nproc-per-node 2 train.py --lr 0.1

any command, after --:
  trainguard run --nproc 2 -- python train.py --lr 0.1
  trainguard run --no-agent --nproc 2 -- python train.py   # no agent: ranks run from this process

torchrun's PET_* environment (PET_NPROC_PER_NODE, PET_NNODES, PET_RDZV_ID, PET_STANDALONE, ...)
gives the defaults of the flags of the same name; a flag given on the command line wins.
several nodes, each running the same line (docs/multinode.md):
  trainguard run --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HEAD:29400 \
      --rdzv-id JOB train.py"""


class UsageError(ValueError):
    """A flag or PET_* value trainguard run cannot use: one line for the user, exit code 2."""


# torchrun's --rdzv-conf keys this rendezvous uses (seconds), and what each sets.
RDZV_CONF = {"last_call_timeout": "last_call_s", "join_timeout": "join_timeout_s",
             "keep_alive_interval": "keepalive_s", "keep_alive_max_attempt": "keepalive_misses"}
DEFAULT_PORT = 29400


@dataclass(frozen=True)
class Rdzv:
    """Where and how the nodes meet (torchrun's c10d rendezvous)."""

    host: str
    port: int
    run_id: str
    min_nodes: int
    max_nodes: int
    node_rank: int | None = None
    conf: dict[str, float] = field(default_factory=dict)
    """``RDZV_CONF`` options given, by the ``RdzvConfig`` field they set."""


@dataclass
class Launch:
    command: list[str]
    nproc: int
    job: str | None = None
    max_restarts: int | None = None
    standalone: bool = False
    """torchrun's --standalone: one node, its own rendezvous on a free port."""
    no_agent: bool = False
    rdzv: Rdzv | None = None
    """Set when nodes meet at a rendezvous endpoint (several nodes)."""
    notes: list[str] = field(default_factory=list)
    """One-line remarks for the user (flags accepted but without effect on one node)."""


# torchrun flags that change nothing a rank sees here: accepted (so a torchrun line runs unchanged),
# named in a one-line note when given. (dest, spellings, metavar, why)
NO_EFFECT = (
    ("monitor_interval", ("--monitor-interval", "--monitor_interval"), "S", "the agent watches the ranks itself"),
    ("start_method", ("--start-method", "--start_method"), "METHOD", "ranks are processes of their own"),
    ("role", ("--role",), "NAME", "ROLE_NAME is default"),
    ("log_dir", ("--log-dir", "--log_dir"), "DIR", "each rank's output is kept in <state>/jobs/<job>/rank<N>.log"),
    ("redirects", ("-r", "--redirects"), "STD", "output is prefixed per rank and kept per rank"),
    ("tee", ("-t", "--tee"), "STD", "output is prefixed per rank and kept per rank"),
    ("local_ranks_filter", ("--local-ranks-filter", "--local_ranks_filter"), "RANKS", "every rank's output is shown"),
    ("local_addr", ("--local-addr", "--local_addr"), "ADDR", "one node needs no address of its own"),
)


def _flag(parser: argparse.ArgumentParser, *names: str, help: str) -> None:
    # None when not given, so that resolve tells an absent flag (PET_* applies) from a given one.
    parser.add_argument(*names, action="store_const", const=True, default=None, help=help)


def add_arguments(r: argparse.ArgumentParser) -> None:
    """torchrun's launch flags, each with both of torchrun's spellings."""
    r.add_argument("--nproc", "--nproc-per-node", "--nproc_per_node", dest="nproc", metavar="N",
                   help="ranks on this node: a number, or gpu / cpu / auto as torchrun counts them "
                   "(default 1; PET_NPROC_PER_NODE)")
    r.add_argument("--nnodes", metavar="MIN[:MAX]",
                   help="torchrun's node count; on one node 1 or 1:MAX (default 1; PET_NNODES)")
    r.add_argument("--node-rank", "--node_rank", dest="node_rank", metavar="N",
                   help="this node's rank among the nodes; 0 on one node (PET_NODE_RANK)")
    r.add_argument("--rdzv-backend", "--rdzv_backend", dest="rdzv_backend", metavar="NAME",
                   help="rendezvous backend: c10d or static (PET_RDZV_BACKEND)")
    r.add_argument("--rdzv-endpoint", "--rdzv_endpoint", dest="rdzv_endpoint", metavar="HOST[:PORT]",
                   help="rendezvous endpoint; on one node the ranks meet on a free port of this node "
                   "(PET_RDZV_ENDPOINT)")
    r.add_argument("--rdzv-id", "--rdzv_id", dest="rdzv_id", metavar="ID",
                   help="rendezvous id: the job id when --job is not given (PET_RDZV_ID)")
    r.add_argument("--master-addr", "--master_addr", dest="master_addr", metavar="HOST",
                   help="torchrun's static rendezvous address; on one node the ranks get this node's "
                   "(PET_MASTER_ADDR)")
    r.add_argument("--master-port", "--master_port", dest="master_port", metavar="PORT",
                   help="torchrun's static rendezvous port; each attempt's ranks meet on a fresh free port, "
                   "in MASTER_PORT (PET_MASTER_PORT)")
    _flag(r, "--standalone", help="torchrun's standalone: one node, its own rendezvous on a free port; "
          "through the agent when one answers, else from this process (PET_STANDALONE)")
    _flag(r, "-m", "--module", help="SCRIPT is a module: run `python -m SCRIPT` (PET_MODULE)")
    _flag(r, "--no-python", "--no_python", help="SCRIPT is a program: run it without python (PET_NO_PYTHON)")
    _flag(r, "--run-path", "--run_path", help="run SCRIPT as a python file, as torchrun's runpy.run_path "
          "(PET_RUN_PATH)")
    r.add_argument("--rdzv-conf", "--rdzv_conf", dest="rdzv_conf", metavar="K=V,...",
                   help="rendezvous options of several nodes: " + ", ".join(RDZV_CONF) + " (PET_RDZV_CONF)")
    for dest, names, metavar, why in NO_EFFECT:
        r.add_argument(*names, dest=dest, metavar=metavar, help=f"torchrun's; accepted, no effect here: {why}")


def _env_flag(environ: Mapping[str, str], name: str) -> bool:
    value = environ.get(name, "").strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise UsageError(f"{name}={environ[name]!r}: expected 1 or 0")


def _pick(given: str | None, environ: Mapping[str, str], pet: str, default: str | None) -> tuple[str | None, str]:
    """The value and where it came from (the flag, else ``PET_*``, else the default)."""
    if given is not None:
        return given, ""
    if environ.get(pet):
        return environ[pet], f"{pet}="
    return default, ""


def _int(text: str, what: str, low: int, high: int | None = None) -> int:
    try:
        value = int(text)
    except ValueError:
        raise UsageError(f"{what}{text}: not a whole number") from None
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"between {low} and {high}"
        raise UsageError(f"{what}{text}: must be {bound}")
    return value


def parse_nnodes(text: str, what: str = "--nnodes ") -> tuple[int, int]:
    """torchrun's ``MIN[:MAX]``."""
    parts = text.split(":")
    if len(parts) > 2:
        raise UsageError(f"{what}{text}: expected MIN or MIN:MAX")
    low = _int(parts[0], what, 1)
    high = _int(parts[1], what, 1) if len(parts) == 2 else low
    if high < low:
        raise UsageError(f"{what}{text}: MAX is below MIN")
    return low, high


def count_nproc(word: str) -> int:
    """torchrun's ``gpu`` / ``cpu`` / ``auto`` rank counts (torch is imported only for these)."""
    if word == "cpu":
        return len(os.sched_getaffinity(0)) or 1
    import torch

    if word == "gpu":
        if not torch.cuda.is_available():
            raise UsageError("--nproc-per-node gpu: no CUDA GPU on this node")
        return int(torch.cuda.device_count())
    if torch.accelerator.is_available():
        return int(torch.accelerator.device_count())
    return len(os.sched_getaffinity(0)) or 1


def _nproc(text: str, source: str) -> int:
    if text in NPROC_WORDS:
        return count_nproc(text)
    if not text.lstrip("-").isdigit():
        raise UsageError(f"{source or '--nproc-per-node '}{text}: expected a number or one of {', '.join(NPROC_WORDS)}")
    return _int(text, source or "--nproc-per-node ", 1)


def _endpoint(text: str, what: str) -> None:
    host, sep, port = text.rpartition(":")
    if not sep:
        host, port = text, ""
    if not host.strip("[]"):
        raise UsageError(f"{what}{text}: expected HOST[:PORT]")
    if port:
        _int(port, f"{what}{text}: port ", 0, 65535)


def rank_command(cmd: list[str], *, module: bool, no_python: bool, run_path: bool, environ: Mapping[str, str],
                 cwd: str | None = None) -> list[str]:
    """What each rank runs: ``-- CMD ARGS`` as given, else torchrun's SCRIPT forms (``python -u``)."""
    if cmd and cmd[0] == "--":
        if module or no_python or run_path:
            raise UsageError("-m, --no-python and --run-path take a SCRIPT, not -- CMD")
        if len(cmd) == 1:
            raise UsageError("run needs a command after --: trainguard run [OPTIONS] -- CMD [ARGS...]")
        return cmd[1:]
    if not cmd:
        raise UsageError("run needs a script or a command: trainguard run [OPTIONS] SCRIPT [ARGS...] "
                         "or trainguard run [OPTIONS] -- CMD [ARGS...]")
    if no_python and (module or run_path):
        raise UsageError("--no-python cannot be used with -m or --run-path")
    script, args = cmd[0], cmd[1:]
    if no_python:
        return [script, *args]
    python = environ.get("PYTHON_EXEC") or sys.executable
    if module:
        return [python, "-u", "-m", script, *args]
    if not os.path.isfile(os.path.join(cwd or os.getcwd(), script)):
        raise UsageError(f"{script}: no such file (a command goes after --: trainguard run [OPTIONS] -- CMD [ARGS...])")
    return [python, "-u", script, *args]


def resolve(args: argparse.Namespace, environ: Mapping[str, str], cwd: str | None = None) -> Launch:
    """The launch ``args`` and torchrun's ``PET_*`` variables in ``environ`` ask for; ``UsageError`` when bad."""
    standalone = bool(args.standalone) if args.standalone is not None else _env_flag(environ, "PET_STANDALONE")
    text, src = _pick(args.nnodes, environ, "PET_NNODES", "1")
    assert text is not None
    low, high = parse_nnodes(text, src or "--nnodes ")
    endpoint, esrc = _pick(args.rdzv_endpoint, environ, "PET_RDZV_ENDPOINT", None)
    if endpoint:
        _endpoint(endpoint, esrc or "--rdzv-endpoint ")
    rank_text, rsrc = _pick(args.node_rank, environ, "PET_NODE_RANK", None)
    node_rank = None if rank_text is None else _int(rank_text, rsrc or "--node-rank ", 0)
    backend, bsrc = _pick(args.rdzv_backend, environ, "PET_RDZV_BACKEND", "static")
    if backend not in BACKENDS:
        raise UsageError(f"{bsrc or '--rdzv-backend '}{backend}: trainguard run supports {' or '.join(BACKENDS)}")
    rdzv = None
    if high > 1 and not standalone and (low > 1 or endpoint):
        rdzv = _rdzv(args, environ, text, src, low, high, endpoint, backend, node_rank)
    elif low > 1:
        raise UsageError(f"{src or '--nnodes '}{text}: --standalone runs one node")
    elif node_rank:
        raise UsageError(f"{rsrc or '--node-rank '}{rank_text}: on one node (--nnodes 1) the node rank is 0")
    nproc_text, nsrc = _pick(args.nproc, environ, "PET_NPROC_PER_NODE", "1")
    assert nproc_text is not None
    nproc = _nproc(nproc_text, nsrc)
    restarts_text, msrc = _pick(args.max_restarts, environ, "PET_MAX_RESTARTS", None)
    max_restarts = None if restarts_text is None else _int(restarts_text, msrc or "--max-restarts ", 0)
    notes = []
    for flag, given, pet, port in (("--master-addr", args.master_addr, "PET_MASTER_ADDR", False),
                                   ("--master-port", args.master_port, "PET_MASTER_PORT", True)):
        value, vsrc = _pick(given, environ, pet, None)
        if value is None:
            continue
        if port:
            _int(value, vsrc or f"{flag} ", 1, 65535)
        if not vsrc and rdzv is None:  # a PET_* value left in the environment is no reason to speak up
            notes.append(f"{flag} {value}: not used on one node; each attempt's ranks meet on a fresh free port of "
                         "this node (MASTER_ADDR and MASTER_PORT tell them)")
    if rdzv is None and args.rdzv_conf is not None:
        notes.append(f"--rdzv-conf {args.rdzv_conf}: no effect here (rendezvous options apply to multi-node "
                     "rendezvous)")
    for dest, names, _metavar, why in NO_EFFECT:
        if getattr(args, dest) is not None:
            flag = next(n for n in names if n.startswith("--"))
            notes.append(f"{flag} {getattr(args, dest)}: no effect here ({why})")
    rdzv_id, isrc = _pick(args.rdzv_id, environ, "PET_RDZV_ID", None)
    job = args.job or (rdzv_id if rdzv_id and rdzv_id != "none" else None)
    if job is not None and not valid_job_id(job):
        what = "--job " if args.job else (isrc or "--rdzv-id ")
        raise UsageError(f"{what}{job}: a job id is 1-64 letters, digits, '-', '_' or '.', not starting with '.'")
    explicit = [bool(args.module), bool(args.no_python), bool(args.run_path)]
    command_mode = bool(args.cmd) and args.cmd[0] == "--"
    if not command_mode:  # PET_* forms of the script flags matter only where a SCRIPT is given
        explicit = [given or _env_flag(environ, pet) for given, pet in
                    zip(explicit, ("PET_MODULE", "PET_NO_PYTHON", "PET_RUN_PATH"), strict=True)]
    module, no_python, run_path = explicit
    command = rank_command(list(args.cmd), module=module, no_python=no_python, run_path=run_path, environ=environ,
                           cwd=cwd)
    if rdzv is not None and job is None:
        raise UsageError("--rdzv-id: several nodes need the same rendezvous id on every node (e.g. the job id)")
    if rdzv is not None:
        rdzv = replace(rdzv, run_id=job or rdzv.run_id)
    return Launch(command, nproc, job=job, max_restarts=max_restarts, standalone=standalone,
                  no_agent=bool(args.no_agent), rdzv=rdzv, notes=notes)


def _rdzv_conf(text: str, what: str) -> dict[str, float]:
    conf: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise UsageError(f"{what}{text}: expected KEY=VALUE,...")
        if key not in RDZV_CONF:
            continue  # torchrun's other keys (is_host, read_timeout, ...) change nothing here
        try:
            number = float(value)
        except ValueError:
            raise UsageError(f"{what}{item}: not a number") from None
        if number <= 0 or (key == "keep_alive_max_attempt" and number != int(number)):
            raise UsageError(f"{what}{item}: must be a positive {'whole ' if key.endswith('attempt') else ''}number")
        conf[RDZV_CONF[key]] = int(number) if key == "keep_alive_max_attempt" else number
    return conf


def _rdzv(args: argparse.Namespace, environ: Mapping[str, str], text: str, src: str, low: int, high: int,
          endpoint: str | None, backend: str, node_rank: int | None) -> Rdzv:
    """Several nodes: they meet at the c10d endpoint."""
    if not endpoint:
        raise UsageError(f"{src or '--nnodes '}{text}: several nodes meet at a rendezvous: give --rdzv-endpoint "
                         "HOST[:PORT] (the same on every node)")
    if backend != "c10d":
        raise UsageError(f"{src or '--nnodes '}{text}: several nodes meet through --rdzv-backend c10d, not {backend}")
    if node_rank is not None and node_rank >= high:
        raise UsageError(f"--node-rank {node_rank}: must be below the most nodes ({high})")
    host, sep, port = endpoint.rpartition(":")
    if not sep or host.endswith(":"):
        host, port = endpoint, ""
    conf_text, csrc = _pick(args.rdzv_conf, environ, "PET_RDZV_CONF", "")
    conf = _rdzv_conf(conf_text or "", csrc or "--rdzv-conf ")
    return Rdzv(host.strip("[]"), int(port) if port else DEFAULT_PORT, "", low, high, node_rank, conf)
