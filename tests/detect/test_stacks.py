"""Hang evidence per rank: scheduler state, wait channel, Python stack, also of a stopped process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from trainguard.agent.detect.stacks import RankProbe, probe, process_state, py_spy_path


def test_process_state_from_a_proc_tree(tmp_path: Path) -> None:
    d = tmp_path / "42"
    d.mkdir()
    (d / "stat").write_text("42 (python (x) y) T 1 42 42 0 -1 4194560 0 0 0 0 5 3 0 0 20 0 3 0\n")
    (d / "wchan").write_text("do_signal_stop")
    assert process_state(42, tmp_path) == ("T", "do_signal_stop")
    assert process_state(43, tmp_path) == ("", "")
    assert probe(43, proc_root=tmp_path).error == "process is gone"


def test_a_failing_py_spy_reports_its_error_not_an_empty_stack(tmp_path: Path) -> None:
    fake = tmp_path / "py-spy"
    fake.write_text("#!/bin/sh\necho 'Process 1: header only'\necho 'Error: Failed to find python version' >&2\nexit 1\n")
    fake.chmod(0o755)
    got = probe(os.getpid(), py_spy=str(fake))
    assert got.stack == "" and got.error == "py-spy exited 1: Error: Failed to find python version"
    assert got.state.startswith(("R", "S"))


def test_a_stopped_process_gets_its_python_stack_and_stays_stopped(tmp_path: Path) -> None:
    script = tmp_path / "sleeper.py"
    script.write_text("import time\n\ndef waiting_here():\n    time.sleep(60)\n\nwaiting_here()\n")
    assert py_spy_path() is not None, "py-spy is a dependency of trainguard"
    proc = subprocess.Popen([sys.executable, str(script)])
    try:
        time.sleep(1.0)
        os.kill(proc.pid, signal.SIGSTOP)
        time.sleep(0.1)
        got: RankProbe = probe(proc.pid, timeout_s=20)
        assert got.state == "T (stopped)" and got.resumed_for_dump, got
        assert "waiting_here" in got.stack, got
        assert process_state(proc.pid)[0] == "T"  # stopped again, as it was found
        assert got.to_dict()["resumed_for_dump"] is True
    finally:
        proc.kill()
        proc.wait()
