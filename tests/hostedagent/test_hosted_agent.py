"""``trainguard run`` where no node agent runs, as a user without root: it hosts the agent itself.

Each test runs the command as a uid of its own that no account has (the tests run as root and give
it nothing), with a work directory and ``$XDG_RUNTIME_DIR`` of that uid; so every process left of
that uid after the command exits is one it failed to stop.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.waiting import wait_for

REPO = Path(__file__).resolve().parents[2]
API = REPO / "examples" / "ddp_api.py"

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(os.geteuid() != 0, reason="running the command as a second uid needs root "
                                 "(tests/lifecycle/test_run_command.py runs `trainguard run` as the caller)")]


def _user_python(uid: int) -> tuple[str, str]:
    """(an interpreter ``uid`` may execute, the PYTHONPATH that gives it this repo and the venv's
    packages): this one, or the system's of the same version where this one lies under a
    directory the uid may not enter."""
    site = sysconfig.get_paths()["purelib"]
    path = f"{REPO}{os.pathsep}{site}"
    try:
        ok = subprocess.run([sys.executable, "-c", "import torch"], user=uid, group=uid, extra_groups=[],
                            env={"PYTHONPATH": path}, capture_output=True, timeout=120).returncode == 0
    except PermissionError:
        ok = False
    if ok:
        return sys.executable, path
    system = shutil.which(f"python{sys.version_info.major}.{sys.version_info.minor}", path="/usr/bin:/usr/local/bin")
    if system is None:
        pytest.fail(f"uid {uid} can execute neither {sys.executable} nor a system python of this version")
    return system, path


@dataclass
class User:
    uid: int
    home: Path
    python: str
    pythonpath: str

    def env(self, **extra: str) -> dict[str, str]:
        return {"PATH": "/usr/bin:/bin", "HOME": str(self.home), "XDG_RUNTIME_DIR": str(self.home),
                "PYTHONPATH": self.pythonpath, "OMP_NUM_THREADS": "1", **extra}

    def run(self, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
        return subprocess.Popen([self.python, "-m", "trainguard", "run", *args], cwd=self.home, user=self.uid,
                                group=self.uid, extra_groups=[], env=env or self.env(), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)

    def processes(self) -> list[int]:
        """Live processes of this uid (zombies awaiting their reaper are not running)."""
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                st = os.stat(f"/proc/{entry}")
                with open(f"/proc/{entry}/stat") as fh:
                    state = fh.read().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if st.st_uid == self.uid and state != "Z":
                found.append(int(entry))
        return found


def _make_user(uid: int) -> Iterator[User]:
    home = Path(tempfile.mkdtemp(prefix=f"tg-hosted-{uid}-"))
    os.chown(home, uid, uid)
    shutil.copy(API, home / "train.py")
    os.chown(home / "train.py", uid, uid)
    user = User(uid, home, *_user_python(uid))
    try:
        yield user
    finally:
        for pid in user.processes():  # what a failed test left: never another test's (a uid of its own)
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(home, ignore_errors=True)
        shutil.rmtree(f"/dev/shm/trainguard-{uid}", ignore_errors=True)


@pytest.fixture
def user(request: pytest.FixtureRequest) -> Iterator[User]:
    # A uid per test: xdist runs tests of this module side by side.
    yield from _make_user(54_500 + sum(map(ord, request.node.name)) % 400)


def hosted(err: str) -> tuple[int, Path]:
    """(the hosted agent's pid, its state dir) from the command's note."""
    m = re.search(r"hosting one for this job \(pid (\d+), state (\S+),", err)
    assert m, err
    return int(m.group(1)), Path(m.group(2))


def events(state_dir: Path) -> list[dict[str, Any]]:
    lines = (state_dir / "events" / "events.jsonl").read_text().splitlines()
    return [json.loads(x) for x in lines if x.strip()]


def step_of(progress: Path) -> int:
    try:
        return int((progress / "step").read_text() or 0)
    except (OSError, ValueError):
        return 0


def rank_pid(progress: Path, rank: int) -> int | None:
    try:
        return int((progress / f"rank{rank}.pid").read_text())
    except (OSError, ValueError):
        return None


def test_a_killed_rank_resumes_from_the_hosted_agents_snapshot(user: User) -> None:
    progress = user.home / "progress"
    progress.mkdir()
    os.chown(progress, user.uid, user.uid)
    cmd = user.run("--nproc-per-node", "2", "train.py", "--steps", "150", "--step-sleep", "0.02",
                   "--progress", str(progress))
    wait_for(lambda: step_of(progress) >= 40 or cmd.poll() is not None, 120, "40 steps")
    assert cmd.poll() is None, cmd.communicate()
    victim = rank_pid(progress, 1)
    assert victim is not None
    done = step_of(progress)  # rank 0's steps done: the step running now is this one
    os.kill(victim, signal.SIGKILL)
    out, err = cmd.communicate(timeout=240)
    assert cmd.returncode == 0, err
    pid, state_dir = hosted(err)
    resumed = [int(m) for m in re.findall(r"\[rank0\]:resumed at step (\d+)", out)]
    assert len(resumed) == 1 and resumed[0] >= done - 1, (done, out)  # at most one step lost
    seen = events(state_dir)
    restored = [e for e in seen if e["kind"] == "restore_selected"]
    assert restored and restored[-1]["fields"]["step"] == resumed[0], restored
    # Said once each, on stderr and in the event log.
    for note in ("eBPF off: ", "cgroups off: ", "other users' processes off: "):
        assert sum(line.startswith(f"trainguard: {note}") for line in err.splitlines()) == 1, err
        assert sum(e["kind"] == "feature_off" and e["message"].startswith(note) for e in seen) == 1
    assert "Traceback" not in err
    # Nothing of the job or its agent runs on; the memory tier went with it.
    assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"
    assert user.processes() == []
    assert os.listdir(f"/dev/shm/trainguard-{user.uid}") == []
    assert oct(os.stat(state_dir).st_mode & 0o777) == "0o700" and os.stat(state_dir).st_uid == user.uid


def test_sigterm_stops_the_ranks_and_the_hosted_agent(user: User) -> None:
    progress = user.home / "progress"
    progress.mkdir()
    os.chown(progress, user.uid, user.uid)
    cmd = user.run("--nproc-per-node", "2", "train.py", "--steps", "100000", "--step-sleep", "0.02",
                   "--progress", str(progress))
    wait_for(lambda: step_of(progress) >= 5 or cmd.poll() is not None, 120, "5 steps")
    assert cmd.poll() is None, cmd.communicate()
    ranks = [rank_pid(progress, r) for r in (0, 1)]
    cmd.send_signal(signal.SIGTERM)
    out, err = cmd.communicate(timeout=120)
    assert cmd.returncode == 128 + signal.SIGTERM, err
    hosted(err)
    assert None not in ranks
    wait_for(lambda: not user.processes(), 30, "no process of the user left")


def test_a_second_run_gets_an_agent_of_its_own(user: User) -> None:
    """Two commands of one user at once: each hosts its own agent (own state dir, sockets, memory tier)."""
    args = ("--nproc-per-node", "1", "train.py", "--steps", "40", "--step-sleep", "0.05")
    first, second = user.run(*args), user.run(*args)
    (_, err1), (_, err2) = first.communicate(timeout=180), second.communicate(timeout=180)
    assert first.returncode == 0 and second.returncode == 0, (err1, err2)
    assert hosted(err1)[1] != hosted(err2)[1]
    assert user.processes() == []


def test_no_agent_says_once_that_snapshots_are_off(user: User) -> None:
    cmd = user.run("--no-agent", "--nproc-per-node", "1", "train.py", "--steps", "3")
    out, err = cmd.communicate(timeout=180)
    assert cmd.returncode == 0, err
    notes = [line for line in err.splitlines() if line.startswith("trainguard: ")]
    assert len(notes) == 1 and "no snapshots, restores or hang verdicts" in notes[0], err
    assert "hosting" not in err


def test_a_running_agent_named_by_trainguard_state_dir_is_used(agent_factory: Any, tmp_path: Path) -> None:
    agent = agent_factory()
    script = tmp_path / "show.py"
    script.write_text("import os\nprint(os.environ['TRAINGUARD_STATE_DIR'], os.environ['TRAINGUARD_JOB'])\n")
    res = subprocess.run([sys.executable, "-m", "trainguard", "run", "--job", "viaenv", str(script)], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(REPO), "TRAINGUARD_STATE_DIR": str(agent.state_dir)})
    assert res.returncode == 0, res.stderr
    assert "hosting" not in res.stderr
    assert res.stdout.strip() == f"[rank0]:{agent.state_dir} viaenv"
    assert agent.client().job("viaenv")["state"] == "succeeded"


def test_run_killed_outright_takes_its_agent_and_ranks_along(user: User) -> None:
    """SIGKILL leaves no handler to run: the kernel's parent-death signal stops the hosted agent,
    which stops the ranks."""
    progress = user.home / "progress"
    progress.mkdir()
    os.chown(progress, user.uid, user.uid)
    cmd = user.run("--nproc-per-node", "2", "train.py", "--steps", "100000", "--step-sleep", "0.02",
                   "--progress", str(progress))
    wait_for(lambda: step_of(progress) >= 5 or cmd.poll() is not None, 120, "5 steps")
    assert cmd.poll() is None, cmd.communicate()
    cmd.kill()
    cmd.communicate(timeout=60)
    wait_for(lambda: not user.processes(), 60, "no process of the user left")


def test_a_private_dir_planted_by_another_user_is_refused(user: User, tmp_path: Path) -> None:
    """Another identity's symlink where the hosted agent's private root belongs: one line, no agent,
    and nothing written through the link."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (user.home / "trainguard").symlink_to(elsewhere)  # made by root, not the user
    cmd = user.run("--nproc-per-node", "1", "train.py", "--steps", "3")
    out, err = cmd.communicate(timeout=120)
    assert cmd.returncode == 1 and err.count("\n") == 1, err
    assert err.startswith("trainguard: no private directory for an agent of this job") and "Traceback" not in err
    assert list(elsewhere.iterdir()) == []
    assert user.processes() == []
