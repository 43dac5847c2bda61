"""The CPU-activity probe behind hang verdicts for users' commands (trainguard.agent.detect.activity):
progress reported by the job spares the /proc scan, and idleness is still counted from the last step."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterable

from trainguard.agent.detect.activity import ActivityProbe, tree_cpu_seconds


class FakeCpu:
    """CPU seconds of a job's ranks as the test sets them; counts the scans."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.reads = 0

    def __call__(self, pids: Iterable[int]) -> float:
        self.reads += 1
        return self.seconds


def test_steps_that_move_on_are_activity_without_a_scan() -> None:
    cpu = FakeCpu()
    probe = ActivityProbe(min_cores=0.02, cpu_of=cpu)
    assert probe.observe("j", [10, 11], 0.0, progress=5) == 0.0
    first = cpu.reads
    for i in range(1, 20):
        assert probe.observe("j", [10, 11], float(i), progress=5 + i) == 0.0
    assert cpu.reads == first  # no /proc read while the job reports new steps


def test_idleness_after_the_last_step_counts_from_that_step() -> None:
    cpu = FakeCpu()
    probe = ActivityProbe(min_cores=0.02, cpu_of=cpu)
    probe.observe("j", [10], 0.0, progress=1)
    probe.observe("j", [10], 1.0, progress=2)  # the last step, at t=1
    assert probe.observe("j", [10], 2.0, progress=2) == 1.0  # first read since: counted from t=1
    assert probe.observe("j", [10], 4.0, progress=2) == 3.0  # no CPU used: still idle since t=1
    cpu.seconds = 1.0  # the ranks compute (a long evaluation): active again
    assert probe.observe("j", [10], 5.0, progress=2) == 0.0
    assert probe.observe("j", [10], 7.0, progress=2) == 2.0
    assert probe.idle_for("j", 7.0) == 2.0


def test_a_silent_job_is_judged_on_its_cpu_alone() -> None:
    cpu = FakeCpu()
    probe = ActivityProbe(min_cores=0.02, cpu_of=cpu)
    probe.observe("j", [10], 0.0)
    cpu.seconds = 0.5
    assert probe.observe("j", [10], 1.0) == 0.0
    assert probe.observe("j", [10], 3.0) == 2.0
    assert cpu.reads == 3
    assert probe.observe("j", [12], 4.0) == 0.0  # a new attempt (other pids) starts its clock


def _beyond_own_cpu() -> float:
    """The tree's CPU seconds beyond this process's own. Its own is read first: the scan of /proc
    costs CPU too (more with many processes, as under CI), which a reading after it would count,
    and /proc's figures are whole clock ticks (fresh-clone CI once read 0.1996 for a 0.3 s child)."""
    own = time.process_time()
    return tree_cpu_seconds([os.getpid()]) - own


def test_tree_cpu_seconds_counts_a_child_of_the_rank() -> None:
    # The child says when it has spent its 0.5 s: waiting on a reading that crosses the bar races
    # the next reading, in which this process's own precise time has grown and /proc's whole ticks
    # have not (fresh-clone CI once read 0.29997 just after 0.3).
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.5: pass\nprint('spent', flush=True)\ntime.sleep(30)"
    child = subprocess.Popen([sys.executable, "-c", burn], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "spent"
        assert _beyond_own_cpu() >= 0.4
        assert tree_cpu_seconds([child.pid]) >= 0.4
    finally:
        child.kill()
        child.wait()
