"""Launcher and supervisor with real processes: cold and warm (zygote) starts, rank exits seen at
once, restart, crash-loop guard, capabilities dropped in ranks."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.waiting import wait_for
from trainguard.agent.eventlog import EventLog
from trainguard.agent.lifecycle.jobs import JobSpec, JobState
from trainguard.agent.lifecycle.launcher import Launcher
from trainguard.agent.lifecycle.plans import PlanStore
from trainguard.agent.lifecycle.ranks import LaunchContext
from trainguard.agent.lifecycle.records import RecordStore
from trainguard.agent.lifecycle.supervisor import Supervisor

FAKE = [sys.executable, str(Path(__file__).resolve().parents[1] / "helpers" / "fake_rank.py")]


def make_supervisor(tmp_path, mode: str) -> tuple[Supervisor, EventLog]:
    events = EventLog(str(tmp_path / "events"), "n1", fsync=False)
    plans = PlanStore(str(tmp_path / "plans"))

    def ctx(spec: JobSpec) -> LaunchContext:
        return LaunchContext(
            telemetry_socket=str(tmp_path / "none.sock"),
            plan_path=plans.path(spec.job),
            log_dir=str(tmp_path / "jobs" / spec.job),
        )

    return Supervisor(events, plans, Launcher(mode=mode), ctx, stop_grace_s=3), events  # type: ignore[arg-type]


def wait_state(sup: Supervisor, job: str, states: set[JobState], timeout: float = 60) -> JobState:
    return wait_for(lambda: (state := sup.jobs[job].state) in states and state, timeout, f"job {job} in {states}",
                    interval=0.02, diagnose=lambda: f"still {sup.jobs[job].state}")


@pytest.mark.parametrize("mode", ["cold", "warm"])
def test_job_runs_to_success_without_capabilities(tmp_path, mode) -> None:
    sup, events = make_supervisor(tmp_path, mode)
    spec = JobSpec("ok-job", 2, command=FAKE, env={"FAKE_STEPS": "5"})
    sup.submit(spec)
    assert wait_state(sup, "ok-job", {JobState.SUCCEEDED, JobState.FAILED}) == JobState.SUCCEEDED
    kinds = [e["kind"] for e in events.since(0)]
    assert kinds.count("rank_exit") == 2 and "job_succeeded" in kinds
    if os.geteuid() == 0:
        log = (tmp_path / "jobs" / "ok-job" / "rank0.log").read_text()
        assert "caps=0000000000000000" in log, log
    sup.launcher.close_job("ok-job")
    sup.close()


def test_warm_restart_after_sigkill_is_fast(tmp_path) -> None:
    sup, events = make_supervisor(tmp_path, "warm")
    spec = JobSpec("kill-job", 2, command=FAKE, env={"FAKE_STEPS": "30", "FAKE_EXIT_AT": "1:5:kill"})
    sup.submit(spec)
    assert wait_state(sup, "kill-job", {JobState.SUCCEEDED, JobState.FAILED}) == JobState.SUCCEEDED
    record = sup.jobs["kill-job"]
    assert record.restarts == 1 and record.attempt == 2
    evs = events.since(0)
    exit_ev = next(e for e in evs if e["kind"] == "rank_exit" and e["fields"].get("signal") == 9)
    restart_ev = next(e for e in evs if e["kind"] == "ranks_started" and e["fields"]["attempt"] == 2)
    assert exit_ev["rank"] == 1
    # Exit seen through the pidfd at once, ranks re-forked from the zygote without new imports.
    assert restart_ev["ts"] - exit_ev["ts"] < 3.0
    sup.launcher.close_job("kill-job")
    sup.close()


def test_crash_loop_gives_up(tmp_path) -> None:
    sup, events = make_supervisor(tmp_path, "cold")
    spec = JobSpec(
        "loop-job", 1, command=FAKE, env={"FAKE_STEPS": "5", "FAKE_EXIT_AT": "0:0:3", "FAKE_EXIT_ALWAYS": "1"}, max_restarts=2
    )
    sup.submit(spec)
    assert wait_state(sup, "loop-job", {JobState.SUCCEEDED, JobState.FAILED}, timeout=60) == JobState.FAILED
    record = sup.jobs["loop-job"]
    assert record.restarts == 2
    assert "crash loop" in record.reason
    assert any(e["kind"] == "crash_loop" for e in events.since(0))
    sup.close()


def test_stop_terminates_ranks(tmp_path) -> None:
    sup, events = make_supervisor(tmp_path, "cold")
    sup.submit(JobSpec("long-job", 2, command=FAKE, env={"FAKE_STEPS": "100000"}))
    time.sleep(0.5)
    pids = [r.pid for r in sup.jobs["long-job"].ranks]
    sup.stop("long-job", "test")
    assert sup.jobs["long-job"].state == JobState.STOPPED
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    sup.close()


def test_a_peers_exit_1_does_not_hide_the_failing_ranks_status(tmp_path) -> None:
    """Rank 1 fails with 3 but is still in its teardown when rank 0 dies of it (exit 1, as a broken
    collective raises): the job's exit code is rank 1's, seen within the short grace."""
    sup, events = make_supervisor(tmp_path, "cold")
    script = ("import os, sys, time\nrank = int(os.environ['RANK'])\n"
              "time.sleep(0.1 if rank == 0 else 0.35)\nsys.exit(1 if rank == 0 else 3)\n")
    sup.submit(JobSpec("peer-job", 2, command=[sys.executable, "-c", script], max_restarts=0))
    assert wait_state(sup, "peer-job", {JobState.SUCCEEDED, JobState.FAILED}) == JobState.FAILED
    record = sup.jobs["peer-job"]
    assert record.exit_code == 3, (record.exit_codes, [e["message"] for e in events.since(0)])
    sup.close()


def test_warm_ranks_start_with_their_imports_and_the_corpus_listing_done(tmp_path) -> None:
    """What every rank would do before its first step (importing the API's checkpoint and snapshot
    modules, walking the stdlib for the corpus key: ~0.5 s of a restart) is done once in the zygote."""
    sup, _ = make_supervisor(tmp_path, "warm")
    script = tmp_path / "probe.py"
    script.write_text("import sys\n"
                      "warm = [m for m in ('trainguard.checkpoint.snapshot.writer', 'trainguard.checkpoint.tier', 'trainguard.trainer.train')"
                      " if m in sys.modules]\n"
                      "from trainguard.trainer.data import stdlib_digest\n"
                      "print('WARM', ','.join(warm), stdlib_digest.cache_info().currsize, flush=True)\n")
    sup.submit(JobSpec("warm-job", 1, command=[sys.executable, str(script)]))
    assert wait_state(sup, "warm-job", {JobState.SUCCEEDED, JobState.FAILED}) == JobState.SUCCEEDED
    log = (tmp_path / "jobs" / "warm-job" / "rank0.log").read_text()
    assert "WARM trainguard.checkpoint.snapshot.writer,trainguard.checkpoint.tier,trainguard.trainer.train 1" in log, log
    sup.launcher.close_job("warm-job")
    sup.close()


def test_a_job_is_kept_from_its_submission_and_one_that_could_not_start_stays_failed(tmp_path) -> None:
    """The record is written when the job is accepted (an agent killed before the ranks started
    must not lose it); a job whose ranks could not start is kept as failed, so that an agent
    started later on the same state directory does not start it."""
    sup, events = make_supervisor(tmp_path, "cold")
    sup.records = RecordStore(str(tmp_path / "records"))
    (tmp_path / "jobs").mkdir()
    (tmp_path / "jobs" / "nope").write_text("a file where the job's log folder must go\n")  # no rank can start
    sup.submit(JobSpec("nope", 1, command=FAKE))
    assert wait_state(sup, "nope", {JobState.FAILED, JobState.SUCCEEDED}) == JobState.FAILED
    records = sup.records

    def kept() -> list[tuple[str, str]]:
        saved, problems = records.load_all()
        assert not problems
        return [(s.spec["job"], s.state) for s in saved]

    assert kept() in ([("nope", "starting")], [("nope", "failed")])  # from the submission on
    wait_for(lambda: kept() == [("nope", "failed")], 10, "the failed state on disk")  # written just after
    saved, _ = records.load_all()
    failed = wait_for(lambda: [e for e in events.since(0) if e["kind"] == "job_failed"], 10, "job_failed")  # told after
    assert "could not start ranks" in failed[0]["message"]
    sup.close()
    later, later_events = make_supervisor(tmp_path / "later", "cold")
    later.adopt(saved)
    assert "nope" not in later.jobs and not later_events.since(0)
    later.close()
