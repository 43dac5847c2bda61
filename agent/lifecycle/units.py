r"""Ranks as transient systemd units, when the agent itself runs under systemd.

A rank the agent forks inherits the agent unit's sandbox (``ProtectSystem=strict``,
``ProtectHome=read-only``, its capability bounding set) and sits in the agent's cgroup: a user's
training could not write its outputs, and stopping the agent killed its jobs. Under systemd each
rank instead starts as a transient service, ``trainguard-<job>-a<attempt>-r<rank>.service``, made
by PID 1 with a sandbox of its own (``RANK_SANDBOX``: no capabilities, no new privileges, kernel
tunables and modules protected; the job spec's ``unit_properties`` may only tighten it), in the
job's slice ``trainguard-<job>.slice`` (CPU and memory accounting and limits per job). ``systemd-run
--wait`` stays the agent's child for the rank's lifetime, so the supervisor waits on it as on any
process; the rank's own pid (telemetry, eBPF, signals) is the unit's ``MainPID``.

Job names are escaped in unit and slice names as ``systemd-escape`` does (``-`` becomes ``\x2d``):
systemd nests slices on ``-``, so ``trainguard-a-b.slice`` would sit inside job ``a``'s slice and
live under its limits. The rank's environment reaches it through an ``EnvironmentFile=`` (0600,
the agent's), never the command line, where ``ps`` would show a job's tokens to every user.

systemd-run's exit status is the rank's when it exited on its own; for a rank ended by a signal
it only says "failed", so the unit's ``ExecMainCode``/``ExecMainStatus`` (kept while it is
failed) give the signal, and ``reset-failed`` lets the name go.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from collections.abc import Mapping, Sequence
from typing import Any

_CLD_KILLED, _CLD_DUMPED = 2, 3  # ExecMainCode values for "killed by a signal"
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def under_systemd(environ: Mapping[str, str] | None = None) -> bool:
    """This process is a systemd service (its manager set INVOCATION_ID) on a systemd-booted host."""
    env = os.environ if environ is None else environ
    return bool(env.get("INVOCATION_ID")) and os.path.isdir("/run/systemd/system") and shutil.which("systemd-run") is not None


RANK_SANDBOX = (
    "CapabilityBoundingSet=", "AmbientCapabilities=", "NoNewPrivileges=yes", "RestrictSUIDSGID=yes",
    "ProtectKernelModules=yes", "ProtectKernelTunables=yes", "ProtectKernelLogs=yes",
    "ProtectControlGroups=yes", "LockPersonality=yes", "RestrictRealtime=yes",
)
"""What every rank unit gets, with or without ``launcher.user``: nothing a training job needs, and
none of what a rank running as root could use to take over the node. Nothing that sets a device
policy (``PrivateDevices=``, ``ProtectClock=``): that would shut the ranks out of the GPUs."""


def escape(name: str) -> str:
    r"""``name`` as one unit-name component (``systemd-escape``): ``-`` and anything outside
    ``[A-Za-z0-9:_.]`` as ``\xNN``, a leading ``.`` too."""
    out = []
    for i, ch in enumerate(name):
        if (ch.isascii() and (ch.isalnum() or ch in ":_.")) and not (i == 0 and ch == "."):
            out.append(ch)
        else:
            out.extend(f"\\x{b:02x}" for b in ch.encode())
    return "".join(out)


def unit_name(job: str, attempt: int, rank: int) -> str:
    return f"trainguard-{escape(job)}-a{attempt}-r{rank}.service"


def slice_name(job: str) -> str:
    return f"trainguard-{escape(job)}.slice"


def env_file_text(env: Mapping[str, str]) -> str:
    r"""``env`` in systemd's ``EnvironmentFile=`` syntax: each value double-quoted, with the four
    characters systemd unescapes there (double quote, backslash, backtick, dollar) escaped; a newline stays one."""
    lines = []
    for key, value in env.items():
        if not _ENV_NAME.match(key):
            continue  # systemd ignores such an assignment, saying so in its journal
        quoted = "".join("\\" + c if c in '"\\`$' else c for c in value)
        lines.append(f'{key}="{quoted}"\n')
    return "".join(lines)


def write_env_file(path: str, env: Mapping[str, str]) -> None:
    """A fresh 0600 file at ``path`` (an existing one, or a link planted there, is replaced, never
    followed)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(env_file_text(env))


def run_prefix(unit: str, job: str, *, log_path: str, cwd: str, env_file: str, user: str = "",
               properties: Sequence[str] = ()) -> list[str]:
    """The ``systemd-run`` command line that starts ``unit`` (then ``--`` and the rank's argv); the
    rank's environment is in ``env_file``, so nothing of it is on this command line."""
    argv = ["systemd-run", "--wait", "--quiet", "--no-ask-password", f"--unit={unit}", f"--slice={slice_name(job)}",
            "--service-type=exec", f"--working-directory={cwd}",
            "-p", f"StandardOutput=append:{log_path}", "-p", f"StandardError=append:{log_path}",
            "-p", "KillMode=control-group", "-p", "SendSIGKILL=yes", "-p", f"EnvironmentFile={env_file}"]
    if user:
        argv.append(f"--uid={user}")
    for prop in RANK_SANDBOX:
        argv += ["-p", prop]
    for prop in properties:
        argv += ["-p", prop]
    return [*argv, "--"]


def _show(unit: str, *props: str) -> dict[str, str]:
    try:
        out = subprocess.run(["systemctl", "show", unit, *(f"-p{p}" for p in props)], capture_output=True,
                             text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def set_slice_limits(job: str, cpus: float, memory_max: int) -> None:
    """CPU quota and memory ceiling of the job's slice (its ranks' units share them)."""
    props = []
    if cpus > 0:
        props.append(f"CPUQuota={int(cpus * 100)}%")
    if memory_max > 0:
        props.append(f"MemoryMax={memory_max}")
    if props:
        subprocess.run(["systemctl", "set-property", "--runtime", slice_name(job), *props],
                       capture_output=True, timeout=10, check=False)


def slice_usage(job: str) -> dict[str, float]:
    """CPU seconds and memory of the job's slice (NaN where systemd does not account it)."""
    got = _show(slice_name(job), "CPUUsageNSec", "MemoryCurrent")

    def num(key: str, scale: float = 1.0) -> float:
        try:
            return float(got.get(key, "")) * scale
        except ValueError:
            return float("nan")  # "[not set]"

    return {"cpu_s": num("CPUUsageNSec", 1e-9), "memory_bytes": num("MemoryCurrent")}


class UnitProcess:
    """A rank running as a transient unit, shaped like a Popen for the supervisor."""

    def __init__(self, popen: subprocess.Popen[Any], unit: str, resolve_s: float = 5.0) -> None:
        self.popen = popen
        self.unit = unit
        self._pid = 0
        self._resolve_until = time.monotonic() + resolve_s
        self.returncode: int | None = None

    @property
    def pid(self) -> int:
        """The rank's own pid (the unit's MainPID); systemd-run's until the unit has one."""
        while not self._pid and self.popen.poll() is None and time.monotonic() < self._resolve_until:
            main = _show(self.unit, "MainPID").get("MainPID", "0")
            if main.isdigit() and int(main) > 0:
                self._pid = int(main)
                break
            time.sleep(0.02)
        return self._pid or self.popen.pid

    def _finish(self, code: int) -> int:
        if code != 0:
            got = _show(self.unit, "ExecMainCode", "ExecMainStatus")
            if got.get("ExecMainCode", "").isdigit() and int(got["ExecMainCode"]) in (_CLD_KILLED, _CLD_DUMPED):
                code = -int(got.get("ExecMainStatus", "0") or 0)  # as Popen reports a signal
            elif got.get("ExecMainStatus", "").isdigit() and int(got["ExecMainStatus"]) != 0:
                code = int(got["ExecMainStatus"])
            subprocess.run(["systemctl", "reset-failed", self.unit], capture_output=True, timeout=10, check=False)
        self.returncode = code
        return code

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        code = self.popen.poll()
        return None if code is None else self._finish(code)

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is not None:
            return self.returncode
        return self._finish(self.popen.wait(timeout))

    def stop_unit(self) -> None:
        """Everything in the rank's unit goes (its cgroup: strays included)."""
        subprocess.run(["systemctl", "stop", "--no-block", self.unit], capture_output=True, timeout=10, check=False)
