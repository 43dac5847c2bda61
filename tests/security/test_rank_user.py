"""Ranks run as ``launcher.user`` in both launchers, with and without a job cgroup: read from inside
the rank (its euid, egid, groups and capabilities), as the job's own code would see them."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from trainguard.agent.lifecycle.cgroups import CgroupError, JobCgroups
from trainguard.agent.lifecycle.jobs import JobSpec
from trainguard.agent.lifecycle.launcher import Launcher
from trainguard.agent.lifecycle.ranks import LaunchContext, RankProcess

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                                reason="dropping to another user needs root and setpriv")

NOBODY = pwd.getpwnam("nobody")
PROBE = """\
import os
caps = next(line.split()[1] for line in open("/proc/self/status") if line.startswith("CapEff"))
print(f"euid={os.geteuid()} egid={os.getegid()} groups={sorted(os.getgroups())} caps={caps} "
      f"home={os.environ.get('HOME')} preload={os.environ.get('LD_PRELOAD', '')}", flush=True)
"""


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory the rank's user can enter (pytest's own tmp_path is root's, 0700)."""
    path = Path(tempfile.mkdtemp(prefix="tg-rank-user-", dir="/tmp"))
    path.chmod(0o755)
    (path / "probe.py").write_text(PROBE)
    (path / "probe.py").chmod(0o644)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _cgroups() -> JobCgroups | None:
    try:
        return JobCgroups.detect(parent=f"trainguard-test-{uuid.uuid4().hex[:8]}")
    except CgroupError:
        return None


def _run(launcher: Launcher, spec: JobSpec, ctx: LaunchContext) -> list[str]:
    ranks: list[RankProcess] = launcher.start(spec, ctx, 1)
    try:
        codes = [r.popen.wait(timeout=120) for r in ranks]
    finally:
        launcher.stop(ranks, 2.0, hard=True)
    logs = [Path(r.log_path).read_text() for r in ranks]
    assert codes == [0] * len(ranks), logs
    return logs


@pytest.mark.parametrize("mode", ["cold", "warm"])
@pytest.mark.parametrize("with_cgroup", [False, True])
def test_ranks_run_as_the_configured_user(shared_dir: Path, mode: str, with_cgroup: bool) -> None:
    cgroups = _cgroups() if with_cgroup else None
    if with_cgroup and cgroups is None:
        pytest.skip("no usable cgroup hierarchy here (the cgroup-less case runs the same checks)")
    launcher = Launcher(mode=mode, cgroups=cgroups)  # type: ignore[arg-type]
    job = f"user-{mode}-{int(with_cgroup)}"
    logs_dir = shared_dir / "jobs" / job
    ctx = LaunchContext(telemetry_socket=str(shared_dir / "none.sock"), plan_path=str(shared_dir / "plan.json"),
                        log_dir=str(logs_dir), user="nobody")
    spec = JobSpec(job, 2, command=[sys.executable, str(shared_dir / "probe.py")], cwd=str(shared_dir))
    try:
        logs = _run(launcher, spec, ctx)
        if mode == "warm":
            assert job in launcher.zygotes, "the warm launcher was not used"
    finally:
        launcher.close_job(job)
        if cgroups is not None:
            cgroups.close()
    for log in logs:
        assert (f"euid={NOBODY.pw_uid} egid={NOBODY.pw_gid} groups=[] caps=0000000000000000 "
                f"home={NOBODY.pw_dir}") in log, log


def test_a_cold_rank_joins_its_cgroup_before_it_drops_to_the_user(shared_dir: Path) -> None:
    """The join needs root: a rank that dropped first could not write ``cgroup.procs`` (exit 126)."""
    cgroups = _cgroups()
    if cgroups is None:
        pytest.skip("no usable cgroup hierarchy here (test_ranks_run_as_the_configured_user checks the user)")
    launcher = Launcher(mode="cold", cgroups=cgroups)
    ctx = LaunchContext(telemetry_socket="", plan_path="", log_dir=str(shared_dir / "jobs" / "joined"), user="nobody")
    spec = JobSpec("joined", 1, command=["/bin/sh", "-c", "cat /proc/self/cgroup; id -u; sleep 30"], cwd=str(shared_dir))
    ranks = launcher.start(spec, ctx, 1)
    try:
        cg = launcher.job_cgroups["joined"]
        deadline = time.monotonic() + 30
        while ranks[0].pid not in cg.pids() and time.monotonic() < deadline and ranks[0].popen.poll() is None:
            time.sleep(0.05)
        assert ranks[0].pid in cg.pids(), Path(ranks[0].log_path).read_text()
        # Joined first, as root; setpriv then becomes nobody in the same process: wait for that.
        while os.stat(f"/proc/{ranks[0].pid}").st_uid != NOBODY.pw_uid and time.monotonic() < deadline:
            time.sleep(0.05)
        assert os.stat(f"/proc/{ranks[0].pid}").st_uid == NOBODY.pw_uid
    finally:
        launcher.stop(ranks, 2.0, hard=True)
        launcher.close_job("joined")
        cgroups.close()


def test_a_jobs_ld_preload_never_loads_into_what_runs_as_root(shared_dir: Path) -> None:
    """A job asking for ``LD_PRELOAD`` gets it in its rank, but the join shell and setpriv, which
    run as root, never load it: the loader complains once, for the rank's own exec (the rank's
    shell uses only builtins), where root's programs would each have added a complaint."""
    cgroups = _cgroups()
    launcher = Launcher(mode="cold", cgroups=cgroups)
    ctx = LaunchContext(telemetry_socket="", plan_path="", log_dir=str(shared_dir / "jobs" / "preload"), user="nobody")
    bogus = f"/nonexistent-{uuid.uuid4().hex[:6]}/evil.so"
    script = 'echo "preload=$LD_PRELOAD"; while read -r k v rest; do [ "$k" = "Uid:" ] && echo "uid=$v"; done < /proc/self/status; exit 0'
    spec = JobSpec("preload", 1, command=["/bin/sh", "-c", script], cwd=str(shared_dir), env={"LD_PRELOAD": bogus})
    try:
        (log,) = _run(launcher, spec, ctx)
    finally:
        launcher.close_job("preload")
        if cgroups is not None:
            cgroups.close()
    assert f"preload={bogus}" in log and f"uid={NOBODY.pw_uid}" in log, log
    assert log.count(bogus) == 2, log  # the loader's one complaint (the rank's own exec) and the echo


def test_an_unknown_user_fails_the_launch_saying_so(shared_dir: Path) -> None:
    launcher = Launcher(mode="cold")
    ctx = LaunchContext(telemetry_socket="", plan_path="", log_dir=str(shared_dir / "x"), user="no-such-user-tg")
    with pytest.raises(ValueError, match="launcher.user: no user 'no-such-user-tg'"):
        launcher.start(JobSpec("x", 1, command=["true"]), ctx, 1)
    assert not subprocess.run(["pgrep", "-f", "no-such-user-tg"], capture_output=True).stdout


def test_the_agent_runs_a_jobs_ranks_as_launcher_user(agent_factory: Any, shared_dir: Path) -> None:
    """The whole path, as an operator configures it: ``[launcher] user = "nobody"`` in the agent's
    config, a job submitted over the control socket, the warm launcher (the default here)."""
    agent = agent_factory(config='[collectors]\nebpf = false\ngpu = false\n[launcher]\nuser = "nobody"\n')
    client = agent.client()
    client.submit_job({"job": "as-user", "nproc": 2, "command": [sys.executable, str(shared_dir / "probe.py")],
                       "cwd": str(shared_dir)})
    deadline = time.monotonic() + 120
    while client.job("as-user")["state"] not in ("succeeded", "failed") and time.monotonic() < deadline:
        time.sleep(0.1)
    logs = [(agent.state_dir / "jobs" / "as-user" / f"rank{r}.log").read_text() for r in (0, 1)]
    assert client.job("as-user")["state"] == "succeeded", logs
    for log in logs:
        assert f"euid={NOBODY.pw_uid} egid={NOBODY.pw_gid} groups=[] caps=0000000000000000" in log, log
