"""A job whose ranks' user cannot reach its program, script or working directory is refused when
it is submitted, with the directory in the way named, instead of failing rank by rank."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO, start_agent
from trainguard.agent.lifecycle.reach import Identity, R, X, blocker, program_blocker
from trainguard.agent.recovery.service import default_memory_root
from trainguard.agent.safefs import agent_acl

NOBODY = pwd.getpwnam("nobody")
WHO = Identity(NOBODY.pw_uid, frozenset({NOBODY.pw_gid}))


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A directory every user can enter (pytest's tmp_path is root's 0700)."""
    path = Path(tempfile.mkdtemp(prefix="tg-reach-", dir="/tmp"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)
    shutil.rmtree(default_memory_root(str(path / "agent")), ignore_errors=True)


def _tool(where: Path, mode: int = 0o755) -> Path:
    where.mkdir(parents=True, exist_ok=True)
    tool = where / "tool.sh"
    tool.write_text("#!/bin/sh\nexit 0\n")
    tool.chmod(mode)
    return tool


def test_a_private_directory_on_the_way_is_named(open_dir: Path) -> None:
    private = open_dir / "private"
    tool = _tool(private)
    private.chmod(0o700)
    assert blocker(str(tool), WHO, X) == f"{private} is 0700 root:root"
    private.chmod(0o711)
    assert blocker(str(tool), WHO, X) is None
    assert blocker(str(tool), Identity(0, frozenset({0})), X) is None


def test_a_link_into_a_private_directory_is_followed_to_it(open_dir: Path) -> None:
    private = open_dir / "private"
    tool = _tool(private)
    private.chmod(0o700)
    (open_dir / "bin").mkdir()
    (open_dir / "bin" / "tool").symlink_to(tool)
    assert blocker(str(open_dir / "bin" / "tool"), WHO, X) == f"{private} is 0700 root:root"


def test_a_script_needs_read_as_well_as_exec_and_an_acl_gets_the_benefit_of_the_doubt(open_dir: Path) -> None:
    tool = _tool(open_dir / "bin", mode=0o711)
    assert program_blocker(str(tool), None, WHO) == f"{tool} is 0711 root:root"
    assert program_blocker("tool.sh", str(open_dir / "bin"), WHO) == f"{tool} is 0711 root:root"
    assert blocker(str(tool), WHO, X) is None  # a binary needs x alone
    private = open_dir / "acl"
    inside = _tool(private)
    private.chmod(0o700)
    assert blocker(str(inside), WHO, X) == f"{private} is 0700 root:root"
    try:  # user:nobody:--x on the directory: the mode bits alone no longer tell
        os.setxattr(private, "system.posix_acl_access", agent_acl(NOBODY.pw_uid, 0o7, 0, 0))
    except OSError as exc:
        pytest.fail(f"this filesystem takes no ACL ({exc}); the agent's memory tier relies on them too")
    assert blocker(str(inside), WHO, X) is None
    assert blocker(str(open_dir / "missing" / "tool"), WHO, R) == f"{open_dir / 'missing'}: No such file or directory"


def test_the_agent_refuses_a_job_its_rank_user_cannot_start(open_dir: Path) -> None:
    agent = start_agent(open_dir / "agent", config='[collectors]\nebpf = false\ngpu = false\n[launcher]\nuser = "nobody"\n'
                        "[recovery]\nwarm_launcher = false\n")
    try:
        private = open_dir / "private"
        tool = _tool(private)
        private.chmod(0o700)
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        run = [sys.executable, "-m", "trainguard", "run", "--state-dir", str(agent.state_dir), "--nproc", "1", "--"]
        refused = subprocess.run([*run, str(tool)], capture_output=True, text=True, env=env, timeout=60, check=False)
        assert refused.returncode != 0
        lines = refused.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("trainguard: "), refused.stderr
        assert f"launcher.user nobody cannot start this job's ranks: {private} is 0700 root:root" in lines[0]
        private.chmod(0o755)
        started = subprocess.run([*run, str(tool)], capture_output=True, text=True, env=env, timeout=120, check=False)
        assert started.returncode == 0, started.stdout + started.stderr + agent.log()[-2000:]
    finally:
        agent.stop()
