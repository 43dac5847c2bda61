"""XID / ECC events through the NVML event set: delivered by the event thread, with no poll between."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from tests.helpers.fakenvml import FakeGpu, FakeNvml
from trainguard.agent.collectors.base import TrackedProcess
from trainguard.agent.collectors.gpu import GpuCollector, GpuCollectorConfig, Nvml, is_fatal_xid
from trainguard.agent.collectors.gpu.collector import RESERVED_EVENT_KEYS


class Events:
    def __init__(self) -> None:
        self.items: list[tuple[str, dict[str, Any]]] = []
        self.cond = threading.Condition()

    def __call__(self, kind: str, fields: dict[str, Any]) -> None:
        with self.cond:
            self.items.append((kind, fields))
            self.cond.notify_all()

    def wait_for(self, kind: str, n: int = 1, timeout: float = 10.0) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                got = [f for k, f in self.items if k == kind]
                left = deadline - time.monotonic()
                if len(got) >= n or left <= 0:
                    return got
                self.cond.wait(left)


def _start(gpus: list[FakeGpu]) -> tuple[GpuCollector, FakeNvml, Events]:
    fake = FakeNvml(gpus)
    events = Events()
    col = GpuCollector(events, Nvml(module=fake), GpuCollectorConfig(event_wait_ms=50))
    col.start()
    return col, fake, events


@pytest.mark.parametrize(
    ("xid", "fatal"), [(79, True), (48, True), (94, True), (119, True), (13, False), (31, False), (43, False)]
)
def test_fatal_classification(xid: int, fatal: bool) -> None:
    assert is_fatal_xid(xid) is fatal


def test_xid_event_is_emitted_quickly_with_rank_and_counted() -> None:
    g0, g1 = FakeGpu(index=0), FakeGpu(index=1, processes={321: 1024**3})
    col, fake, events = _start([g0, g1])
    try:
        col.track({321: TrackedProcess(321, "jobX", 5, 1)})
        col.poll(1.0)
        assert fake.push_xid(1, 79)
        got = events.wait_for("gpu_xid")  # nothing polls from here on: only the event thread tells it
        assert len(got) == 1, events.items
        ev = got[0]
        assert ev["gpu"] == 1 and ev["uuid"] == g1.uuid and ev["xid"] == 79 and ev["fatal"] is True
        assert ev["pid"] == 321 and ev["pids"] == [321] and ev["ranks"] == [5]
        assert not RESERVED_EVENT_KEYS & set(ev)  # the agent adds job/rank from the pid itself
        assert "fallen off the bus" in ev["description"]

        fake.push_xid(0, 13)  # application error: reported, not fatal; no process known on GPU 0
        fake.push_xid(1, 79)
        got = events.wait_for("gpu_xid", 3)
        assert [(e["gpu"], e["xid"], e["fatal"]) for e in got] == [
            (1, 79, True),
            (0, 13, False),
            (1, 79, True),
        ]
        assert "pid" not in got[1]
        reg = CollectorRegistry()
        reg.register(type("A", (), {"collect": lambda self: col.metrics()})())
        assert (
            reg.get_sample_value(
                "trainguard_gpu_xid_errors_total", {"gpu": "1", "uuid": g1.uuid, "xid": "79"}
            )
            == 2
        )
        assert (
            reg.get_sample_value(
                "trainguard_gpu_xid_errors_total", {"gpu": "0", "uuid": g0.uuid, "xid": "13"}
            )
            == 1
        )
    finally:
        col.stop()


def test_ecc_events_and_partial_event_support() -> None:
    g0 = FakeGpu(index=0)
    g1 = FakeGpu(index=1, supported_events=0x8)  # XIDs only: no ECC events on this board
    g2 = FakeGpu(index=2, supported_events=0)  # no events at all (e.g. some virtual GPUs)
    col, fake, events = _start([g0, g1, g2])
    try:
        assert fake.push_ecc(0, double_bit=True)
        assert not fake.push_ecc(1, double_bit=True)  # not registered: nothing delivered
        assert fake.push_xid(1, 48)
        assert not fake.push_xid(2, 48)
        ecc = events.wait_for("gpu_ecc")
        xid = events.wait_for("gpu_xid")
        assert [(e["gpu"], e["type"], e["fatal"]) for e in ecc] == [(0, "double_bit", True)]
        assert [(e["gpu"], e["xid"], e["fatal"]) for e in xid] == [(1, 48, True)]
    finally:
        col.stop()


def test_stop_is_prompt_and_frees_the_event_set() -> None:
    col, fake, _ = _start([FakeGpu()])
    col.stop()  # its thread has ended when stop returns (checked below), not at some later poll
    assert fake.event_sets and all(es.freed for es in fake.event_sets)
    assert not [t for t in threading.enumerate() if t.name == "trainguard-gpu-xid"]


def test_xid_thread_survives_a_lost_gpu() -> None:
    g0, g1 = FakeGpu(index=0), FakeGpu(index=1)
    col, fake, events = _start([g0, g1])
    try:
        col.poll(1.0)
        fake.push_xid(0, 79)
        g0.lose()
        col.poll(2.0)
        assert events.wait_for("gpu_lost")[0]["gpu"] == 0
        assert events.wait_for("gpu_xid")[0]["xid"] == 79
        fake.push_xid(1, 94)  # the other GPU's events still arrive
        got = events.wait_for("gpu_xid", 2)
        assert [(e["gpu"], e["xid"]) for e in got] == [(0, 79), (1, 94)]
    finally:
        col.stop()
