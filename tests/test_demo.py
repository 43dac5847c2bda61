"""`trainguard demo --quick` end to end: the kill is healed and the summary is printed."""

from __future__ import annotations

import io

import pytest

from trainguard.demo import run_demo

pytestmark = pytest.mark.slow


def test_demo_heals_the_kill() -> None:
    out = io.StringIO()
    rc = run_demo(quick=True, out=out)
    text = out.getvalue()
    assert rc == 0, text
    assert "=== summary ===" in text and "demo passed" in text
    assert "restore_selected" in text and "job_resumed" in text
    assert "checkpoints in memory" in text
    if "collector ebpf  up" in text:  # per-rank kernel metrics when eBPF runs (root, headers)
        assert "run-queue latency" in text and "demo rank 0" in text
