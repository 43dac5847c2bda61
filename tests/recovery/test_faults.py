"""Fault injection does what it says: real SIGKILL, a real hang seen by py-spy, real CPU burn."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from trainguard.trainer.faults import (
    ENV_FAULTS,
    ENV_MARKER_DIR,
    FaultInjector,
    FaultSpec,
    burn_cpu,
    parse_fault,
)

REPO = Path(__file__).resolve().parents[2]
PY_SPY = Path(sys.executable).parent / "py-spy"

# A stand-in training loop: prints each finished step, so the parent sees where the fault hit.
LOOP = textwrap.dedent(
    """
    import sys
    from trainguard.trainer.faults import FaultInjector
    rank, marker = int(sys.argv[1]), (sys.argv[3] or None)
    inj = FaultInjector.from_specs(sys.argv[2].split(";"), rank, marker_dir=marker, environ={})
    for step in range(8):
        inj.before_step(step)
        print(f"done {step}", flush=True)
    """
)


def run_loop(specs: str, rank: int = 1, marker: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", LOOP, str(rank), specs, str(marker or "")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=30,
    )


# -- parsing ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("kill:rank=1,step=40", FaultSpec("kill", step=40, rank=1)),
        ("hang:rank=2,step=60", FaultSpec("hang", step=60, rank=2)),
        ("slow:rank=3,factor=2", FaultSpec("slow", rank=3, factor=2.0)),
        ("slow:rank=0,factor=1.5,step=10,until=20", FaultSpec("slow", step=10, rank=0, until=20, factor=1.5)),
        ("nan:step=80", FaultSpec("nan", step=80)),
        (" NaN: step = 5 , rank = 0 ", FaultSpec("nan", step=5, rank=0)),
    ],
)
def test_parse_good(text: str, expected: FaultSpec) -> None:
    spec = parse_fault(text)
    assert spec == expected
    assert parse_fault(str(spec)) == spec  # the canonical form parses back


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("explode:step=1", "'explode'"),
        ("kill", "need step"),
        ("kill:rank=1", "'step'"),
        ("kill:rank=x,step=1", "rank='x'"),
        ("kill:step=1,foo=2", "'foo'"),
        ("kill:step=1,step=2", "'step' given twice"),
        ("kill:step=1,rank", "'rank'"),
        ("kill:step=1,factor=2", "'factor'"),
        ("nan:step=-1", "'step' must be >= 0"),
        ("slow:rank=1,factor=0.5", "'factor' must be >= 1"),
        ("slow:rank=1,factor=nan", "'factor' must be >= 1"),
        ("slow:factor=fast", "factor='fast'"),
        ("slow:factor=2,step=10,until=5", "'until' (5)"),
    ],
)
def test_parse_bad_names_the_part(text: str, named: str) -> None:
    with pytest.raises(ValueError) as err:
        parse_fault(text)
    assert named in str(err.value)
    assert repr(text) in str(err.value)


def test_env_specs_are_added(tmp_path: Path) -> None:
    env = {ENV_FAULTS: "nan:step=3 ; slow:factor=2,rank=0;", ENV_MARKER_DIR: str(tmp_path)}
    inj = FaultInjector.from_specs(["nan:step=5"], rank=0, environ=env)
    assert sorted(str(s) for s in inj.specs) == ["nan:step=3", "nan:step=5", "slow:rank=0,factor=2"]
    assert inj.marker_dir == tmp_path
    with pytest.raises(ValueError, match="'bogus'"):
        FaultInjector.from_specs([], rank=0, environ={ENV_FAULTS: "bogus:step=1"})


# -- nan, rank filtering ------------------------------------------------------------------------------


def test_nan_fires_once_at_exactly_its_step() -> None:
    inj = FaultInjector.from_specs(["nan:step=4"], rank=0, environ={})
    fired = [step for step in range(10) if inj.loss_override(step)]
    assert fired == [4]
    assert not inj.loss_override(4)  # once, even if the step is replayed in this process


def test_rank_filtering() -> None:
    specs = ["nan:step=2,rank=1", "slow:rank=1,factor=3", "kill:rank=1,step=0", "hang:rank=1,step=0", "nan:step=6"]
    on0 = FaultInjector.from_specs(specs, rank=0, environ={})
    on1 = FaultInjector.from_specs(specs, rank=1, environ={})
    assert [s.kind for s in on0.specs] == ["nan"]
    assert [st for st in range(8) if on0.loss_override(st)] == [6]
    assert [st for st in range(8) if on1.loss_override(st)] == [2, 6]
    assert on0.slow_factor(5) == 1.0 and on1.slow_factor(5) == 3.0
    on0.before_step(0)  # kill/hang for rank 1 only: rank 0 goes on
    assert not FaultInjector.from_specs([], rank=0, environ={})


def test_slow_step_range() -> None:
    inj = FaultInjector.from_specs(["slow:factor=2,step=3,until=5", "slow:factor=1.5,step=4"], rank=0, environ={})
    assert [inj.slow_factor(s) for s in range(7)] == [1.0, 1.0, 1.0, 2.0, 3.0, 1.5, 1.5]
    assert inj.after_compute(0, 0.5) == 0.0  # inactive: no time spent at all


def test_marker_dir_makes_faults_one_shot_across_instances(tmp_path: Path) -> None:
    first = FaultInjector.from_specs(["nan:step=3"], rank=2, marker_dir=tmp_path, environ={})
    assert first.loss_override(3)
    marker = first.marker_path(first.specs[0])
    assert marker is not None and marker.exists() and "rank=2" in marker.read_text()
    restarted = FaultInjector.from_specs(["nan:step=3"], rank=2, marker_dir=tmp_path, environ={})
    assert not restarted.loss_override(3)
    other_rank = FaultInjector.from_specs(["nan:step=3"], rank=0, marker_dir=tmp_path, environ={})
    assert other_rank.loss_override(3)  # a rank-less spec fires once on each rank


# -- slow: real CPU ----------------------------------------------------------------------------------


def _workload() -> float:
    x = 0.0
    for i in range(1_000_000):
        x += math.sqrt(i)
    return x


def test_slow_doubles_compute_time_and_burns_cpu() -> None:
    inj = FaultInjector.from_specs(["slow:rank=0,factor=2"], rank=0, environ={})
    c0 = time.thread_time()
    _workload()
    compute_cpu = time.thread_time() - c0
    spent = inj.after_compute(7, compute_cpu)
    total_cpu = time.thread_time() - c0
    # The extra work is CPU time of this thread, as the trainer measures compute: a sleep would
    # add none, and other load on the machine cannot stretch or shrink it.
    assert spent == pytest.approx(compute_cpu, rel=0.1)
    assert total_cpu / compute_cpu == pytest.approx(2.0, rel=0.1)


def test_burn_cpu_follows_the_injected_clock() -> None:
    ticks = iter(range(100))
    spent = burn_cpu(5.0, clock=lambda: float(next(ticks)))
    assert spent == 6.0  # start at 0, loop while clock < 5, last reading 6


# -- kill and hang in real child processes ------------------------------------------------------------


def test_kill_sigkills_the_process_at_its_step() -> None:
    proc = run_loop("kill:rank=1,step=3")
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert proc.stdout.split("\n")[:-1] == ["done 0", "done 1", "done 2"]
    assert "kill:rank=1,step=3" in proc.stderr


def test_kill_on_other_rank_does_nothing() -> None:
    proc = run_loop("kill:rank=1,step=3", rank=0)
    assert proc.returncode == 0, proc.stderr
    assert "done 7" in proc.stdout


def test_kill_with_marker_dir_does_not_fire_after_restart(tmp_path: Path) -> None:
    first = run_loop("kill:rank=1,step=2", marker=tmp_path)
    assert first.returncode == -signal.SIGKILL
    assert list(tmp_path.iterdir()), "no marker written before the kill"
    again = run_loop("kill:rank=1,step=2", marker=tmp_path)  # "restarted from a checkpoint"
    assert again.returncode == 0, again.stderr
    assert again.stdout.count("done") == 8


def test_hang_blocks_and_shows_in_py_spy() -> None:
    assert PY_SPY.exists(), f"py-spy not installed at {PY_SPY} (it is a project dependency)"
    proc = subprocess.Popen(
        [sys.executable, "-c", LOOP, "2", "hang:rank=2,step=1", ""],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == "done 0\n"
        time.sleep(1.0)
        assert proc.poll() is None, "hung process exited"
        dump = subprocess.run([str(PY_SPY), "dump", "--pid", str(proc.pid)], capture_output=True, text=True, timeout=30)
        assert dump.returncode == 0, dump.stderr
        assert "hang_forever" in dump.stdout and "before_step" in dump.stdout, dump.stdout
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        if proc.stdout:
            proc.stdout.close()
        if proc.stderr:
            proc.stderr.close()
