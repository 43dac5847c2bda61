"""``trainguard run`` end to end: a real agent, the command line as a user types it, real DDP
scripts (gloo), faults sent from outside by the test (SIGKILL, SIGSTOP of a rank)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import job_events as events
from tests.helpers.disk import fill
from tests.helpers.jobs import rank_pid, run_cli
from tests.helpers.waiting import wait_for

REPO = Path(__file__).resolve().parents[2]
PLAIN = str(REPO / "examples" / "ddp_plain.py")
API = str(REPO / "examples" / "ddp_api.py")

pytestmark = pytest.mark.slow

CONFIG = """\
[agent]
interval_s = 0.25
[collectors]
gpu = false
[recovery]
startup_timeout_s = 1.0
hang_floor_s = 1.0
hang_factor = 2.0
[checkpoint]
memory_every = 20
"""


def test_plain_ddp_script_killed_rank_restarts_whole_job(agent_factory: Any, tmp_path: Path) -> None:
    """The tutorial-style script (no trainguard import): SIGKILL of rank 1 from outside restarts
    every rank, the script resumes from its own torch.save checkpoint, the command exits 0, and
    each output line says which rank printed it."""
    agent = agent_factory(config=CONFIG)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    cli = run_cli(agent, tmp_path, "--nproc", "2", "--job", "plain", "--", sys.executable, PLAIN,
                  "--steps", "1200", "--width", "1024", "--batch", "64", "--ckpt-dir", str(ckpt), "--ckpt-every", "50")
    wait_for(lambda: (ckpt / "ckpt.pt").exists(), 90, "the script's first checkpoint")
    pid = wait_for(lambda: rank_pid(agent, "plain", 1), 30, "rank 1")
    os.kill(pid, signal.SIGKILL)
    out, err = cli.communicate(timeout=180)
    assert cli.returncode == 0, err
    assert "[rank0]:resumed from step" in out, out[-2000:]
    assert "[rank1]:" not in out or all(line.startswith(("[rank0]:", "[rank1]:")) for line in out.splitlines() if line)
    exits = [e for e in events(agent, "plain", "rank_exit") if e["fields"].get("signal") == 9]
    assert exits and exits[0]["rank"] == 1
    assert events(agent, "plain", "job_restart")
    env_dump = agent.client().job("plain")
    assert env_dump["state"] == "succeeded" and env_dump["restarts"] == 1 and env_dump["exit_code"] == 0


def test_failing_rank_exit_code_is_the_jobs_after_the_crash_loop_guard(agent_factory: Any, tmp_path: Path) -> None:
    agent = agent_factory(config=CONFIG)
    cli = run_cli(agent, tmp_path, "--nproc", "2", "--job", "exits", "--max-restarts", "1", "--", sys.executable, PLAIN,
                  "--steps", "50", "--exit-code", "3")
    out, err = cli.communicate(timeout=180)
    assert cli.returncode == 3, (out[-1000:], err)
    assert events(agent, "exits", "crash_loop")
    assert "exit code 3" in err


def test_a_silent_script_is_never_called_hung(agent_factory: Any, tmp_path: Path) -> None:
    """No telemetry, no CPU use, far past the (shortened) startup and hang limits: not a hang."""
    agent = agent_factory(config=CONFIG)
    script = "import time, os; time.sleep(5); print('done', os.environ['RANK'], os.environ['TORCHELASTIC_RESTART_COUNT'])"
    cli = run_cli(agent, tmp_path, "--nproc", "2", "--job", "silent", "--", sys.executable, "-c", script)
    out, err = cli.communicate(timeout=60)
    assert cli.returncode == 0, err
    assert "[rank0]:done 0 0" in out and "[rank1]:done 1 0" in out
    assert not events(agent, "silent", "hang_detected")
    assert agent.client().job("silent")["restarts"] == 0


def test_sigterm_stops_the_job_whose_ranks_are_the_agents(agent_factory: Any, tmp_path: Path) -> None:
    """A scheduler ends a step with SIGTERM to its tasks (Slurm's scancel and time limit): the ranks
    are the agent's children, outside the step, so ``trainguard run`` must stop them, not just exit."""
    agent = agent_factory(config=CONFIG)
    cli = run_cli(agent, tmp_path, "--nproc", "1", "--job", "termed", "--", sys.executable, "-c",
                  "import time; print('up', flush=True); time.sleep(600)")
    pid = wait_for(lambda: rank_pid(agent, "termed", 0), 60, "rank 0 running")
    cli.send_signal(signal.SIGTERM)
    _, err = cli.communicate(timeout=60)
    assert cli.returncode == 143, err
    assert "stopping job termed: terminated (SIGTERM)" in err
    assert agent.client().job("termed")["state"] == "stopped"
    assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"


def test_a_script_ends_as_under_python_its_exit_handlers_run(agent_factory: Any, tmp_path: Path) -> None:
    """Ranks start from the agent's warm launcher (a fork, not an exec); a script's atexit handlers
    (a logger's flush, wandb.finish) must still run when it ends, as under ``python script.py``."""
    agent = agent_factory(config=CONFIG)
    script = tmp_path / "bye.py"
    script.write_text("import atexit, os, sys\n"
                      "atexit.register(lambda: open(f'bye{os.environ[\"RANK\"]}', 'w').write('ok'))\n"
                      "sys.exit(0 if os.environ['RANK'] == '0' else None)\n")
    cli = run_cli(agent, tmp_path, "--nproc", "2", "--job", "bye", "--", sys.executable, str(script))
    out, err = cli.communicate(timeout=60)
    assert cli.returncode == 0, err
    assert [(tmp_path / f"bye{r}").read_text() for r in (0, 1) if (tmp_path / f"bye{r}").exists()] == ["ok", "ok"]


def test_hang_timeout_finds_a_stopped_rank_by_cpu_activity(agent_factory: Any, tmp_path: Path) -> None:
    """SIGSTOP of one rank: its peer waits in the all-reduce, nobody uses the CPU; with
    --hang-timeout the agent declares the hang, restarts, and the job finishes."""
    agent = agent_factory(config=CONFIG)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    cli = run_cli(agent, tmp_path, "--nproc", "2", "--job", "stopped", "--hang-timeout", "2", "--", sys.executable,
                  PLAIN, "--steps", "1200", "--width", "1024", "--batch", "64", "--ckpt-dir", str(ckpt))
    wait_for(lambda: (ckpt / "ckpt.pt").exists(), 90, "the script's first checkpoint")
    pid = wait_for(lambda: rank_pid(agent, "stopped", 1), 30, "rank 1")
    os.kill(pid, signal.SIGSTOP)
    stopped_at = time.monotonic()
    hang = wait_for(lambda: events(agent, "stopped", "hang_detected"), 30, "the hang verdict")
    assert time.monotonic() - stopped_at >= 2.0
    assert hang[0]["fields"]["signal"] == "cpu_activity" and hang[0]["cause"] == "hang"
    # The stopped rank's state and real Python stack (py-spy cannot read a stopped process as is),
    # and its peer's, waiting in the all-reduce.
    procs, stacks = hang[0]["fields"]["processes"], hang[0]["fields"]["stacks"]
    assert procs["1"]["state"] == "T (stopped)" and procs["1"]["resumed_for_dump"] is True, procs
    assert procs["0"]["state"].startswith(("S", "R")), procs
    assert "ddp_plain.py" in stacks["1"] and "ddp_plain.py" in stacks["0"], stacks
    out, err = cli.communicate(timeout=180)
    assert cli.returncode == 0, err
    assert events(agent, "stopped", "job_restart")


def test_api_script_resumes_from_its_snapshots_bit_equal(agent_factory: Any, tmp_path: Path) -> None:
    """The same script with the API: kill a rank, the job resumes at the step of the ranks' newest
    common snapshot the agent hands it (at least the memory checkpoint's), and ends with the
    parameters of an unfaulted run, bit for bit."""
    import torch

    # No shard migration here: a neighbour's load on this 2-core machine is a real cause that moves
    # samples (CI saw it), and different per-rank batches give different, equally valid numbers.
    agent = agent_factory(config=CONFIG.replace("[checkpoint]\n", "[checkpoint]\nsnapshot_every = 1\n")
                          + "[detection]\nmigrate = false\n")
    clean, faulted = tmp_path / "clean.pt", tmp_path / "faulted.pt"
    args = ["--steps", "400", "--width", "256", "--step-sleep", "0.01"]
    ref = run_cli(agent, tmp_path, "--nproc", "2", "--job", "ref", "--", sys.executable, API, *args, "--out", str(clean))
    ref_out, ref_err = ref.communicate(timeout=180)
    assert ref.returncode == 0, ref_err
    cli = run_cli(agent, tmp_path, "--nproc", "2", "--job", "api", "--", sys.executable, API, *args, "--out", str(faulted))
    wait_for(lambda: any(c.get("step", 0) >= 60 for c in agent.client().checkpoints("api")), 90, "memory checkpoints")
    pid = wait_for(lambda: rank_pid(agent, "api", 0), 30, "rank 0")
    os.kill(pid, signal.SIGKILL)
    out, err = cli.communicate(timeout=180)
    assert cli.returncode == 0, err
    restored = events(agent, "api", "restore_selected")
    assert restored and restored[0]["fields"]["tier"] == "snapshot" and restored[0]["fields"]["step"] >= 60
    assert restored[0]["fields"]["fallback"]["tier"] == "memory"
    assert restored[0]["fields"]["step"] >= restored[0]["fields"]["fallback"]["step"]
    assert f"[rank0]:resumed at step {restored[0]['fields']['step']}" in out
    # The event names where the ranks went on (their first step after it), not the newest step seen.
    resumed = events(agent, "api", "job_resumed")
    assert resumed and resumed[0]["fields"]["first_step_after_restore"] == restored[0]["fields"]["step"] + 1, resumed
    a, b = torch.load(clean, weights_only=True), torch.load(faulted, weights_only=True)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_no_agent_restarts_without_an_agent(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "trainguard", "run", "--no-agent", "--nproc", "2", "--max-restarts", "1", "--",
           sys.executable, PLAIN, "--steps", "50", "--exit-code", "3"]
    res = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=180,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert res.returncode == 3
    assert "restarting all 2 ranks (restart 1 of 1)" in res.stderr and "no restarts left" in res.stderr
    ok = subprocess.run(cmd[:7] + ["--", sys.executable, PLAIN, "--steps", "30"], cwd=tmp_path, capture_output=True,
                        text=True, timeout=180, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert ok.returncode == 0, ok.stderr
    assert "[rank0]:step 20 loss" in ok.stdout


def test_run_without_an_agent_says_how_to_get_one(tmp_path: Path) -> None:
    res = subprocess.run([sys.executable, "-m", "trainguard", "run", "--state-dir", str(tmp_path / "none"), "--",
                          "true"], capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert res.returncode == 1
    assert "trainguard agent" in res.stderr and "Traceback" not in res.stderr
    assert "--state-dir" in res.stderr and "--no-agent" in res.stderr and "--standalone" not in res.stderr
    bad = subprocess.run([sys.executable, "-m", "trainguard", "run", "--no-agent", "--", "no-such-program-x"],
                         capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert bad.returncode != 0 and "Traceback" not in bad.stderr


def test_a_full_memory_tier_never_stops_training(agent_factory: Any, tmp_path: Path, tiny_tmpfs: Path) -> None:
    """The agent's /dev/shm stand-in (a real 1 MiB tmpfs) is full: every rank skips the save, the
    agent says why (checkpoint_write_failed, the alert's counter), training goes on; once the test
    frees space the tier works again, and no half-written save is left behind."""
    filler = tiny_tmpfs / "filler"
    filler.write_bytes(b"x" * ((1 << 20) - 8192))
    tier = tiny_tmpfs / "tier"
    # Not the file's 1 s hang floor: on a loaded CI machine a step with a failing save can take
    # longer than that, and a hang restart is not what this test is about (CI once saw 5 restarts
    # here, of unrecorded cause; the assertion below now names them).
    config = CONFIG.replace("memory_every = 20", f'memory_every = 20\nmemory_root = "{tier}"').replace(
        "hang_floor_s = 1.0", "hang_floor_s = 30.0")
    agent = agent_factory(config=config)
    cli = run_cli(agent, tmp_path, "--nproc", "2", "--job", "full", "--", sys.executable, API, "--steps", "500",
                  "--width", "512", "--step-sleep", "0.01")
    failed = wait_for(lambda: events(agent, "full", "checkpoint_write_failed"), 90, "checkpoint_write_failed")
    assert failed[0]["fields"]["tier"] == "memory" and "No space left" in failed[0]["fields"]["error"], failed[0]
    metrics = urllib.request.urlopen(agent.metrics_url(), timeout=10).read().decode()
    assert 'trainguard_checkpoint_write_failures_total{tier="memory"}' in metrics
    filler.unlink()
    wait_for(lambda: agent.client().checkpoints("full"), 90, "a memory checkpoint once there is room")
    out, err = cli.communicate(timeout=180)
    assert cli.returncode == 0, err[-2000:]
    assert not [p for p in tier.rglob(".tmp-*")], list(tier.rglob("*"))
    restarts = [e["message"] for e in agent.client().events(since=0, limit=1000)["events"]
                if e.get("job") == "full" and e["kind"] in ("rank_exit", "job_restarting", "hang_detected", "job_resumed")]
    assert agent.client().job("full")["restarts"] == 0, restarts


def test_a_job_id_used_again_streams_only_its_own_output(agent_factory: Any, tmp_path: Path) -> None:
    """The agent keeps a job's logs under its id; submitting the id again must not replay the
    previous run's lines as the new run's output (the old ones are kept aside as ``.log.1``)."""
    agent = agent_factory(config=CONFIG)
    outs = []
    for word in ("first", "second"):
        cli = run_cli(agent, tmp_path, "--nproc", "1", "--job", "again", "--", sys.executable, "-c", f"print('{word}')")
        out, err = cli.communicate(timeout=60)
        assert cli.returncode == 0, err
        outs.append(out)
    assert outs == ["[rank0]:first\n", "[rank0]:second\n"]
    logs = Path(agent.state_dir) / "jobs" / "again"
    assert (logs / "rank0.log.1").read_text() == "first\n" and (logs / "rank0.log").read_text() == "second\n"


def test_output_larger_than_one_poll_carries_comes_out_whole_and_in_order(agent_factory: Any, tmp_path: Path) -> None:
    """Each poll hands out at most 64 KiB a rank; two ranks printing 300 KiB each and exiting at
    once still show every line, in order, under their own prefix."""
    agent = agent_factory(config=CONFIG)
    script = "import os; r = os.environ['RANK']; print('\\n'.join(f'{r} {i:06d} ' + 'x' * 40 for i in range(6000)))"
    cli = run_cli(agent, tmp_path, "--nproc", "2", "--job", "loud", "--", sys.executable, "-c", script)
    out, err = cli.communicate(timeout=120)
    assert cli.returncode == 0, err
    for rank in (0, 1):
        lines = [line for line in out.splitlines() if line.startswith(f"[rank{rank}]:")]
        assert lines == [f"[rank{rank}]:{rank} {i:06d} " + "x" * 40 for i in range(6000)]


def test_a_last_line_without_a_newline_is_shown_once_the_job_ends(agent_factory: Any, tmp_path: Path) -> None:
    agent = agent_factory(config=CONFIG)
    cli = run_cli(agent, tmp_path, "--nproc", "1", "--job", "tail", "--", sys.executable, "-c",
                  "import sys; print('whole'); sys.stdout.write('no newline at the end')")
    out, err = cli.communicate(timeout=60)
    assert cli.returncode == 0, err
    assert out == "[rank0]:whole\n[rank0]:no newline at the end\n"


def test_run_follows_on_through_its_agent_killed_and_started_again(agent_factory: Any, tmp_path: Path) -> None:
    """SIGKILL of the agent while ``trainguard run`` follows a job (a crash or an OOM kill of the
    agent): the ranks train on and the command waits rather than failing; the agent started again
    on the same state directory (as systemd's Restart= does) adopts the ranks, and the command
    follows on to the job's end: every line the ranks printed, once and in order, and exit code 0."""
    agent = agent_factory(config=CONFIG)
    cli = run_cli(agent, tmp_path, "--nproc", "2", "--job", "outlive", "--", sys.executable, API,
                  "--steps", "1500", "--step-sleep", "0.01")
    try:
        wait_for(lambda: (p := rank_pid(agent, "outlive", 0)) and (agent.client().job("outlive").get("progress_step") or 0)
                 >= 20 and p, 60, "the job training")
        pids = sorted(r["pid"] for r in agent.client().job("outlive")["ranks"])
        agent.proc.send_signal(signal.SIGKILL)
        agent.proc.wait(10)
        for name in ("agent.sock", "metrics.addr"):  # what a killed agent leaves; the fixture waits on them
            (agent.state_dir / "run" / name).unlink(missing_ok=True)
        time.sleep(2.0)
        assert cli.poll() is None, cli.communicate()
        again = agent_factory(config=CONFIG)  # the same state directory
        out, err = cli.communicate(timeout=240)
    finally:
        if cli.poll() is None:
            cli.kill()
    assert cli.returncode == 0, err
    assert "waiting for the agent to come back" in err and "the agent is back" in err, err
    steps = [int(line.split()[1]) for line in out.splitlines() if line.startswith("[rank0]:step ")]
    assert steps == list(range(0, 1500, 20)), steps
    adopted = [e for e in again.client().events(since=0, limit=10000, kind="job_adopted")["events"]
               if e.get("job") == "outlive"]
    assert adopted and sorted(adopted[0]["fields"]["pids"]) == pids, adopted
    assert again.client().job("outlive")["restarts"] == 0


def _kill_agent(agent: Any) -> None:
    agent.proc.send_signal(signal.SIGKILL)
    agent.proc.wait(10)
    for name in ("agent.sock", "metrics.addr"):  # what a killed agent leaves; the fixture waits on them
        (agent.state_dir / "run" / name).unlink(missing_ok=True)


def _ranks_report(agent: Any, job: str, pids: list[int]) -> str:
    """What the ranks were doing (their state, where the kernel has them wait) and their last output."""
    lines = []
    for pid in pids:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            state = next((line for line in status.splitlines() if line.startswith("State:")), "?")
            wchan = Path(f"/proc/{pid}/wchan").read_text()
            threads = len(os.listdir(f"/proc/{pid}/task"))
            lines.append(f"pid {pid}: {state}, wchan {wchan}, {threads} threads")
            spy = Path(sys.executable).with_name("py-spy")
            if spy.exists():
                dump = subprocess.run([str(spy), "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=20)
                lines.append(dump.stdout[-3000:] + dump.stderr[-500:])
        except OSError as exc:
            lines.append(f"pid {pid}: {exc}")
    for log in sorted((agent.state_dir / "jobs" / job).glob("rank*.log")):
        lines.append(f"--- {log.name} (last 1500 chars)\n{log.read_text(errors='replace')[-1500:]}")
    return "\n".join(lines)


def test_a_job_that_ends_while_no_agent_runs_ends_as_it_did(agent_factory: Any, tmp_path: Path) -> None:
    """The agent SIGKILLed and the job's ranks finish before another agent starts: their warm
    launcher recorded how they ended, so the new agent tells the job succeeded (not a restart of
    a finished job) and ``trainguard run``, which waited, exits 0 with all the output."""
    agent = agent_factory(config=CONFIG)
    cli = run_cli(agent, tmp_path, "--nproc", "2", "--job", "early", "--", sys.executable, API, "--steps", "300",
                  "--step-sleep", "0.01")
    try:
        pids = wait_for(lambda: (r := [rank_pid(agent, "early", k) for k in (0, 1)]) and all(r) and r, 60,
                        "the ranks running")
        _kill_agent(agent)
        wait_for(lambda: all(not os.path.exists(f"/proc/{p}") for p in pids), 60, "the ranks done",
                 diagnose=lambda: _ranks_report(agent, "early", pids))
        assert cli.poll() is None, cli.communicate()
        again = agent_factory(config=CONFIG)
        out, err = cli.communicate(timeout=120)
    finally:
        if cli.poll() is None:
            cli.kill()
    assert cli.returncode == 0, err
    assert [int(line.split()[1]) for line in out.splitlines() if line.startswith("[rank0]:step ")] == \
        list(range(0, 300, 20))
    client = again.client()
    info = client.job("early")
    assert info["state"] == "succeeded" and info["restarts"] == 0, info
    adopted = [e for e in client.events(since=0, limit=10000, kind="job_adopted")["events"] if e.get("job") == "early"]
    assert adopted and adopted[0]["fields"]["ended"] == {"0": 0, "1": 0}, adopted
    assert not [e for e in client.events(since=0, limit=10000, kind="job_restart")["events"] if e.get("job") == "early"]


def test_a_job_accepted_but_not_started_outlives_its_agent(agent_factory: Any, tmp_path: Path) -> None:
    """The agent SIGKILLed right after it accepted a job, while the job's warm launcher still
    imports torch: the job was kept from its submission, so the next agent starts it."""
    agent = agent_factory(config=CONFIG)
    res = subprocess.run([sys.executable, "-m", "trainguard", "run", "--state-dir", str(agent.state_dir), "--nproc",
                          "2", "--job", "pending", "--detach", "--", sys.executable, PLAIN, "--steps", "40"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert res.returncode == 0 and res.stdout.strip() == "pending", res.stderr
    _kill_agent(agent)
    again = agent_factory(config=CONFIG)
    client = again.client()
    done = wait_for(lambda: (j := client.job("pending"))["state"] in ("succeeded", "failed") and j, 120,
                    "the job to run and end")
    assert done["state"] == "succeeded" and done["attempt"] == 1 and done["restarts"] == 0, done
    adopted = [e for e in client.events(since=0, limit=10000, kind="job_adopted")["events"] if e.get("job") == "pending"]
    assert adopted and adopted[0]["fields"]["action"] == "start", adopted


def test_a_full_log_disk_does_not_end_the_job(agent_factory: Any, tmp_path: Path, tiny_tmpfs: Path) -> None:
    """The job's log folder is on a disk that is full (a real 1 MiB tmpfs the test filled): the
    ranks' prints are dropped and counted, not raised, so the tutorial script trains to its end
    (its final parameters saved elsewhere) and exits 0 with no restart. Before, its first print
    raised OSError, and so did the traceback's: the rank exited 0 at step 0, a job "succeeded"
    that never trained."""
    agent = agent_factory(config=CONFIG)
    (tiny_tmpfs / "fulllog").mkdir()
    (agent.state_dir / "jobs").mkdir(exist_ok=True)
    (agent.state_dir / "jobs" / "fulllog").symlink_to(tiny_tmpfs / "fulllog")
    fill(tiny_tmpfs)
    final = tmp_path / "final.pt"
    cli = run_cli(agent, tmp_path, "--nproc", "2", "--job", "fulllog", "--", sys.executable, PLAIN, "--steps", "100",
                  "--out", str(final))
    out, err = cli.communicate(timeout=180)
    assert cli.returncode == 0, err[-2000:]
    info = agent.client().job("fulllog")
    assert info["state"] == "succeeded" and info["restarts"] == 0, info
    assert final.exists(), "the script did not train to its end"
    assert (tiny_tmpfs / "fulllog" / "rank0.log").stat().st_size == 0  # nothing got through: it was full


def test_a_script_that_fails_where_its_traceback_cannot_be_written_still_fails(agent_factory: Any,
                                                                               tmp_path: Path) -> None:
    """A script that closed its stderr and then raised: the traceback cannot be written, and the
    rank exited 0 before (the exit code was set after printing it), so the job "succeeded"."""
    script = tmp_path / "closes_stderr.py"
    script.write_text("import sys\nsys.stderr.close()\nraise RuntimeError('failed with nowhere to say so')\n")
    agent = agent_factory(config=CONFIG)
    res = subprocess.run([sys.executable, "-m", "trainguard", "run", "--state-dir", str(agent.state_dir), "--nproc",
                          "1", "--max-restarts", "0", "--job", "mute", "--", sys.executable, str(script)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert res.returncode == 1, res.stderr
    assert agent.client().job("mute")["state"] == "failed"


def test_ranks_whose_warm_launcher_was_killed_train_on_and_their_job_ends(agent_factory: Any, tmp_path: Path) -> None:
    """SIGKILL of the job's warm launcher (the zygote its ranks were forked from: an OOM kill would
    pick it, it holds torch's imports) while the ranks train: they go on as orphans, and when they
    end the job ends with their statuses (before, the agent waited for the zygote's report forever,
    spinning on their pidfds, and ``trainguard run`` never returned)."""
    agent = agent_factory(config=CONFIG)
    cli = run_cli(agent, tmp_path, "--nproc", "2", "--job", "orphans", "--", sys.executable, API, "--steps", "400",
                  "--step-sleep", "0.01")
    try:
        pid = wait_for(lambda: (p := rank_pid(agent, "orphans", 0)) and (agent.client().job("orphans").get("progress_step")
                       or 0) >= 20 and p, 60, "the job training")
        zygote = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])  # the rank's parent
        assert "trainguard.trainer.zygote" in Path(f"/proc/{zygote}/cmdline").read_text()
        os.kill(zygote, signal.SIGKILL)
        out, err = cli.communicate(timeout=120)
    finally:
        if cli.poll() is None:
            cli.kill()
    assert cli.returncode == 0, err[-2000:]
    info = agent.client().job("orphans")
    assert info["state"] == "succeeded" and info["restarts"] == 0, info
    assert "[rank0]:step 380 " in out
    exits = events(agent, "orphans", "rank_exit")
    assert len(exits) == 2 and all("warm launcher had died" in e["message"] for e in exits), exits
