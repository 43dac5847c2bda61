"""Bounded telemetry: a byte budget for the table, eviction of silent foreign jobs, and ranks of an
agent-launched job capped at its nproc; every refusal is a counted drop."""

from __future__ import annotations

import socket
import sys
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import in_process_agent_config
from tests.helpers.telemetry import make_msg
from tests.helpers.waiting import wait_for
from trainguard.agent.daemon import Agent
from trainguard.agent.lifecycle.jobs import JobSpec
from trainguard.agent.ranktable import MESSAGE_BYTES, RANK_BYTES, RankTable, RankTableConfig
from trainguard.agent.telemetry import TelemetryServer
from trainguard.agent.wire import decode_telemetry

MIB = 1 << 20


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def sender() -> Iterator[socket.socket]:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        yield s
    finally:
        s.close()


def test_the_byte_estimate_covers_what_the_table_really_holds() -> None:
    table = RankTable(RankTableConfig(max_bytes=64 * MIB, max_foreign_jobs=1 << 16))
    data = [make_msg(f"job-{r % 4}", rank=r, step=s, ckpt_error="e" * (s % 50)).encode()
            for r in range(40) for s in range(300)]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        msgs = [decode_telemetry(d) for d in data]  # what the receiver stores: decoded datagrams
        table.add_many(msgs)
        del msgs
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    # The estimate may be generous but must not undercount: the budget is only as good as it.
    assert held <= table.bytes_used <= 2 * held, (held, table.bytes_used)


def test_a_flood_of_invented_ranks_stays_within_the_byte_budget(tmp_path: Path, sender: socket.socket) -> None:
    table = RankTable(RankTableConfig(max_bytes=MIB, max_foreign_jobs=8))
    path = str(tmp_path / "telemetry.sock")
    with TelemetryServer(path, table) as server:
        sender.setblocking(False)
        sent, deadline = 0, time.monotonic() + 5.0
        while sent < 20_000 and time.monotonic() < deadline:  # bounded in count and in time
            try:
                sender.sendto(make_msg(f"flood-{sent % 8}", rank=sent, step=1).encode(), path)
                sent += 1
            except BlockingIOError:
                time.sleep(0.001)  # the receiver's queue is full: let it drain
        wait_for(lambda: server.received_total >= sent, 30, "the flood to be read")
        assert sent > 2_000
        assert table.bytes_used <= MIB
        assert len(table) <= MIB // (RANK_BYTES + MESSAGE_BYTES)  # each invented rank holds one message
        assert server.dropped_total.get("table_bytes", 0) > sent // 2
        # A job the agent launched still gets in: silent foreign ranks make room for it.
        table.register_job("mine", 2)
        sender.setblocking(True)
        sender.sendto(make_msg("mine", rank=1, step=1).encode(), path)
        wait_for(lambda: table.latest("mine", 1) is not None, 10, "the launched job's telemetry")
        assert table.bytes_used <= MIB and table.evicted_foreign_total >= 1


def test_silent_foreign_jobs_are_evicted_and_a_new_one_is_accepted(tmp_path: Path, sender: socket.socket) -> None:
    clock = Clock()
    table = RankTable(RankTableConfig(max_foreign_jobs=64, foreign_idle_s=300.0), clock=clock)
    path = str(tmp_path / "telemetry.sock")
    with TelemetryServer(path, table, clock=clock) as server:
        for i in range(64):
            sender.sendto(make_msg(f"stale-{i}", rank=0, step=1).encode(), path)
        wait_for(lambda: len(table.jobs()) == 64, 10, "64 foreign jobs")
        clock.t += 100.0  # still fresh: the 65th is refused
        sender.sendto(make_msg("newcomer", rank=0, step=1).encode(), path)
        wait_for(lambda: server.dropped_total.get("foreign_limit", 0) == 1, 10, "the refusal to be counted")
        assert "newcomer" not in table.jobs()
        clock.t += 201.0  # 301 s of silence
        sender.sendto(make_msg("newcomer", rank=0, step=2).encode(), path)
        wait_for(lambda: table.latest("newcomer", 0) is not None, 10, "the new job to be accepted")
        assert table.jobs() == ["newcomer"]
        assert table.evicted_foreign_total == 64


def test_a_rank_past_its_jobs_nproc_is_a_counted_drop(tmp_path: Path) -> None:
    """The job's own rank process (sender check passes) invents rank 7 of a 1-rank job."""
    cfg = in_process_agent_config(tmp_path / "agent")
    cfg.recovery.warm_launcher = False
    cfg.launcher.cgroups = "off"
    agent = Agent(cfg)
    agent.start()
    try:
        good, bad = (make_msg("nosy", rank=r, step=1).encode().hex() for r in (0, 7))
        script = ("import os, socket, sys\n"
                  "s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)\n"
                  "for h in sys.argv[1:]:\n"
                  "    s.sendto(bytes.fromhex(h), os.environ['TRAINGUARD_SOCKET'])\n")
        record = agent.supervisor.submit(JobSpec("nosy", 1, command=[sys.executable, "-c", script, good, bad],
                                                 max_restarts=0))
        wait_for(lambda: record.state.finished, 60, "the job to end")
        wait_for(lambda: agent.telemetry.dropped_total.get("rank_range", 0) == 1, 10, "the drop to be counted")
        assert agent.table.latest("nosy", 0) is not None
        assert agent.table.latest("nosy", 7) is None
        with socket.create_connection(("127.0.0.1", agent.metrics_port), timeout=10) as c:
            c.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
            text = b"".join(iter(lambda: c.recv(65536), b"")).decode()
        assert 'trainguard_telemetry_dropped_total{reason="rank_range"} 1.0' in text
    finally:
        agent.shutdown()
