"""Telemetry ingest: a real unix datagram socket, a real receiver thread, fuzzed datagrams."""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import stat
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import FrozenInstanceError, replace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers.telemetry import make_msg
from tests.helpers.waiting import wait_for
from trainguard.agent.ranktable import RankTable, RankTableConfig
from trainguard.agent.telemetry import TelemetryServer, ensure_dgram_qlen, read_dgram_qlen
from trainguard.agent.wire import (
    MAX_DATAGRAM_BYTES,
    MAX_MESSAGE_BYTES,
    SCHEMA_VERSION,
    Telemetry,
    WireError,
    decode_telemetry,
    split_datagram,
)
from trainguard.run.link import TelemetrySender


@pytest.fixture
def sockdir() -> Iterator[str]:
    # Unix socket paths are limited to 107 bytes; pytest's tmp_path can be longer than that.
    d = tempfile.mkdtemp(prefix="tg-tel-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def sender() -> Iterator[socket.socket]:
    # Blocking, so a full queue (net.unix.max_dgram_qlen) delays the test instead of losing data.
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    yield s
    s.close()





# -- the socket and the receiver thread -------------------------------------------------------


def test_roundtrip_stores_messages_and_sets_mode(sockdir: str, sender: socket.socket) -> None:
    path = os.path.join(sockdir, "t.sock")
    seen: list[Telemetry] = []
    table = RankTable()
    with TelemetryServer(path, table, on_message=seen.append) as server:
        st_mode = os.stat(path).st_mode
        assert stat.S_ISSOCK(st_mode) and stat.S_IMODE(st_mode) == 0o660
        msgs = [make_msg(rank=r, step=s) for s in range(5) for r in range(3)]
        for m in msgs:
            sender.sendto(m.encode(), path)
        wait_for(lambda: server.messages_total == len(msgs))
        assert seen == msgs
        assert table.window("job-1", 2) == [m for m in msgs if m.rank == 2]
        stats = server.stats()
        assert stats.received_total == len(msgs) and stats.dropped_total == {}
        assert stats.queue_limit == read_dgram_qlen()
    assert not os.path.exists(path)


def test_a_datagram_of_several_messages_each_judged_on_its_own(sockdir: str, sender: socket.socket) -> None:
    path = os.path.join(sockdir, "t.sock")
    table = RankTable()
    with TelemetryServer(path, table) as server:
        good = [make_msg(step=s) for s in range(1, 4)]
        sender.sendto(b"\n".join([good[0].encode(), b"{not json", good[1].encode(), b"", good[2].encode()]), path)
        sender.sendto(b"\n".join([make_msg(step=9).encode()] * (MAX_DATAGRAM_BYTES // 200)), path)  # too long
        wait_for(lambda: server.stats().dropped_total.get("size") == 1)
        stats = server.stats()
        assert server.messages_total == 3 and table.window("job-1", 0) == good
        assert stats.dropped_total == {"json": 1, "size": 1} and stats.received_total == 5


def test_sender_gathers_short_steps_and_sends_long_or_urgent_ones_at_once(sockdir: str) -> None:
    path = os.path.join(sockdir, "t.sock")
    table = RankTable()
    now = [100.0]
    with TelemetryServer(path, table) as server:
        link = TelemetrySender(path, flush_s=0.05, clock=lambda: now[0])
        assert link.send(make_msg(step=1))  # the first goes at once
        for step in range(2, 6):  # 4 steps of 10 ms: held
            now[0] += 0.01
            assert link.send(make_msg(step=step))
        wait_for(lambda: server.messages_total == 1)
        time.sleep(0.05)
        assert server.messages_total == 1 and link.stats.sent == 1
        now[0] += 0.02  # 60 ms since the last send: this one takes the held ones along
        assert link.send(make_msg(step=6))
        wait_for(lambda: server.messages_total == 6)
        assert [m.step for m in table.window("job-1", 0)] == [1, 2, 3, 4, 5, 6]
        link.send(make_msg(step=7))
        link.send(make_msg(step=8, ckpt_failed=8, ckpt_error="disk full"), urgent=True)
        wait_for(lambda: server.messages_total == 8)
        link.send(make_msg(step=9))
        link.close()  # what is held goes with the close
        wait_for(lambda: server.messages_total == 9)
        assert link.stats.sent == 9 and link.stats.dropped == 0
    gone = TelemetrySender(path, clock=lambda: now[0])  # no agent listening: dropped, counted
    assert not gone.send(make_msg(step=1)) and gone.stats.dropped == 1
    gone.close()


def test_stop_is_prompt_and_idempotent(sockdir: str) -> None:
    server = TelemetryServer(os.path.join(sockdir, "t.sock"), RankTable(), poll_interval_s=30)
    server.start()
    thread = server._thread
    assert thread is not None
    time.sleep(0.05)  # let the thread block in poll
    server.stop(timeout=5.0)
    assert not thread.is_alive()  # woken at once: its 30 s poll would outlast the 5 s join
    server.stop()


def test_restart_after_stop(sockdir: str, sender: socket.socket) -> None:
    path = os.path.join(sockdir, "t.sock")
    server = TelemetryServer(path, RankTable())
    for round_ in range(2):
        server.start()
        sender.sendto(make_msg(step=round_).encode(), path)
        wait_for(lambda: server.messages_total == round_ + 1, interval=0.002)  # noqa: B023 - evaluated in this iteration
        server.stop()
        assert not os.path.exists(path)


def test_stale_socket_is_replaced(sockdir: str, sender: socket.socket) -> None:
    path = os.path.join(sockdir, "t.sock")
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    dead.bind(path)
    dead.close()  # the file stays, as after an agent crash
    assert os.path.exists(path)
    with TelemetryServer(path, RankTable()) as server:
        sender.sendto(make_msg().encode(), path)
        wait_for(lambda: server.messages_total == 1)


def test_live_socket_and_regular_file_are_not_touched(sockdir: str) -> None:
    path = os.path.join(sockdir, "t.sock")
    with TelemetryServer(path, RankTable()):
        with pytest.raises(OSError, match="another process"):
            TelemetryServer(path, RankTable()).start()
        assert stat.S_ISSOCK(os.stat(path).st_mode)
    other = os.path.join(sockdir, "file")
    with open(other, "w") as fh:
        fh.write("precious")
    with pytest.raises(OSError, match="not a socket"):
        TelemetryServer(other, RankTable()).start()
    with open(other) as fh:
        assert fh.read() == "precious"


def test_callback_errors_are_counted_not_fatal(sockdir: str, sender: socket.socket) -> None:
    path = os.path.join(sockdir, "t.sock")

    def boom(msg: Telemetry) -> None:
        raise RuntimeError("detector bug")

    with TelemetryServer(path, RankTable(), on_message=boom) as server:
        for step in range(3):
            sender.sendto(make_msg(step=step).encode(), path)
        # The receiver counts a message before its callback runs: wait for both counts.
        wait_for(lambda: server.messages_total == 3 and server.callback_errors_total >= 3)
        assert server.callback_errors_total == 3 and server.messages_total == 3


def test_unknown_jobs_rejected_when_configured(sockdir: str, sender: socket.socket) -> None:
    path = os.path.join(sockdir, "t.sock")
    table = RankTable(RankTableConfig(accept_unknown_jobs=False))
    table.register_job("known")
    with TelemetryServer(path, table) as server:
        sender.sendto(make_msg(job="known").encode(), path)
        sender.sendto(make_msg(job="stranger").encode(), path)
        wait_for(lambda: server.received_total == 2)
        wait_for(lambda: server.messages_total == 1)
        assert server.dropped_total == {"unknown_job": 1}
        assert table.jobs() == ["known"]
        table.forget_job("known")  # unregisters too
        sender.sendto(make_msg(job="known").encode(), path)
        wait_for(lambda: server.dropped_total.get("unknown_job") == 2)


def test_burst_beyond_queue_limit_is_not_lost_by_the_agent(sockdir: str) -> None:
    """A non-blocking sender (like TelemetrySender) bursting past the kernel's queue cap: every
    datagram the kernel accepted must be stored."""
    path = os.path.join(sockdir, "t.sock")
    with TelemetryServer(path, RankTable()) as server:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        s.setblocking(False)
        sent = 0
        for step in range(2000):
            try:
                s.sendto(make_msg(rank=step % 64, step=step).encode(), path)
                sent += 1
            except BlockingIOError:
                time.sleep(0.0005)
        s.close()
        wait_for(lambda: server.received_total == sent)
        assert server.messages_total == sent
        assert sent > 100


def test_ensure_dgram_qlen_on_fake_proc(tmp_path: Any) -> None:
    sysctl = tmp_path / "sys" / "net" / "unix"
    sysctl.mkdir(parents=True)
    (sysctl / "max_dgram_qlen").write_text("10\n")
    assert ensure_dgram_qlen(512, str(tmp_path)) == 512
    assert ensure_dgram_qlen(64, str(tmp_path)) == 512  # never lowered
    assert read_dgram_qlen(str(tmp_path / "nowhere")) is None


def test_min_queue_raises_the_cap_before_binding(tmp_path: Any, sockdir: str) -> None:
    sysctl = tmp_path / "sys" / "net" / "unix"
    sysctl.mkdir(parents=True)
    (sysctl / "max_dgram_qlen").write_text("10\n")
    with TelemetryServer(os.path.join(sockdir, "t.sock"), RankTable(), proc_root=str(tmp_path),
                         min_queue=256) as server:
        assert server.stats().queue_limit == 256
    assert (sysctl / "max_dgram_qlen").read_text().strip() == "256"


# -- fuzzing over the real socket -------------------------------------------------------------

_job = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-_", min_size=1, max_size=12)
_time = st.floats(min_value=0, max_value=1000, allow_nan=False)
valid_msgs = st.builds(
    make_msg,
    job=_job,
    rank=st.integers(0, 1 << 20),
    step=st.integers(0, 1 << 53),
    wall_time=st.floats(min_value=0, max_value=4e9, allow_nan=False),
    step_s=_time, data_s=_time, fwd_bwd_s=_time, comm_s=_time, opt_s=_time,
    samples=st.integers(0, 1 << 40),
    loss=st.floats(allow_nan=False),  # NaN != NaN would break the equality check below
    lr=st.floats(min_value=0, max_value=1e3),
    plan_version=st.integers(0, 1 << 53),
)

_INT_FIELDS = ["rank", "local_rank", "pid", "step", "samples", "tokens", "batch_size", "mem_bytes", "plan_version"]
_BOUNDED = {  # field -> a value outside its range
    "rank": -1, "pid": 0, "step": (1 << 53) + 1, "lr": 1e4, "step_s": -0.5, "data_s": 86401.0,
    "batch_size": -3, "mem_bytes": 1 << 61, "mfu": 2.0, "world_size": 0, "update_cos": 1.5,
}


def _body(msg: Telemetry) -> dict[str, Any]:
    body: dict[str, Any] = json.loads(msg.encode())
    return body


def test_a_message_without_steps_or_loss_is_one_step_with_no_loss() -> None:
    body = _body(make_msg(step=7, samples=12))
    del body["steps"], body["loss"]
    msg = decode_telemetry(json.dumps(body).encode())
    assert (msg.step, msg.steps, msg.samples_per_step) == (7, 1, 12.0)
    assert not msg.has_loss and math.isnan(msg.loss)
    body["steps"] = 0  # a message sums up at least one step
    with pytest.raises(WireError) as err:
        decode_telemetry(json.dumps(body).encode())
    assert err.value.reason == "range"


def test_parts_of_a_message_must_add_up_to_its_steps_and_samples() -> None:
    body = _body(make_msg(step=8, samples=32, steps=4))
    body["parts"] = [[2, 0.01, 0.002, 16, 2.5], [2, 0.02, 0.001, 16, None]]
    msg = decode_telemetry(json.dumps(body).encode())
    assert msg.parts == [[2, 0.01, 0.002, 16, 2.5], [2, 0.02, 0.001, 16, None]]
    assert decode_telemetry(msg.encode()).parts == msg.parts  # the field goes back on the wire
    body["parts"][1][4] = math.nan  # a diverged step's loss is information
    assert math.isnan(decode_telemetry(json.dumps(body, allow_nan=True).encode()).parts[1][4])
    bad: list[tuple[Any, str]] = [
        ([[2, 0.01, 0.002, 16, 1.0], [1, 0.02, 0.001, 16, 1.0]], "range"),  # 3 steps of 4
        ([[2, 0.01, 0.002, 16, 1.0], [2, 0.02, 0.001, 15, 1.0]], "range"),  # 31 samples of 32
        ([[4, math.nan, 0.0, 32, 1.0]], "range"),
        ([[4, -0.1, 0.0, 32, 1.0]], "range"),
        ([[4, 0.1, 0.0, 32]], "schema"),
        ([[4, 0.1, 0.0, 32, "1"]], "type"),
        ([[4.0, 0.1, 0.0, 32, 1.0]], "type"),
        ([[True, 0.1, 0.0, 32, 1.0]], "type"),
        ([], "schema"),
        ("4", "schema"),
        ([[1, 0.1, 0.0, 8, 1.0]] * 33, "schema"),
    ]
    for parts, reason in bad:
        body["parts"] = parts
        with pytest.raises(WireError) as err:
            decode_telemetry(json.dumps(body, allow_nan=True).encode())
        assert err.value.reason == reason, (parts, err.value)


@st.composite
def bad_datagrams(draw: st.DrawFn) -> tuple[bytes, str | None]:
    """(datagram, expected drop reason or None when any reason will do)."""
    kind = draw(st.sampled_from(["bytes", "wrong_type", "range", "nonfinite", "size", "missing", "unknown",
                                 "version", "not_object", "bad_job", "bool"]))
    body = _body(draw(valid_msgs))
    if kind == "bytes":
        return draw(st.binary(max_size=300)), None
    if kind == "wrong_type":
        name = draw(st.sampled_from(_INT_FIELDS + ["lr", "step_s"]))  # loss is optional: null means none
        body[name] = draw(st.one_of(st.text(max_size=5), st.lists(st.integers(), max_size=2), st.none(),
                                    st.dictionaries(st.text(max_size=2), st.integers(), max_size=1)))
        if name in _INT_FIELDS and draw(st.booleans()):
            body[name] = draw(st.floats(allow_nan=False))  # a float where an int belongs
        return json.dumps(body).encode(), "type"
    if kind == "bool":
        body[draw(st.sampled_from(_INT_FIELDS))] = draw(st.booleans())
        return json.dumps(body).encode(), "type"
    if kind == "range":
        name = draw(st.sampled_from(sorted(_BOUNDED)))
        body[name] = _BOUNDED[name]
        return json.dumps(body).encode(), "range"
    if kind == "nonfinite":
        body[draw(st.sampled_from(["step_s", "wall_time", "lr", "comm_s"]))] = draw(
            st.sampled_from([math.nan, math.inf, -math.inf]))
        return json.dumps(body).encode(), "range"
    if kind == "size":
        body["pad"] = "x" * draw(st.integers(MAX_MESSAGE_BYTES, 3 * MAX_MESSAGE_BYTES))
        return json.dumps(body).encode(), "size"
    if kind == "missing":
        # loss may be absent (no loss reported), steps too (one step per message)
        del body[draw(st.sampled_from(sorted(k for k in body if k not in ("v", "loss", "steps"))))]
        return json.dumps(body).encode(), "schema"
    if kind == "unknown":
        body[draw(st.sampled_from(["extra", "Rank", "Steps"]))] = 1
        return json.dumps(body).encode(), "schema"
    if kind == "version":
        body["v"] = draw(st.sampled_from([0, 2, "1", None, 1.5]))
        return json.dumps(body).encode(), "version"
    if kind == "bad_job":
        body["job"] = draw(st.sampled_from(["", ".hidden", "a b", "x" * 65, 7, None]))
        return json.dumps(body).encode(), "schema"
    return json.dumps(draw(st.one_of(st.lists(st.integers(), max_size=3), st.integers(), st.text(max_size=5)))).encode(), None


def test_fuzzed_datagrams_over_real_socket(sockdir: str, sender: socket.socket) -> None:
    path = os.path.join(sockdir, "t.sock")
    table = RankTable(RankTableConfig(max_foreign_jobs=1 << 16))  # hypothesis invents many job ids
    server = TelemetryServer(path, table)
    server.start()
    try:

        @settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
        @given(st.lists(st.one_of(valid_msgs.map(lambda m: (m, None)),
                                  bad_datagrams().map(lambda b: (None, b))), min_size=1, max_size=12))
        def run(items: list[tuple[Telemetry | None, tuple[bytes, str | None] | None]]) -> None:
            before_rx, before_ok = server.received_total, server.messages_total
            before_drop = dict(server.dropped_total)
            good: list[Telemetry] = []
            expected: dict[str, int] = {}
            unspecified = 0
            messages = 0  # a datagram holds one message per line: random bytes may hold several
            for msg, bad in items:
                if msg is not None:
                    sender.sendto(msg.encode(), path)
                    good.append(msg)
                    messages += 1
                else:
                    assert bad is not None
                    data, reason = bad
                    sender.sendto(data, path)
                    parts = len(split_datagram(data))
                    messages += parts
                    if reason is None:
                        unspecified += parts
                    else:
                        expected[reason] = expected.get(reason, 0) + 1
            # Received is counted before decoding; wait until every message was also stored or dropped.
            before_dropped = sum(before_drop.values())
            wait_for(lambda: server.received_total == before_rx + messages
                     and server.messages_total - before_ok + sum(server.dropped_total.values()) - before_dropped
                     == messages, what="every message stored or dropped", interval=0.002)
            assert server.messages_total - before_ok == len(good)
            delta = {k: v - before_drop.get(k, 0) for k, v in server.dropped_total.items()
                     if v != before_drop.get(k, 0)}
            assert sum(delta.values()) == messages - len(good)
            for reason, n in expected.items():
                assert delta.get(reason, 0) >= n, (reason, delta, expected)
            assert sum(delta.values()) - sum(expected.values()) == unspecified
            for msg in good:
                assert msg in table.window(msg.job, msg.rank, n=len(good))

        run()
        assert server._thread is not None and server._thread.is_alive()
    finally:
        server.stop()


# -- the table ----------------------------------------------------------------------------------


def test_ring_keeps_newest_in_order() -> None:
    table = RankTable(RankTableConfig(ring=4, window=3))
    for step in range(10):
        assert table.add(make_msg(step=step), now=float(step)) is None
    assert [m.step for m in table.window("job-1", 0)] == [6, 7, 8, 9]
    assert [m.step for m in table.window("job-1", 0, 2)] == [8, 9]
    assert table.window("job-1", 0, 0) == []
    assert table.window("job-1", 5) == [] and table.window("nojob", 0) == []
    assert table.latest("job-1", 0) == make_msg(step=9)
    view = table.snapshot().jobs["job-1"][0]
    assert view.messages == 10 and view.samples_total == 320 and view.window_len == 3
    assert view.last_seen == 9.0


def test_snapshot_medians_and_rates() -> None:
    table = RankTable(RankTableConfig(window=5), clock=lambda: 123.0)
    step_times = [0.9, 0.1, 0.3, 0.2, 0.5, 0.4]  # window keeps the last five: median 0.3
    for step, step_s in enumerate(step_times):
        table.add(make_msg(step=step, wall_time=100 + step * 0.5, step_s=step_s,
                           fwd_bwd_s=step_s / 2, opt_s=0.01, comm_s=step * 0.01, samples=8, tokens=80))
    table.add(make_msg(rank=1, step=0))
    snap = table.snapshot()
    assert snap.taken_at == 123.0
    v = snap.jobs["job-1"][0]
    assert v.median_step_s == pytest.approx(0.3)
    assert v.median_compute_s == pytest.approx(0.15 + 0.01)
    assert v.median_comm_s == pytest.approx(0.03)
    assert v.steps_per_s == pytest.approx(2.0) and v.samples_per_s == pytest.approx(16.0)
    assert v.tokens_per_s == pytest.approx(160.0)
    assert v.step == 5 and v.step_s == 0.4 and v.last_seen == 123.0
    one = snap.jobs["job-1"][1]
    assert one.steps_per_s is None and one.median_step_s == 0.1  # one step: a median, no rate
    assert [r.rank for r in snap.ranks()] == [0, 1]
    assert json.loads(json.dumps(snap.as_dict()))["jobs"]["job-1"]["0"]["step"] == 5


def test_rate_after_restart_spans_only_new_run() -> None:
    table = RankTable(RankTableConfig(window=8))
    for step, wall in [(10, 100.0), (11, 101.0), (12, 102.0), (5, 200.0), (6, 200.25), (7, 200.5)]:
        table.add(make_msg(step=step, wall_time=wall))
    assert table.snapshot().jobs["job-1"][0].steps_per_s == pytest.approx(4.0)


def test_snapshot_is_immutable_and_cache_refreshes() -> None:
    table = RankTable()
    table.add(make_msg(step=1))
    first = table.snapshot()
    with pytest.raises(TypeError):
        first.jobs["x"] = {}  # type: ignore[index]
    with pytest.raises(FrozenInstanceError):
        first.jobs["job-1"][0].step = 7  # type: ignore[misc]
    assert table.snapshot().jobs["job-1"][0] is first.jobs["job-1"][0]  # unchanged rank: cached view
    table.add(make_msg(step=2))
    assert table.snapshot().jobs["job-1"][0].step == 2
    assert first.jobs["job-1"][0].step == 1


def test_forget_job_and_table_limit() -> None:
    table = RankTable(RankTableConfig(max_ranks=3))
    for rank in range(3):
        table.add(make_msg(job="a", rank=rank))
    assert table.add(make_msg(job="b", rank=0)) == "table_full"
    assert table.add(make_msg(job="a", rank=2, step=2)) is None  # existing ranks still update
    table.forget_job("a")
    assert len(table) == 0 and table.jobs() == []
    assert table.add(make_msg(job="b", rank=0)) is None
    assert list(table.snapshot().jobs) == ["b"]


@pytest.mark.parametrize("key,value", [("ring", 0), ("window", -1), ("max_ranks", 1.5), ("ring", True)])
def test_config_errors_name_the_key(key: str, value: Any) -> None:
    with pytest.raises(ValueError, match=f"telemetry.{key}"):
        RankTableConfig(**{key: value})
    with pytest.raises(ValueError, match="telemetry.window"):
        RankTableConfig(ring=8, window=9)


def test_concurrent_snapshots_while_adding() -> None:
    table = RankTable(RankTableConfig(ring=16, window=8))
    stop = threading.Event()
    errors: list[BaseException] = []

    def writer() -> None:
        step = 0
        while not stop.is_set():
            table.add_many([make_msg(rank=r, step=step) for r in range(32)])
            step += 1

    t = threading.Thread(target=writer)
    t.start()
    try:
        for _ in range(50):
            snap = table.snapshot()
            for v in snap.ranks():
                if v.window_len > 1 and v.steps_per_s is None:
                    errors.append(AssertionError(v))
    finally:
        stop.set()
        t.join()
    assert not errors
    assert len(table.snapshot().jobs["job-1"]) == 32


def test_plan_version_and_optional_fields_flow_through() -> None:
    table = RankTable()
    table.add(replace(make_msg(), plan_version=3, dp_rank=1, world_size=4))
    v = table.snapshot().jobs["job-1"][0]
    assert (v.plan_version, v.dp_rank, v.world_size) == (3, 1, 4)
    assert SCHEMA_VERSION == 1
