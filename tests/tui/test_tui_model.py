"""The dashboard's pure rules (tui.model, tui.source, refusal wording): what a rank's state is,
how rows are filtered and sorted, how histograms and checkpoint tiers are summarised, and how the
controller history and the API data source behave, without a terminal."""

from __future__ import annotations

import math

import pytest

from trainguard.agent.api.client import ApiClient, ApiClientError
from trainguard.tui import model
from trainguard.tui.fake import T0, scene_checkpoints, scene_status
from trainguard.tui.screens.main import polite_refusal
from trainguard.tui.source import AgentSnapshot, ApiDataSource, clients_from_args


def snap(status: dict | None = None, **kw) -> AgentSnapshot:  # noqa: ANN003
    return AgentSnapshot("sock", status=status if status is not None else scene_status(), **kw)


def test_rank_state_rules() -> None:
    alive = {"alive": True, "telemetry": {"last_seen": T0 - 1, "median_step_s": 0.1}}
    assert model.rank_state(alive, "running", T0) == "running"
    assert model.rank_state(alive, "running", T0 + 30) == "silent 31s"  # quiet > max(5 s, 10 steps)
    assert model.rank_state({"alive": True, "telemetry": {"last_seen": T0, "median_step_s": 2.0}}, "running",
                            T0 + 15) == "running"  # 15 s is under 10 slow steps
    assert model.rank_state({"alive": False, "exit_code": 3}, "failed", T0) == "exit 3"
    assert model.rank_state({"alive": False, "exit_code": -9, "exit_signal": "SIGKILL"}, "running", T0) == "killed SIGKILL"
    assert model.rank_state({"telemetry": {"last_seen": T0}}, "external", T0) == "external"
    assert model.rank_state({"alive": True}, "restarting", T0) == "restarting"


def test_rank_rows_from_status_and_missing_fields() -> None:
    rows = model.rank_rows([snap()], T0)
    assert len(rows) == 6
    slow = next(r for r in rows if r.job == "gpt-small" and r.rank == 2)
    assert slow.straggling and slow.score == pytest.approx(0.76) and "cpu contention" in slow.cause
    assert slow.batch_share == pytest.approx(24 / 144)
    dead = next(r for r in rows if r.job == "mlp" and r.rank == 1)
    assert dead.state == "killed SIGKILL" and not dead.healthy
    # Today's agent: no straggler fields, NaN loss, no telemetry at all for a starting rank.
    status = {"node": "n", "jobs": [{"job": "j", "state": "running", "ranks": [
        {"rank": 0, "alive": True, "telemetry": {"step": 3, "step_s": 0.2, "compute_s": 0.1, "loss": float("nan"),
                                                 "batch_size": 8}},
        {"rank": 1, "alive": True}, {"rank": None, "alive": True}]}]}
    r0, r1 = model.rank_rows([snap(status)], T0)
    assert r0.score is None and r0.loss is None and r0.step_s == 0.2 and r0.compute_s == 0.1
    cells = {c.key: c.cell(r0) for c in model.RANK_COLUMNS}
    assert cells["score"] == "n/a" and cells["cause"] == "n/a" and cells["step_ms"] == "200.0"
    assert r1.step is None and r1.batch_share is None and model.RANK_COLUMNS[4].cell(r1) == "n/a"
    assert r0.batch_share == 1.0


def test_filter_and_sort() -> None:
    rows = model.rank_rows([snap()], T0)
    assert [r.rank for r in model.select_rows(rows, "gpt rank2", "rank", False)] == [2]
    assert [r.job for r in model.select_rows(rows, "KILLED", "rank", False)] == ["mlp"]
    assert {r.rank for r in model.select_rows(rows, "straggler", "rank", False)} == {2}
    by_score = model.select_rows(rows, "", "score", False)
    assert by_score[0].score == pytest.approx(0.76) and by_score[-1].score is None  # n/a sorts last
    by_step_desc = model.select_rows(rows, "", "step_ms", True)
    assert by_step_desc[0].step_s == pytest.approx(0.412)
    by_rank = model.select_rows(rows, "", "rank", False)
    assert [(r.job, r.rank) for r in by_rank][:2] == [("gpt-small", 0), ("gpt-small", 1)]


def test_log2_histogram_summary() -> None:
    slots = [0] * 32
    slots[3], slots[10] = 99, 1  # 99 waits in [8, 16) µs, one in [1024, 2048) µs
    assert model.log2_quantile_s(slots, 0.5) == pytest.approx(16e-6)
    assert model.log2_quantile_s(slots, 0.995) == pytest.approx(2048e-6)
    assert model.log2_quantile_s([0] * 32, 0.5) is None
    bars = model.sparkbars(slots)
    assert len(bars) == 8 and bars[0] == "█" and bars[-1] != " " and bars[1] == " "
    lines = model.kernel_lines([snap()])
    assert {(h.histogram, h.series) for h in lines} >= {("runq_latency", "gpt-small/2"), ("block_io_latency", "nvme0n1")}
    assert model.kernel_lines([snap({"node": "n", "jobs": []})]) == []
    assert model.fmt_latency(16e-6) == "16us" and model.fmt_latency(0.0164) == "16.4ms"


def test_checkpoint_rows_newest_per_tier_and_errors() -> None:
    rows = model.checkpoint_rows([snap(checkpoints=scene_checkpoints())], T0, lambda ts: f"t{ts - T0:+.0f}")
    assert [r[2] for r in rows] == ["memory", "disk", "object"]  # fastest tier first
    memory = rows[0]
    assert memory[3] == "1100" and memory[4] == "35s" and memory[5] == "220.0 MB" and memory[6] == "t-35"
    assert memory[7] == "2"
    assert rows[2][3] == "error" and "connection refused" in rows[2][6]
    # The status-row form (newest_step, age_seconds, size_bytes) is read too.
    alt = [{"tier": "disk", "job": "j", "newest_step": 7, "age_seconds": 4000, "size_bytes": 10}]
    (row,) = model.checkpoint_rows([snap(checkpoints=alt)], T0, str)
    assert row[3] == "7" and row[4] == "67m" and row[5] == "10 B"


def test_gpu_rows_and_absence() -> None:
    rows = model.gpu_rows([snap()])
    assert rows[1][7] == "hw_thermal" and rows[1][8] == "1 (last 79)" and rows[0][3] == "97%"
    assert model.gpu_rows([snap({"node": "n", "jobs": []})]) == []
    partial = {"node": "n", "gpus": {"0": {"name": "X", "temperature_c": float("nan")}}}
    (row,) = model.gpu_rows([snap(partial)])
    assert row[1] == "0" and row[5] == "n/a" and row[3] == "n/a"


def test_controller_history_points_and_restart() -> None:
    hist = model.ControllerHistory()
    assert hist.add([snap(scene_status(tick=0))])
    assert not hist.add([snap(scene_status(tick=0))])  # same step: no new point
    hist.add([snap(scene_status(tick=20))])
    series = hist.jobs["gpt-small"]
    assert list(series.steps) == [600, 1000]
    assert list(series.lr) == [1.2e-3, 6e-4] and list(series.batch) == [128, 144]
    assert math.isfinite(series.loss[-1]) and series.loss[-1] < series.loss[0]
    hist.add([snap(scene_status(tick=1))])  # a restart went back in steps: the series starts over
    assert list(hist.jobs["gpt-small"].steps) == [620]


def test_events_cause_and_search() -> None:
    e = {"seq": 5, "kind": "straggler_detected", "severity": "warning", "node": "n1", "job": "j", "rank": 2,
         "message": "rank 2 slow", "cause": "cpu_contention", "fields": {"action": "migrate", "score": 0.7}}
    assert model.event_cause(e) == "cpu_contention → migrate"
    assert model.event_where(e, True) == "n1/j/r2" and model.event_where({}, False) == "-"
    assert model.matches(model.event_text(e), "straggler CPU_contention")
    assert not model.matches(model.event_text(e), "straggler oom")


def test_polite_refusals() -> None:
    assert "may only read" in polite_refusal("checkpoint", ApiClientError(403, "POST /v1/x: read-only"))
    assert "--token-file" in polite_refusal("checkpoint", ApiClientError(401, "POST /v1/x: bad token"))
    text = polite_refusal("drain", ApiClientError(501, "POST /v1/jobs/j/drain: draining needs healing"))
    assert text == "drain not available on this agent: draining needs healing"
    assert polite_refusal("drain", ApiClientError(0, "no agent at /s")).startswith("drain not sent: no agent")
    assert "(HTTP 404)" in polite_refusal("checkpoint", ApiClientError(404, "GET /v1/y: no job 'x'"))


def test_api_source_reports_an_unreachable_agent(tmp_path) -> None:  # noqa: ANN001
    source = ApiDataSource([ApiClient.local(tmp_path / "none.sock", timeout=1), ApiClient.local(tmp_path / "none.sock")])
    assert source.agents() == [str(tmp_path / "none.sock"), f"{tmp_path / 'none.sock'} #2"]
    snaps = source.poll()
    assert [s.up for s in snaps] == [False, False] and "no agent at" in (snaps[0].error or "")
    with pytest.raises(ApiClientError) as info:
        source.checkpoint_now(str(tmp_path / "none.sock"), "j")
    assert info.value.status == 0
    with pytest.raises(ApiClientError):
        source.drain("elsewhere", "j", rank=0)


def test_clients_from_args(tmp_path) -> None:  # noqa: ANN001
    (local,) = clients_from_args(str(tmp_path), None, None)
    assert local.where == str(tmp_path / "run" / "agent.sock")
    token = tmp_path / "t"
    token.write_text("abc-0123456789abcdef\n")
    token.chmod(0o600)
    clients = clients_from_args(None, "h1:9479, h2:9480", str(token))
    assert [c.where for c in clients] == ["h1:9479", "h2:9480"]
    with pytest.raises(ValueError, match="token-file"):
        clients_from_args(None, "h1:9479", None)
    with pytest.raises(ValueError, match="HOST:PORT"):
        clients_from_args(None, "h1", str(token))
