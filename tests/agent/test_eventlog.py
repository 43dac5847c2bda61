"""The event log is durable: an agent killed with SIGKILL mid-run leaves a readable log."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

from trainguard.agent.eventlog import LOG_NAME, EventLog, read_log_file


def test_emit_read_and_cursor(tmp_path) -> None:
    log = EventLog(str(tmp_path), "n1", fsync=False)
    for i in range(5):
        log.emit("test", f"event {i}", job="j", rank=i, cause="because", value=i)
    items = log.since(2)
    assert [e["seq"] for e in items] == [3, 4, 5]
    assert items[0]["cause"] == "because" and items[0]["fields"]["value"] == 2
    assert log.counts[("test", "info")] == 5
    log.close()
    again = EventLog(str(tmp_path), "n1", fsync=False)
    assert again.last_seq == 5  # sequence continues across restarts
    assert again.emit("x", "y").seq == 6


def test_rotation_keeps_files_and_history(tmp_path) -> None:
    log = EventLog(str(tmp_path), "n1", max_bytes=4096, keep=2, memory=10, fsync=False)
    for i in range(200):
        log.emit("fill", "x" * 50, i=i)
    files = sorted(os.listdir(tmp_path))
    assert LOG_NAME in files and f"{LOG_NAME}.1" in files and f"{LOG_NAME}.2" in files
    assert f"{LOG_NAME}.3" not in files
    assert os.path.getsize(tmp_path / LOG_NAME) < 4096 + 200
    # A cursor older than the in-memory tail is served from the files.
    seqs = [e["seq"] for e in log.since(150, limit=1000)]
    assert seqs == list(range(151, 201))


def test_torn_line_is_skipped_and_not_glued(tmp_path) -> None:
    log = EventLog(str(tmp_path), "n1", fsync=False)
    log.emit("a", "first")
    log.close()
    with open(tmp_path / LOG_NAME, "ab") as fh:
        fh.write(b'{"seq": 2, "kind": "torn", "mess')
    log = EventLog(str(tmp_path), "n1", fsync=False)
    log.emit("b", "second")
    log.close()
    kinds = [e["kind"] for e in read_log_file(str(tmp_path / LOG_NAME))]
    assert kinds == ["a", "b"]


def test_sigkill_mid_run_leaves_readable_log(tmp_path) -> None:
    writer = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {os.getcwd()!r})
        from trainguard.agent.eventlog import EventLog
        log = EventLog({str(tmp_path)!r}, "n1", max_bytes=64 * 1024, keep=3)
        i = 0
        while True:
            log.emit("tick", "payload " * 20, i=i)
            i += 1
            if i == 50:
                print("ready", flush=True)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", writer], stdout=subprocess.PIPE)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == b"ready"
    time.sleep(0.3)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    log = EventLog(str(tmp_path), "n1")
    events = log.since(0, limit=10**6)
    assert len(events) >= 50
    seqs = [e["seq"] for e in events]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    # Every complete line parses; the resumed log keeps counting.
    for line in open(tmp_path / LOG_NAME, "rb").read().splitlines()[:-1]:
        json.loads(line)
    assert log.emit("after", "restart").seq == seqs[-1] + 1
