"""Ranks of ``launcher.user`` that use the Python API (the embedded trainer) reach what is theirs
through a root agent: the telemetry socket (through its group), their plan file, their memory-tier
and snapshot directories; and nothing else: the control socket refuses them, the agent's
directories cannot be listed, and a datagram they forge for a job is still a counted drop."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.trainjobs import tiny_config
from tests.conftest import REPO, RunningAgent, start_agent
from tests.helpers.telemetry import make_msg
from tests.helpers.waiting import wait_for
from trainguard.agent.recovery.service import default_memory_root
from trainguard.trainer.data import build_corpus

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                                reason="ranks of another user need a root agent and setpriv")

NOBODY = pwd.getpwnam("nobody")
# Root as the agent's unit leaves it: no capability to read or own another user's files.
NO_DAC = ["setpriv", "--bounding-set=-dac_override,-dac_read_search,-fowner", "--"]
USER_CONFIG = '[collectors]\nebpf = false\ngpu = false\n[launcher]\nuser = "nobody"\n'
CORPUS_BYTES = 2_000_000


@pytest.fixture
def base() -> Iterator[Path]:
    """A directory every user can enter (pytest's tmp_path is root's 0700): the agent's state dir
    goes inside, as ``/var/lib`` holds ``/var/lib/trainguard``."""
    path = Path(tempfile.mkdtemp(prefix="tg-rank-reach-", dir="/tmp"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)
    shutil.rmtree(default_memory_root(str(path / "agent")), ignore_errors=True)


@pytest.fixture
def agents() -> Iterator[Callable[..., RunningAgent]]:
    started: list[RunningAgent] = []

    def start(state_dir: Path, config: str = USER_CONFIG, prefix: list[str] | None = None) -> RunningAgent:
        agent = start_agent(state_dir, config=config, prefix=prefix)
        started.append(agent)
        return agent

    yield start
    for agent in started:
        if agent.proc.poll() is None:
            agent.stop()


def as_nobody(action: Callable[[], int]) -> int:
    """Run ``action`` in a forked child that became nobody (no supplementary groups), as a rank's
    code is; its return value is the child's exit status (an exception: 99)."""
    pid = os.fork()
    if pid == 0:
        code = 99
        try:
            os.setgroups([])
            os.setgid(NOBODY.pw_gid)
            os.setuid(NOBODY.pw_uid)
            code = action()
        finally:
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def connect_status(path: str, kind: int) -> int:
    """0: connected; 13: refused (EACCES); another errno otherwise."""
    with socket.socket(socket.AF_UNIX, kind) as s:
        try:
            s.connect(path)
        except OSError as exc:
            return exc.errno or 98
    return 0


def telemetry(job: str, step: int) -> bytes:
    return make_msg(job, rank=1, step=step, pid=os.getpid()).encode()


def scrape_value(agent: RunningAgent, prefix: str) -> float:
    import urllib.request

    with urllib.request.urlopen(agent.metrics_url(), timeout=10) as resp:
        text = resp.read().decode()
    rows = [ln for ln in text.splitlines() if ln.startswith(prefix)]
    return float(rows[0].split()[-1]) if rows else 0.0


def test_the_rank_user_reaches_telemetry_and_plans_but_never_the_control_socket(base: Path, agents: Any) -> None:
    agent = agents(base / "agent")
    run = agent.state_dir / "run"
    tele = os.stat(agent.telemetry_socket)
    assert (stat.S_IMODE(tele.st_mode), tele.st_uid, tele.st_gid) == (0o660, 0, NOBODY.pw_gid)
    ctl = os.stat(agent.control_socket)
    assert ctl.st_gid != NOBODY.pw_gid and stat.S_IMODE(ctl.st_mode) & 0o007 == 0
    for d in (agent.state_dir, run, run / "plans"):
        assert stat.S_IMODE(os.stat(d).st_mode) & 0o007 == 0o001, d  # others may enter, never list
    agent.client().submit_job({"job": "waits", "nproc": 1, "command": ["sleep", "30"], "cwd": str(base)})
    plan = run / "plans" / "waits.json"
    wait_for(plan.exists, 30, "the job's plan file")

    assert as_nobody(lambda: connect_status(agent.control_socket, socket.SOCK_STREAM)) == 13
    assert as_nobody(lambda: connect_status(agent.telemetry_socket, socket.SOCK_DGRAM)) == 0
    assert as_nobody(lambda: 0 if json.loads(plan.read_bytes())["version"] >= 1 else 1) == 0

    def lists(path: Path) -> int:
        try:
            os.listdir(path)
        except PermissionError:
            return 13
        return 0

    for d in (agent.state_dir, run, run / "plans", agent.state_dir / "jobs", agent.state_dir / "events"):
        assert as_nobody(lambda d=d: lists(d)) == 13, d  # type: ignore[misc]

    def writes(path: Path) -> int:
        try:
            path.write_text("x")
        except PermissionError:
            return 13
        return 0

    for target in (run / "plans" / "planted.json", run / "planted", plan):
        assert as_nobody(lambda t=target: writes(t)) == 13, target  # type: ignore[misc]
    agent.client().stop_job("waits")


def test_a_rank_user_in_the_agents_group_is_refused_naming_the_key(base: Path) -> None:
    """An agent whose group is nobody's (started through setpriv) would hand the ranks' telemetry
    group to whoever may drive its control socket: it refuses to start, exit 2, naming the key."""
    state = base / "agent"
    state.mkdir()
    (state / "agent.toml").write_text(USER_CONFIG)
    res = subprocess.run(["setpriv", f"--regid={NOBODY.pw_gid}", "--clear-groups", "--", sys.executable, "-m",
                          "trainguard", "agent", "--state-dir", str(state), "--config", str(state / "agent.toml")],
                         capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert res.returncode == 2, res.stderr
    assert "launcher.user" in res.stderr and "control socket's group" in res.stderr, res.stderr
    assert not (state / "run" / "agent.sock").exists()


def test_launcher_user_root_is_refused_naming_the_key(base: Path) -> None:
    state = base / "agent"
    state.mkdir()
    (state / "agent.toml").write_text(USER_CONFIG.replace('"nobody"', '"root"'))
    res = subprocess.run([sys.executable, "-m", "trainguard", "agent", "--state-dir", str(state), "--config",
                          str(state / "agent.toml")], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert res.returncode == 2 and "launcher.user" in res.stderr and "uid 0" in res.stderr, res.stderr


def proc_uid(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            return int(line.split()[2])  # the effective uid
    raise AssertionError(f"no Uid line for {pid}")


def events_of(client: Any, kind: str, job: str) -> list[dict[str, Any]]:
    return [e for e in client.events(since=0, limit=5000)["events"] if e["kind"] == kind and e.get("job") == job]


@pytest.mark.slow
def test_the_embedded_trainer_runs_end_to_end_as_launcher_user(base: Path, agents: Any) -> None:
    """Two ranks of the embedded trainer as nobody, under an agent without CAP_DAC_* or CAP_FOWNER
    (as its unit runs it): their steps reach the agent's status through telemetry, a forged
    datagram for the job is still dropped, they read their plan and snapshot into their memory-tier
    directory, and a rank the test SIGKILLs is restored from the snapshot, which the agent could
    read only through the directory's ACL (the slots are 0640, nobody's)."""
    corpus = base / "corpus"
    build_corpus(str(corpus), CORPUS_BYTES)  # as root: nobody cannot read an interpreter's stdlib under /root
    for p in (corpus, *corpus.iterdir()):
        p.chmod(0o755 if p.is_dir() else 0o644)
    agent = agents(base / "agent", USER_CONFIG + "[agent]\ninterval_s = 0.2\n"
                   "[checkpoint]\nsnapshot_every = 1\nmemory_every = 50\nmemory_keep = 2\n",
                   prefix=NO_DAC)
    assert int(Path(f"/proc/{agent.proc.pid}/status").read_text().split("CapEff:")[1].split()[0], 16) & 0b1110 == 0
    client = agent.client()
    trainer = tiny_config(str(corpus), steps=300, parallel={"dp": 2}).to_dict()
    client.submit_job({"job": "as-nobody", "nproc": 2, "trainer": trainer})

    def ranks() -> dict[int, dict[str, Any]]:
        job = client.job("as-nobody")
        return {r["rank"]: r for r in job["ranks"]} if job["attempt"] == 1 else {}

    def telemetry_steps() -> list[int]:
        found = [r for j in client.status()["jobs"] if j["job"] == "as-nobody" for r in j["ranks"]]
        return [r["telemetry"]["step"] for r in found if r.get("telemetry")]

    steps = wait_for(lambda: (s := telemetry_steps()) and len(s) == 2 and min(s) >= 8 and s, 120,
                     "both ranks' telemetry past step 8")
    first = ranks()
    assert [proc_uid(first[r]["pid"]) for r in (0, 1)] == [NOBODY.pw_uid] * 2
    forged_before = scrape_value(agent, 'trainguard_telemetry_dropped_total{reason="forged"}')

    def forge() -> int:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.sendto(telemetry("as-nobody", 999_999), agent.telemetry_socket)
        return 0

    assert as_nobody(forge) == 0  # the socket takes it: the rank user is in its group
    wait_for(lambda: scrape_value(agent, 'trainguard_telemetry_dropped_total{reason="forged"}') >= forged_before + 1,
             30, "the forged datagram counted")
    assert max(telemetry_steps()) < 999_999

    memory = Path(default_memory_root(str(agent.state_dir)))
    slots = memory / ".snapshots" / "as-nobody"
    assert {p.name for p in slots.iterdir()} >= {"rank0.a", "rank1.a"}, list(slots.iterdir())
    assert all(p.stat().st_uid == NOBODY.pw_uid for p in slots.iterdir())

    os.kill(first[1]["pid"], signal.SIGKILL)
    again = wait_for(lambda: (j := client.job("as-nobody"))["attempt"] == 2 and len(j["ranks"]) == 2 and j, 60,
                     "the restarted ranks")
    # A restarted rank may be a spare the zygote forked ahead (root, CAP_SETUID only, waiting on its
    # pipe): it becomes nobody on taking its request, before any rank code runs, so the uids settle.
    wait_for(lambda: [proc_uid(r["pid"]) for r in again["ranks"]] == [NOBODY.pw_uid] * 2, 30,
             "the restarted ranks running as nobody")
    final = wait_for(lambda: (j := client.job("as-nobody"))["state"] in ("succeeded", "failed", "stopped") and j,
                     150, "the job to end")
    log0 = (agent.state_dir / "jobs" / "as-nobody" / "rank0.log").read_text()
    assert final["state"] == "succeeded" and final["restarts"] == 1, log0[-3000:]
    assert [r["exit_code"] for r in final["ranks"]] == [0, 0]
    selected = events_of(client, "restore_selected", "as-nobody")
    assert selected and selected[-1]["fields"]["tier"] == "snapshot", selected
    restored = selected[-1]["fields"]["step"]
    # The last step rank 0 finished before the kill: at most one step is lost.
    before, _, after = log0.partition(f"restored step {restored} from a snapshot")
    assert after, log0[-3000:]
    done = [json.loads(ln)["step"] for ln in before.splitlines() if ln.startswith('{"step"')]
    assert done and max(steps) <= max(done) and restored >= max(done) - 1, (restored, done[-3:])
    resumed = wait_for(lambda: events_of(client, "job_resumed", "as-nobody"), 15, "a job_resumed event")
    assert resumed[-1]["fields"]["restored_from"]["step"] == restored
    assert max(telemetry_steps()) == 300  # the restarted ranks report too
    # The DCP checkpoints the ranks wrote in their memory-tier directory, committed and listed by the agent.
    def memory_steps() -> set[int]:
        return {r["step"] for r in client.checkpoints("as-nobody") if r.get("tier") == "memory"}

    # ... and pruned by the agent to memory_keep, in a directory that is the ranks' user's.
    wait_for(lambda: memory_steps() == {250, 300}, 30, "the memory tier pruned to its newest two")
    assert not [e for e in client.events(since=0, limit=5000)["events"] if e["kind"] == "checkpoint_prune_failed"]
    assert (memory / "as-nobody").stat().st_uid == NOBODY.pw_uid


def test_a_corpus_nothing_could_be_read_for_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank user who cannot read the interpreter's standard library gets an error saying so, not
    an empty cache that fails later as "cannot mmap an empty file"."""
    from trainguard.trainer import data

    monkeypatch.setattr(data, "stdlib_files", lambda: (tmp_path / "unreadable.py",))
    monkeypatch.setattr(data, "stdlib_digest", lambda: "none")
    with pytest.raises(RuntimeError, match="could not be read by uid"):
        data.build_corpus(str(tmp_path / "cache"), 1000)
    assert not list((tmp_path / "cache").glob("*.u8"))


def test_the_agent_reads_what_the_rank_user_writes_in_its_job_dirs_only_through_their_acl(base: Path) -> None:
    """A job's memory-tier and snapshot directories, handed to its user, let root without
    CAP_DAC_* or CAP_FOWNER read a 0640 file the user writes there (a snapshot slot) and remove
    it, and no other user read a 0644 one (a checkpoint under umask 022); a directory handed over
    without the ACL, the contrast, does none of that."""
    from trainguard.agent.checkpoint.snapshots import SnapshotSet
    from trainguard.agent.safefs import dir_fd

    root = base / "memory"
    root.mkdir()
    owner = (NOBODY.pw_uid, NOBODY.pw_gid)
    SnapshotSet(str(root), "j").prepare(owner)
    with dir_fd(root, root / "j", create=True, owner=owner):
        pass
    bare = root / "bare"
    bare.mkdir()
    os.chown(bare, *owner)
    targets = [SnapshotSet(str(root), "j").dir, root / "j", bare]

    def write_all() -> int:
        os.umask(0o022)
        for d in targets:
            for name, mode in (("rank0.a", 0o640), ("shard.distcp", 0o644)):
                fd = os.open(d / name, os.O_WRONLY | os.O_CREAT, mode)
                os.write(fd, b"state")
                os.close(fd)
        return 0

    assert as_nobody(write_all) == 0
    readable = [subprocess.run([*NO_DAC, "cat", str(d / "rank0.a")], capture_output=True).returncode == 0
                for d in targets]
    assert readable == [True, True, False], readable
    assert all(stat.S_IMODE((d / "rank0.a").stat().st_mode) & 0o077 == 0o040 for d in targets)
    # The agent prunes there too (no CAP_FOWNER): only through the ACL.
    removed = [subprocess.run([*NO_DAC, "rm", str(d / "rank0.a")], capture_output=True).returncode == 0
               for d in targets]
    assert removed == [True, True, False], removed

    def other_user_reads(d: Path) -> int:
        pid = os.fork()
        if pid == 0:
            code = 99
            try:
                os.setgroups([])
                os.setgid(12345)
                os.setuid(12345)
                (d / "shard.distcp").read_bytes()
                code = 0
            except PermissionError:
                code = 13
            finally:
                os._exit(code)
        return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])

    assert [other_user_reads(d) for d in targets] == [13, 13, 0]
