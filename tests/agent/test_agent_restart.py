"""The agent SIGKILLed mid-job (by the test, as a crash or an OOM kill of the agent would): the
ranks train on, and an agent started again on the same state directory adopts them (same pids,
telemetry and supervision resume, the job finishes), or, when a rank died while no agent ran,
restarts the job from its newest checkpoint. An event says which; nothing committed is lost."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest

from bench.trainjobs import tiny_config
from tests.conftest import RunningAgent
from tests.helpers.waiting import wait_for
from trainguard.agent.lifecycle.records import RankRecord, RecordStore
from trainguard.agent.wire import process_start_ticks

CONFIG = "[agent]\ninterval_s = 0.2\n[checkpoint]\nmemory_every = 5\n[collectors]\ngpu = false\n"


def _events(client: Any, kind: str, job: str) -> list[dict[str, Any]]:
    return [e for e in client.events(since=0, limit=5000)["events"] if e["kind"] == kind and e.get("job") == job]


def _running_job(agent_factory: Any, cache: str, job: str, steps: int) -> tuple[RunningAgent, dict[int, int]]:
    agent = agent_factory(config=CONFIG)
    client = agent.client()
    trainer = tiny_config(cache, steps=steps, parallel={"dp": 2}).to_dict()
    client.submit_job({"job": job, "nproc": 2, "trainer": trainer})

    def stepping() -> dict[int, int] | None:
        jobs = {j["job"]: j for j in client.status()["jobs"]}
        ranks = jobs.get(job, {}).get("ranks", [])
        if len(ranks) == 2 and all((r.get("telemetry") or {}).get("step", 0) >= 12 for r in ranks):
            return {r["rank"]: r["pid"] for r in ranks}
        return None

    pids = wait_for(stepping, 120, "both ranks past step 12")
    wait_for(lambda: any(c.get("tier") == "memory" and c.get("step", 0) >= 10 for c in client.checkpoints(job)),
             60, "a memory checkpoint")
    return agent, pids


def _kill_agent(agent: RunningAgent) -> None:
    agent.proc.send_signal(signal.SIGKILL)
    agent.proc.wait(10)
    # What a dead agent leaves behind, which the next one must cope with itself; only the files the
    # test fixture waits on go, so that it waits for the new agent rather than the old files.
    for name in ("agent.sock", "metrics.addr"):
        (agent.state_dir / "run" / name).unlink(missing_ok=True)


@pytest.mark.slow
def test_killed_agent_is_replaced_and_the_new_one_adopts_the_running_ranks(agent_factory: Any, tmp_path: Path) -> None:
    job = "adoptme"
    first, pids = _running_job(agent_factory, str(tmp_path / "corpus"), job, steps=160)
    _kill_agent(first)
    for pid in pids.values():
        assert process_start_ticks(pid) is not None, "a rank died with its agent"
    second = agent_factory(config=CONFIG)
    client = second.client()
    adopted = wait_for(lambda: _events(client, "job_adopted", job), 30, "the adoption event")
    assert sorted(adopted[0]["fields"]["pids"]) == sorted(pids.values())
    info = client.job(job)
    assert info["state"] == "running" and sorted(r["pid"] for r in info["ranks"]) == sorted(pids.values())
    # Supervision, telemetry and checkpoint bookkeeping resume under the new agent.
    before = info["progress_step"]
    wait_for(lambda: client.job(job)["progress_step"] > before + 5, 60, "telemetry from the adopted ranks")
    done = wait_for(lambda: (j := client.job(job))["state"] in ("succeeded", "failed") and j, 180, "the job to end")
    assert done["state"] == "succeeded", (done, client.events(since=0, limit=200)["events"][-20:])
    exits = _events(client, "rank_exit", job)
    assert sorted(e["fields"]["exit_code"] for e in exits) == [0, 0], exits
    assert not _events(client, "job_restart", job)


@pytest.mark.slow
def test_rank_killed_while_no_agent_ran_is_judged_from_its_launchers_record(agent_factory: Any, tmp_path: Path) -> None:
    """A rank SIGKILLed while no agent runs: its warm launcher outlived the agent, reaped it and wrote
    down how it ended, so the next agent adopts the job with that status and handles the death as
    if it had seen it (a restart from the newest checkpoint, the cause named)."""
    job = "orphan"
    first, pids = _running_job(agent_factory, str(tmp_path / "corpus"), job, steps=120)
    committed = max(c["step"] for c in first.client().checkpoints(job) if c.get("tier") == "memory")
    _kill_agent(first)
    os.kill(pids[1], signal.SIGKILL)  # dies unwatched: no agent sees it go
    record = first.state_dir / "jobs" / job / "rank1.log.exit"
    wait_for(record.exists, 10, "the launcher's record of rank 1's end")
    second = agent_factory(config=CONFIG)
    client = second.client()
    adopted = wait_for(lambda: _events(client, "job_adopted", job), 30, "the adoption")
    assert adopted[0]["fields"]["ended"].get("1") == -9, adopted[0]
    exits = wait_for(lambda: [e for e in _events(client, "rank_exit", job) if e["fields"]["pid"] == pids[1]], 30,
                     "rank 1's exit, as recorded")
    assert exits[0]["fields"]["signal"] == 9 and "status from launcher" in exits[0]["message"], exits
    restart = wait_for(lambda: _events(client, "job_restart", job), 30, "the restart")
    assert restart[0]["fields"]["action"] == "restart", restart[0]
    wait_for(lambda: all(process_start_ticks(p) is None for p in pids.values()), 10, "the old ranks gone")
    selected = wait_for(lambda: _events(client, "restore_selected", job), 60, "a restore")
    assert selected[-1]["fields"]["step"] >= committed, (selected[-1], committed)
    done = wait_for(lambda: (j := client.job(job))["state"] in ("succeeded", "failed") and j, 180, "the job to end")
    assert done["state"] == "succeeded", done


@pytest.mark.slow
def test_rank_dead_unrecorded_while_no_agent_ran_restarts_from_the_newest_checkpoint(agent_factory: Any,
                                                                                    tmp_path: Path) -> None:
    """The same death with its record gone (a launcher killed too, a full disk): its status is
    lost, so the job restarts from its newest checkpoint, and the event says why."""
    job = "orphan"
    first, pids = _running_job(agent_factory, str(tmp_path / "corpus"), job, steps=120)
    committed = max(c["step"] for c in first.client().checkpoints(job) if c.get("tier") == "memory")
    _kill_agent(first)
    os.kill(pids[1], signal.SIGKILL)
    record = first.state_dir / "jobs" / job / "rank1.log.exit"
    wait_for(record.exists, 10, "the launcher's record of rank 1's end")
    record.unlink()
    second = agent_factory(config=CONFIG)
    client = second.client()
    restart = wait_for(lambda: _events(client, "job_restart", job), 30, "the restart event")
    fields = restart[0]["fields"]
    assert fields["action"] == "restart_after_agent_restart" and 1 in fields["gone"], fields
    # Rank 0 either died of the broken collective on its own (its end recorded: not "gone") or,
    # still alive, was stopped: it cannot go on alone, and nothing of the old attempt is left.
    killed = {r for r, pid in pids.items() if pid in fields["killed"]}
    assert 0 not in fields["gone"] and not set(fields["gone"]) & killed, fields
    wait_for(lambda: all(process_start_ticks(p) is None for p in pids.values()), 10, "the old ranks gone")
    selected = wait_for(lambda: _events(client, "restore_selected", job), 60, "a restore")
    assert selected[-1]["fields"]["step"] >= committed, (selected[-1], committed)
    done = wait_for(lambda: (j := client.job(job))["state"] in ("succeeded", "failed") and j, 180, "the job to end")
    assert done["state"] == "succeeded", done


def test_records_name_a_rank_by_pid_and_start_time_and_survive_bad_files(tmp_path: Path) -> None:
    me = os.getpid()
    mine = RankRecord(0, 0, me, process_start_ticks(me), "log")
    assert mine.alive()
    assert not RankRecord(0, 0, me, (process_start_ticks(me) or 0) + 1, "log").alive()  # a recycled pid
    store = RecordStore(str(tmp_path))
    job = {"job": "j", "spec": {"job": "j", "nproc": 1}, "state": "running", "attempt": 2, "restarts": 1,
           "progress_step": 7, "submitted": 1.0, "local_ranks": None}
    store.save(job, [(0, 0, me, "log")])
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "record.json").write_text('{"spec": ')  # truncated by a full disk
    saved, problems = store.load_all()
    assert [s.spec["job"] for s in saved] == ["j"] and saved[0].ranks[0].alive() and saved[0].attempt == 2
    assert len(problems) == 1 and "broken" in problems[0] and store.errors == 1


@pytest.mark.slow
def test_an_adopted_rank_that_dies_is_seen_and_the_job_restarted(agent_factory: Any, tmp_path: Path) -> None:
    job = "adoptcrash"
    # Long enough to be still running when the second agent is up to adopt it: 120 steps of the
    # tiny model were over before that once, on a loaded machine (no job_adopted event then).
    first, pids = _running_job(agent_factory, str(tmp_path / "corpus"), job, steps=300)
    _kill_agent(first)
    second = agent_factory(config=CONFIG)
    client = second.client()
    wait_for(lambda: _events(client, "job_adopted", job), 30, "the adoption event")
    os.kill(pids[1], signal.SIGKILL)
    exits = wait_for(lambda: [e for e in _events(client, "rank_exit", job) if e["fields"]["pid"] == pids[1]], 30,
                     "the adopted rank's exit")
    # No waitpid on a rank not our child: the status comes from the eBPF exit event (CI runs as
    # root with eBPF) or from the warm launcher's record of it.
    assert exits[0]["fields"]["signal"] == 9, exits
    restart = wait_for(lambda: _events(client, "job_restart", job), 30, "the restart")
    assert restart[0]["fields"]["action"] == "restart"
    done = wait_for(lambda: (j := client.job(job))["state"] in ("succeeded", "failed") and j, 180, "the job to end")
    assert done["state"] == "succeeded" and done["restarts"] >= 1, done
