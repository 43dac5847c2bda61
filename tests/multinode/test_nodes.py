"""``trainguard run --nnodes`` on two nodes (network namespaces) meeting at a c10d rendezvous:
a rank killed on one node restarts both nodes' ranks together; with ``--nnodes 1:2`` a node
lost for good lets the other go on alone; bad flags say one line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.helpers.events import memory_checkpoints
from tests.helpers.waiting import wait_for
from tests.multinode.nodes import REPO, Nodes, trainguard_run

PLAIN = str(REPO / "tests" / "multinode" / "train_plain.py")
API = str(REPO / "tests" / "multinode" / "train_api.py")


def tails(logs: tuple[Path, ...] | list[Path]) -> Callable[[], str]:
    """The end of each launcher's log, for a wait that times out."""
    return lambda: "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in logs if p.exists())


def started(out: Path, rank: int, restart: int) -> dict | None:
    path = out / f"start-r{rank}-c{restart}"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def step_of(out: Path, rank: int, restart: int) -> int:
    try:
        return int((out / f"step-r{rank}-c{restart}").read_text() or -1)
    except (OSError, ValueError):
        return -1


def finish(proc: subprocess.Popen[bytes], log: Path, timeout: float = 60.0) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"launcher still running:\n{log.read_text()[-3000:]}") from None


def steps_of(out: Path, rank: int) -> list[tuple[int, int, str]]:
    lines = (out / f"steps-r{rank}").read_text().splitlines() if (out / f"steps-r{rank}").exists() else []
    return [(int(c), int(s), d) for c, s, d in (line.split() for line in lines if len(line.split()) == 3)]


@pytest.mark.xdist_group("multinode")
def test_rank_kill_under_node_agents_resumes_both_nodes_from_snapshots(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    logs = (tmp_path / "a.log", tmp_path / "b.log")
    steps = 60
    with Nodes(tmp_path, ["node-a", "node-b"]) as nodes:
        a, b = nodes["node-a"], nodes["node-b"]
        states = [a.start_agent(tmp_path), b.start_agent(tmp_path)]
        flags = ("--nnodes", "2", "--nproc-per-node", "2", "--rdzv-id", "api1", "--max-restarts", "2", API, str(out),
                 str(steps))
        pa = trainguard_run(a, a, "--state-dir", str(states[0]), *flags, log=logs[0])
        pb = trainguard_run(b, a, "--state-dir", str(states[1]), *flags, log=logs[1])
        wait_for(lambda: all(any(s >= 15 for _c, s, _d in steps_of(out, r)) for r in range(4)),
                 60, "step 15 everywhere", interval=0.1, diagnose=tails(logs))
        victim = started(out, 2, 0)
        assert victim is not None and victim["GROUP_RANK"] == "1"
        os.kill(victim["pid"], signal.SIGKILL)
        wait_for(lambda: all(started(out, r, 1) for r in range(4)), 60, "restart 1 on every rank", interval=0.1,
                 diagnose=tails(logs))
        assert finish(pa, logs[0]) == 0, logs[0].read_text()[-3000:]
        assert finish(pb, logs[1]) == 0, logs[1].read_text()[-3000:]
    lines = [steps_of(out, r) for r in range(4)]
    envs = [started(out, r, 1) for r in range(4)]
    # The last step every rank finished before the kill; the ranks resume at most one step before it ends.
    last = min(max(s for c, s, _d in rank_lines if c == 0) for rank_lines in lines)
    resumed = {e["start"] for e in envs}
    assert len(resumed) == 1, envs
    start = resumed.pop()
    assert last <= start <= last + 2, (last, start)
    for rank, (env, rank_lines) in enumerate(zip(envs, lines, strict=True)):
        assert env["TORCHELASTIC_RESTART_COUNT"] == "1" and env["TRAINGUARD_ATTEMPT"] == "2"
        assert env["RANK"] == str(rank) and env["WORLD_SIZE"] == "4"
        # Restored state is the state after step start - 1 of the first attempt: nothing trained twice on it.
        before = {s: d for c, s, d in rank_lines if c == 0}
        assert env["digest"] == before[start - 1], (rank, start)
        after = [s for c, s, _d in rank_lines if c == 1]
        assert after == list(range(start, steps)), (rank, after[:5])


@pytest.mark.xdist_group("multinode")
def test_no_agent_rank_kill_restarts_both_nodes(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    logs = (tmp_path / "a.log", tmp_path / "b.log")
    with Nodes(tmp_path, ["node-a", "node-b"]) as nodes:
        a, b = nodes["node-a"], nodes["node-b"]
        flags = ("--no-agent", "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-id", "plain1", "--max-restarts", "2",
                 PLAIN, str(out), "60")
        pa = trainguard_run(a, a, *flags, log=logs[0])
        pb = trainguard_run(b, a, *flags, log=logs[1])
        wait_for(lambda: all(step_of(out, r, 0) >= 10 for r in range(4)), 60, "step 10 everywhere", interval=0.1,
                 diagnose=tails(logs))
        victim = started(out, 2, 0)
        assert victim is not None and victim["GROUP_RANK"] == "1"
        os.kill(victim["pid"], signal.SIGKILL)
        # Every rank of both nodes comes back in the next attempt, which they all agree on.
        envs = wait_for(lambda: [started(out, r, 1) for r in range(4)]
                        if all(started(out, r, 1) for r in range(4)) else None, 60, "restart 1 on every rank",
                        interval=0.1, diagnose=tails(logs))
        assert finish(pa, logs[0]) == 0, logs[0].read_text()[-3000:]
        assert finish(pb, logs[1]) == 0, logs[1].read_text()[-3000:]
    for rank, env in enumerate(envs):
        assert env["RANK"] == str(rank) and env["WORLD_SIZE"] == "4" and env["LOCAL_WORLD_SIZE"] == "2"
        assert env["LOCAL_RANK"] == str(rank % 2) and env["GROUP_RANK"] == str(rank // 2)
        assert env["TORCHELASTIC_RUN_ID"] == "plain1"
    assert len({(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs}) == 1
    assert all(step_of(out, r, 1) == 59 for r in range(4))
    assert not any((out / f"start-r{r}-c2").exists() for r in range(4))
    assert "rank 2 on node-b exited with 137" in logs[0].read_text()


@pytest.mark.xdist_group("multinode")
@pytest.mark.parametrize("how", ["killed", "cut"])
def test_lost_node_leaves_the_other_going_on_alone(tmp_path: Path, how: str) -> None:
    """Node b's launcher and ranks SIGKILLed (its peers' collectives fail), or its link cut (its
    keep-alive stops: the peers' collectives would wait for gloo's timeout)."""
    out = tmp_path / "out"
    out.mkdir()
    logs = (tmp_path / "a.log", tmp_path / "b.log")
    with Nodes(tmp_path, ["node-a", "node-b"]) as nodes:
        a, b = nodes["node-a"], nodes["node-b"]
        flags = ("--no-agent", "--nnodes", "1:2", "--nproc-per-node", "2", "--rdzv-id", "elastic1",
                 "--rdzv-conf", "last_call_timeout=4,keep_alive_interval=1,keep_alive_max_attempt=3",
                 PLAIN, str(out), "100")
        pa = trainguard_run(a, a, *flags, log=logs[0])
        pb = trainguard_run(b, a, *flags, log=logs[1])
        wait_for(lambda: all(step_of(out, r, 0) >= 10 for r in range(4)), 60, "step 10 on 4 ranks", interval=0.1,
                 diagnose=tails(logs))
        if how == "killed":
            b.kill()
            pb.wait(timeout=10)
        else:
            b.cut()
        alone = wait_for(lambda: started(out, 0, 1), 60, "node a alone", interval=0.1, diagnose=tails(logs))
        assert finish(pa, logs[0], timeout=90) == 0, logs[0].read_text()[-3000:]
    assert alone["WORLD_SIZE"] == "2" and started(out, 1, 1)["WORLD_SIZE"] == "2"
    assert step_of(out, 0, 1) == 99 and step_of(out, 1, 1) == 99
    assert not (out / "start-r2-c1").exists()
    if how == "cut":
        assert "node(s) node-b lost (no keep-alive)" in logs[0].read_text()


@pytest.mark.parametrize("flags, words", [
    (["--nnodes", "2", "--no-agent", "x.py"], "--rdzv-endpoint"),
    (["--nnodes", "2", "--rdzv-endpoint", "h:1", "--rdzv-backend", "static", "--no-agent", "x.py"], "c10d"),
    (["--nnodes", "2", "--rdzv-endpoint", "h:1", "--rdzv-backend", "c10d", "--no-agent", "x.py"], "--rdzv-id"),
    (["--nnodes", "2:1", "--rdzv-endpoint", "h:1", "--no-agent", "x.py"], "MAX is below MIN"),
    (["--nnodes", "2", "--rdzv-endpoint", "h:1", "--rdzv-backend", "c10d", "--rdzv-id", "j",
      "--rdzv-conf", "last_call_timeout=x", "--no-agent", "x.py"], "not a number"),
    (["--nnodes", "2", "--rdzv-endpoint", "h:1", "--rdzv-backend", "c10d", "--rdzv-id", "j", "--node-rank", "2",
      "--no-agent", "x.py"], "--node-rank 2"),
])
def test_bad_multinode_flags_say_one_line(tmp_path: Path, flags: list[str], words: str) -> None:
    (tmp_path / "x.py").write_text("")
    proc = subprocess.run([sys.executable, "-m", "trainguard", "run", *flags], capture_output=True, text=True,
                          cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=60)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0], proc.stderr


def starts_of(out: Path, rank: int) -> list[dict]:
    path = out / f"starts-r{rank}"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.xdist_group("multinode")
def test_a_node_that_joins_receives_the_checkpoint_and_every_rank_resumes_from_it(tmp_path: Path) -> None:
    """``--nnodes 1:2``: node a trains alone with a memory-tier checkpoint every 20 steps; node b
    joins, the round ends (not a failure) and the next one has four ranks, a world no snapshot
    is of. Node a's ranks load the newest checkpoint from their agent's memory tier and send it
    to node b's, which hold nothing: all four resume at its step with the same parameters."""
    out = tmp_path / "out"
    out.mkdir()
    logs = (tmp_path / "a.log", tmp_path / "b.log")
    steps = 400
    with Nodes(tmp_path, ["node-a", "node-b"]) as nodes:
        a, b = nodes["node-a"], nodes["node-b"]
        flags = ("--nnodes", "1:2", "--nproc-per-node", "2", "--rdzv-id", "grow1",
                 "--rdzv-conf", "last_call_timeout=1", API, str(out), str(steps))
        state_a = a.start_agent(tmp_path, memory_every=20)
        pa = trainguard_run(a, a, "--state-dir", str(state_a), *flags, log=logs[0])
        wait_for(lambda: [s for s in memory_checkpoints([state_a / "events" / "events.jsonl"]) if s >= 40], 90, "a memory-tier checkpoint on node a",
                 interval=0.1, diagnose=tails(logs))
        state_b = b.start_agent(tmp_path, memory_every=20)
        pb = trainguard_run(b, a, "--state-dir", str(state_b), *flags, log=logs[1])
        wait_for(lambda: all(starts_of(out, r) for r in range(4)), 90, "four ranks started", interval=0.1,
                 diagnose=tails(logs))
        assert finish(pa, logs[0], timeout=120) == 0, logs[0].read_text()[-3000:]
        assert finish(pb, logs[1], timeout=60) == 0, logs[1].read_text()[-3000:]
    grown = [starts_of(out, r)[-1] for r in range(4)]
    assert all(s["WORLD_SIZE"] == "4" for s in grown), grown
    resumed = {s["start"] for s in grown}
    assert len(resumed) == 1 and resumed.pop() >= 40, grown
    start = grown[0]["start"]
    assert all(s["restored"] == "checkpoint" for s in grown), grown
    # the global batch of node a's two ranks (2 x 4) kept over four: 2 each
    assert [s["batch"] for s in grown] == [2, 2, 2, 2], grown
    # node a's ranks before the join: the parameters after step start - 1 are what all four resumed with
    before = {s: d for c, s, d in steps_of(out, 0) if s < start}
    assert all(s["digest"] == before[start - 1] for s in grown), (before.get(start - 1), grown)
    for rank in range(4):
        done = [s for _c, s, _d in steps_of(out, rank)]
        last_round = done[len(done) - 1 - done[::-1].index(start):]  # node a's ranks did some steps twice
        assert last_round == list(range(start, steps)), (rank, last_round[:5], last_round[-5:])
    assert "hold and send to the others" in logs[0].read_text()


@pytest.mark.xdist_group("multinode")
@pytest.mark.parametrize("nnodes", ["1", "1:2"], ids=["one-node", "rendezvous"])
def test_sigterm_stops_the_nodes_ranks_and_exits_143(tmp_path: Path, nnodes: str) -> None:
    """What a batch system's scancel or time limit sends each node's ``trainguard run`` without an
    agent: its ranks (in sessions of their own) stop, and it exits 143 (128 + SIGTERM)."""
    out = tmp_path / "out"
    out.mkdir()
    log = tmp_path / "a.log"
    with Nodes(tmp_path, ["node-a"]) as nodes:
        a = nodes["node-a"]
        pa = trainguard_run(a, a, "--no-agent", "--nnodes", nnodes, "--nproc-per-node", "2", "--rdzv-id", "term1",
                            "--rdzv-conf", "last_call_timeout=1", PLAIN, str(out), "100000", log=log)
        wait_for(lambda: all(step_of(out, r, 0) >= 5 for r in range(2)), 60, "step 5 on both ranks", interval=0.1,
                 diagnose=tails([log]))
        pids = [started(out, r, 0)["pid"] for r in range(2)]
        pa.send_signal(signal.SIGTERM)
        assert finish(pa, log, timeout=60) == 143, log.read_text()[-3000:]
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
