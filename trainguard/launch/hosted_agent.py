"""A node agent for one ``trainguard run`` where no node agent runs.

``local_agent`` finds the node's agent (``--state-dir``, ``$TRAINGUARD_STATE_DIR``, the default
paths) or, where none answers, starts one for this command: the daemon itself (``python -m
trainguard agent``) as a child process of this user, so snapshots, the memory tier, restores,
hang and straggler verdicts, plans and the event log work as they do under the root service. It
gets a private state directory (0700, under ``$XDG_RUNTIME_DIR`` or ``/tmp/trainguard-<uid>``)
and a memory tier under ``/dev/shm/trainguard-<uid>``, and lives exactly as long as the ``with``
block: leaving it stops the agent, which stops the job's ranks. A child process rather than an
agent in this process: the daemon installs its own signal handlers and threads, and a command
killed outright still takes it along (the kernel's parent-death signal), ranks included.

Torch-free: ``trainguard run`` never imports torch.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TextIO

from trainguard.agent.api.client import ApiClient, ApiClientError
from trainguard.agent.paths import AgentPaths
from trainguard.agent.privilege import FEATURE_OFF
from trainguard.agent.safefs import ensure_agent_dir, rmtree_beneath
from trainguard.run.environment import ENV_STATE_DIR

START_TIMEOUT_S = 60.0
"""How long a hosted agent may take to answer its control socket (imports on a loaded node)."""
STOP_TIMEOUT_S = 30.0
"""How long a hosted agent may take to stop the job's ranks and itself before it is killed."""
KEEP_STATE_DIRS = 8
"""State dirs of finished hosted agents kept per user (their event logs and rank logs)."""
_PR_SET_PDEATHSIG = 1
_DIR_NAME_MAX = 24
"""Characters of the job id kept in the private directory's name (socket paths stay short)."""
_STATE_NAME_MAX = _DIR_NAME_MAX + 10
"""The longest state dir name below the private root (``<job>.<random>`` and its slash)."""
_SOCKET_PATH_MAX = 107
"""The longest path a Unix socket may have (sun_path, less its terminating NUL)."""


class NoAgent(Exception):
    """A named agent (``--state-dir``) does not answer; the message says what to do."""


@dataclass(frozen=True)
class NodeAgent:
    client: ApiClient
    state_dir: str | None
    """Where the agent's files are (None: the default paths of the node's service)."""
    hosted: bool
    """True when this command started the agent for itself."""
    pid: int | None = None
    """The hosted agent's pid (None when the node's agent is used)."""


def _answers(state_dir: str | None) -> ApiClient | None:
    client = ApiClient.local(AgentPaths.for_state_dir(state_dir).control_socket)
    try:
        client.health()
    except ApiClientError:
        return None
    return client


def private_root(environ: Mapping[str, str]) -> str:
    """This user's directory for hosted agents: ``$XDG_RUNTIME_DIR/trainguard`` where that runtime
    dir is this user's own, else ``/tmp/trainguard-<uid>``; made 0700, never through a symlink."""
    runtime = environ.get("XDG_RUNTIME_DIR", "")
    base = ""
    if os.path.isabs(runtime):
        try:
            st = os.lstat(runtime)
        except OSError:
            st = None
        if st is not None and os.path.isdir(runtime) and not os.path.islink(runtime) \
                and st.st_uid == os.geteuid() and not st.st_mode & 0o022:
            base = os.path.join(runtime, "trainguard")
    if len(base) + _STATE_NAME_MAX + len("/run/telemetry.sock") > _SOCKET_PATH_MAX:
        base = ""  # a socket path past the kernel's limit: the short fallback instead
    base = base or os.path.join(tempfile.gettempdir(), f"trainguard-{os.geteuid()}")
    ensure_agent_dir(base, mode=0o700, takeover=False)
    return base


def prune_old(root: str, keep: int = KEEP_STATE_DIRS) -> list[str]:
    """Remove all but the ``keep`` newest state dirs of finished hosted agents under ``root`` (one
    whose agent still runs keeps its pid file, one just made is left alone); returns those removed."""
    found = []
    for name in os.listdir(root):
        path = os.path.join(root, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid():
            found.append((st.st_mtime, path))
    removed = []
    young = time.time() - START_TIMEOUT_S  # an agent still starting has no pid file yet
    for mtime, path in sorted(found, reverse=True)[keep:]:
        if mtime < young and not os.path.exists(AgentPaths.for_state_dir(path).pid_file):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _shm_dirs(state_dir: str) -> tuple[str, str]:
    """(this user's directory under /dev/shm, the hosted agent's memory tier inside it)."""
    shm = f"/dev/shm/trainguard-{os.geteuid()}" if os.path.isdir("/dev/shm") \
        else os.path.join(state_dir, "shm")
    ensure_agent_dir(shm, mode=0o700, takeover=False)
    return shm, os.path.join(shm, os.path.basename(state_dir))


def _toml_str(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _config(memory_root: str, metrics_addr: str | None) -> str:
    # The service's /etc config is not read: it names the root daemon's paths and listeners.
    return (f"[agent]\nnode = {_toml_str(socket.gethostname() or 'localhost')}\non_stop = \"stop_ranks\"\n\n"
            f"[metrics]\naddr = {_toml_str(metrics_addr or '')}\n\n"
            f"[checkpoint]\nmemory_root = {_toml_str(memory_root)}\n")


def _die_with_parent() -> None:
    """In the agent's child before exec: SIGTERM when ``trainguard run`` dies, however it dies."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _last_line(path: str) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - 4096))
            lines = [x for x in fh.read().decode("utf-8", "replace").splitlines() if x.strip()]
    except OSError:
        return ""
    return lines[-1] if lines else ""


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)  # the agent stops the ranks (agent.on_stop = stop_ranks)
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def feature_notes(client: ApiClient) -> list[str]:
    """What the agent said it runs without (one message per feature), from its event log."""
    got = client.events(since=0, limit=50, kind=FEATURE_OFF)
    return [str(e["message"]) for e in got.get("events", [])]


@contextmanager
def host_agent(*, job: str, environ: Mapping[str, str], metrics_addr: str | None = None,
               python: str = sys.executable, err: TextIO = sys.stderr) -> Iterator[NodeAgent]:
    """Start the daemon for this user and ``job`` in a private state dir; stop it on leaving."""
    safe_job = "".join(c if c.isalnum() or c in "-_." else "-" for c in job)[:_DIR_NAME_MAX] or "job"
    try:
        root = private_root(environ)
        prune_old(root)
        state_dir = tempfile.mkdtemp(prefix=f"{safe_job}.", dir=root)  # 0700, made here only
        shm, memory_root = _shm_dirs(state_dir)
    except OSError as exc:  # another user's directory, or a symlink, where ours belongs: never used
        raise NoAgent(f"no private directory for an agent of this job: {exc}") from None
    config = os.path.join(state_dir, "agent.toml")
    fd = os.open(config, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(_config(memory_root, metrics_addr))
    log_path = os.path.join(state_dir, "agent.log")
    env = {k: v for k, v in environ.items() if k != ENV_STATE_DIR}
    cmd = [python, "-m", "trainguard", "agent", "--config", config, "--state-dir", state_dir]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                start_new_session=True, preexec_fn=_die_with_parent)
    try:
        client = _wait_ready(proc, state_dir, log_path)
        paths = AgentPaths.for_state_dir(state_dir)
        metrics = ""
        if metrics_addr:
            with open(paths.metrics_addr_file) as fh:
                metrics = f", metrics http://{fh.read().strip()}/metrics"
        err.write(f"trainguard: no node agent here; hosting one for this job (pid {proc.pid}, state "
                  f"{state_dir}, events {os.path.join(paths.events_dir, 'events.jsonl')}{metrics})\n")
        for note in feature_notes(client):
            err.write(f"trainguard: {note}\n")
        err.flush()
        yield NodeAgent(client, state_dir, True, proc.pid)
    finally:
        _stop(proc)
        # The memory tier is RAM: it goes with the job. The state dir keeps the events and logs.
        rmtree_beneath(shm, memory_root)
        shutil.rmtree(os.path.join(state_dir, "checkpoints"), ignore_errors=True)


def _wait_ready(proc: subprocess.Popen[bytes], state_dir: str, log_path: str) -> ApiClient:
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        client = _answers(state_dir)
        if client is not None:
            return client
        if proc.poll() is not None:
            raise NoAgent(f"the agent hosted for this job exited with {proc.returncode}: "
                          f"{_last_line(log_path) or 'no output'} (log {log_path}; --no-agent runs without one)")
        if time.monotonic() > deadline:
            raise NoAgent(f"the agent hosted for this job did not answer in {START_TIMEOUT_S:.0f}s "
                          f"(log {log_path}; --no-agent runs without one)")
        time.sleep(0.05)


@contextmanager
def local_agent(state_dir: str | None, environ: Mapping[str, str], *, job: str, metrics_addr: str | None = None,
                python: str = sys.executable, err: TextIO = sys.stderr) -> Iterator[NodeAgent]:
    """The node's agent, or one hosted for ``job`` while the block runs.

    An agent named by ``state_dir`` (``--state-dir``) or else ``$TRAINGUARD_STATE_DIR`` must
    answer (NoAgent otherwise); with neither, the service's agent at the default paths is used,
    and where none answers one is hosted. Callers export ``NodeAgent.state_dir`` to the ranks as
    ``TRAINGUARD_STATE_DIR``."""
    named, source = (state_dir, "--state-dir") if state_dir else (environ.get(ENV_STATE_DIR) or None, ENV_STATE_DIR)
    client = _answers(named)
    if client is not None:
        yield NodeAgent(client, named, False)
        return
    if named:
        unset = "leave --state-dir out" if state_dir else f"unset {ENV_STATE_DIR}"
        raise NoAgent(f"no agent at {AgentPaths.for_state_dir(named).control_socket} ({source}): start one with "
                      f"`trainguard agent --state-dir {named}` or point --state-dir at a running one; or {unset} "
                      "and this command hosts an agent for the job (--no-agent: none at all)")
    with host_agent(job=job, environ=environ, metrics_addr=metrics_addr, python=python, err=err) as hosted:
        yield hosted
