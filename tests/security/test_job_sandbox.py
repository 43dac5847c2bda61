"""A job spec may only tighten its ranks' units; job names cannot nest one job's slice in
another's; a rank unit's environment reaches it through a root-only file, not a command line."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from trainguard.agent.api.client import ApiClientError
from trainguard.agent.lifecycle.cgroups import JobCgroups
from trainguard.agent.lifecycle.jobs import JobSpec, JobSpecError
from trainguard.agent.lifecycle.launcher import Launcher
from trainguard.agent.lifecycle.ranks import LaunchContext
from trainguard.agent.lifecycle.units import (
    RANK_SANDBOX,
    env_file_text,
    escape,
    run_prefix,
    slice_name,
    unit_name,
)

REFUSED = [
    "User=root", "Group=root", "DynamicUser=no", "SupplementaryGroups=wheel", "AmbientCapabilities=CAP_SYS_ADMIN",
    "CapabilityBoundingSet=CAP_SYS_ADMIN", "NoNewPrivileges=no", "Delegate=yes", "ExecStartPre=/bin/sh -c id",
    "ExecStopPost=/tmp/x", "DeviceAllow=/dev/sda rw", "DevicePolicy=auto", "ProtectSystem=no",
    "PrivateTmp=false", "RestrictSUIDSGID=0", "BindPaths=/etc:/data", "Environment=LD_PRELOAD=/tmp/x.so",
    "OOMScoreAdjust=-1000", "SecureBits=keep-caps", "KillMode=none", "RootDirectory=/srv", "MemoryMax=",
]
ALLOWED = [
    "CPUQuota=150%", "CPUWeight=50", "MemoryMax=8G", "MemoryHigh=6G", "TasksMax=512", "IOWeight=10", "Nice=5",
    "CPUAffinity=0-3", "ProtectSystem=strict", "ProtectHome=read-only", "PrivateTmp=yes", "PrivateNetwork=yes",
    "RestrictAddressFamilies=AF_INET AF_INET6 AF_UNIX", "NoNewPrivileges=yes", "ReadWritePaths=/data",
    "LimitMEMLOCK=infinity",
]


@pytest.mark.parametrize("prop", REFUSED)
def test_a_job_may_not_loosen_or_choose_its_units_privileges(prop: str) -> None:
    name = prop.split("=", 1)[0]
    with pytest.raises(JobSpecError) as got:
        JobSpec.from_dict({"job": "j", "nproc": 1, "unit_properties": [prop]})
    assert got.value.key == "unit_properties" and name in str(got.value), got.value


def test_limits_and_tightening_settings_are_accepted() -> None:
    spec = JobSpec.from_dict({"job": "j", "nproc": 1, "unit_properties": ALLOWED})
    assert spec.unit_properties == ALLOWED


@pytest.mark.parametrize("env", [{"A=B": "x"}, {"A\x00": "x"}, {"X": "a\x00b"}, {"": "x"}])
def test_a_job_env_must_be_plain_variables(env: dict[str, str]) -> None:
    with pytest.raises(JobSpecError, match="env"):
        JobSpec.from_dict({"job": "j", "nproc": 1, "env": env})


def test_the_api_refuses_user_root_with_a_400_naming_it(agent_factory: Any) -> None:
    """From outside, as a member of the socket's group would ask: the job never exists."""
    agent = agent_factory(config="[collectors]\nebpf = false\ngpu = false\n")
    client = agent.client()
    for prop in ("User=root", "AmbientCapabilities=CAP_SYS_ADMIN", "Delegate=yes"):
        with pytest.raises(ApiClientError) as got:
            client.submit_job({"job": "evil", "nproc": 1, "command": ["true"], "unit_properties": [prop]})
        assert got.value.status == 400 and prop.split("=")[0] in got.value.message, got.value
    assert "evil" not in {j["job"] for j in client.status()["jobs"]}


# --- names ----------------------------------------------------------------------------------

def _slice_parents(name: str) -> list[str]:
    """The slices systemd nests ``name`` in: one per unescaped '-' prefix (systemd.slice(5))."""
    stem = name.removesuffix(".slice")
    parts = stem.split("-")
    return [f"{'-'.join(parts[:i])}.slice" for i in range(1, len(parts))]


def test_jobs_a_and_a_dash_b_get_disjoint_slices_and_units() -> None:
    a, ab = slice_name("a"), slice_name("a-b")
    assert a not in _slice_parents(ab) and ab not in _slice_parents(a)
    assert _slice_parents(ab) == ["trainguard.slice"] == _slice_parents(a)
    assert unit_name("a", 1, 0) != unit_name("a-b", 1, 0)
    if shutil.which("systemd-escape"):
        for job in ("a-b", "x.y_z-1", "a--b"):
            out = subprocess.run(["systemd-escape", job], capture_output=True, text=True, check=True).stdout.strip()
            assert escape(job) == out


def test_jobs_a_and_a_dash_b_get_disjoint_cgroups(tmp_path: Path) -> None:
    root = tmp_path / "fs"
    for name in ("cpu", "cpuacct", "memory", "pids"):
        (root / name).mkdir(parents=True)
        (root / name / "cgroup.procs").write_text("")
    own = tmp_path / "proc-self-cgroup"
    own.write_text("4:memory:/\n3:cpu:/\n2:cpuacct:/\n1:pids:/\n")
    groups = JobCgroups.detect(root, own)
    a, ab = groups.for_job("a"), groups.for_job("a-b")
    a.limit(cpus=0.5, memory_max=64 << 20)
    ab.limit(cpus=2, memory_max=128 << 20)
    for c in ("cpu", "memory"):
        assert a.dirs[c] not in ab.dirs[c].parents and ab.dirs[c] not in a.dirs[c].parents
    assert (a.dirs["memory"] / "memory.limit_in_bytes").read_text() == f"{64 << 20}\n"
    assert (ab.dirs["memory"] / "memory.limit_in_bytes").read_text() == f"{128 << 20}\n"


# --- the units path: the environment file ---------------------------------------------------

def _parse_env_file(text: str) -> dict[str, str]:
    """systemd's EnvironmentFile= reading of double-quoted values (src/basic/env-file.c)."""
    out: dict[str, str] = {}
    i = 0
    while i < len(text):
        eq = text.index("=", i)
        key = text[i:eq]
        assert text[eq + 1] == '"'
        j, value = eq + 2, []
        while text[j] != '"':
            if text[j] == "\\":
                nxt = text[j + 1]
                if nxt in '"\\`$':
                    value.append(nxt)
                elif nxt != "\n":
                    value += ["\\", nxt]
                j += 2
                continue
            value.append(text[j])
            j += 1
        out[key] = "".join(value)
        assert text[j + 1] == "\n"
        i = j + 2
    return out


def test_the_env_file_syntax_keeps_every_value_whole() -> None:
    env = {"HF_TOKEN": 'hf_"q\\uo$te`d\nline2', "PLAIN": "x y", "EMPTY": ""}
    assert _parse_env_file(env_file_text(env)) == env
    assert _parse_env_file(env_file_text({**env, "BASH_FUNC_f%%": "() { id; }"})) == env  # systemd would refuse it


def test_run_prefix_puts_no_environment_on_the_command_line() -> None:
    argv = run_prefix("u.service", "j", log_path="/l", cwd="/", env_file="/run/x.env", properties=["MemoryMax=1G"])
    assert not any(a.startswith(("--setenv", "-E")) for a in argv)
    assert "EnvironmentFile=/run/x.env" in argv
    for prop in RANK_SANDBOX:  # with and without launcher.user
        assert prop in argv and prop in run_prefix("u.service", "j", log_path="/l", cwd="/", env_file="/e", user="nobody")
    assert argv.index("MemoryMax=1G") > argv.index("NoNewPrivileges=yes")  # the job's come after the sandbox


FAKE_SYSTEMD_RUN = """#!/bin/sh
# Records its command line, then waits as a unit's rank would while someone scans /proc.
printf '%s\\n' "$@" > "$TG_FAKE_ARGV"
exec sleep 3
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="the environment file is root's: needs root to check its owner")
def test_a_units_secret_env_goes_to_a_0600_file_never_to_a_command_line(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    secret = f"hf_{uuid.uuid4().hex}"
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    for name, text in (("systemd-run", FAKE_SYSTEMD_RUN), ("systemctl", "#!/bin/sh\nexit 0\n")):
        (fake_bin / name).write_text(text)
        (fake_bin / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake_bin}:{os.environ['PATH']}")
    monkeypatch.setenv("TG_FAKE_ARGV", str(tmp_path / "argv.txt"))
    launcher = Launcher(mode="cold", units=True)
    run_dir = tmp_path / "run"
    ctx = LaunchContext(telemetry_socket="", plan_path="", log_dir=str(tmp_path / "jobs" / "sec"), run_dir=str(run_dir))
    spec = JobSpec("sec", 1, command=[sys.executable, "-c", "pass"], env={"HF_TOKEN": secret})
    ranks = launcher.start(spec, ctx, 1)
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "argv.txt").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        seen = [p for p in Path("/proc").glob("[0-9]*") if _cmdline_has(p, secret)]
        assert seen == [], "the secret is on a command line"
        argv = (tmp_path / "argv.txt").read_text()
        assert secret not in argv and "EnvironmentFile=" in argv
        env_file = Path(argv.split("EnvironmentFile=", 1)[1].split("\n", 1)[0])
        st = env_file.lstat()
        assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == 0
        assert stat.S_IMODE(env_file.parent.stat().st_mode) == 0o700 and run_dir in env_file.parents
        assert _parse_env_file(env_file.read_text())["HF_TOKEN"] == secret
    finally:
        launcher.stop(ranks, 5.0)
        launcher.close_job("sec")
    assert not env_file.exists() and not env_file.parent.exists(), "the job's secrets outlived it"


def _cmdline_has(proc: Path, secret: str) -> bool:
    try:
        return secret.encode() in (proc / "cmdline").read_bytes()
    except OSError:
        return False
