"""A rank that cannot reach its peers at process-group set-up is named in an event, with the node
behind the address and the likely fix, read from the last lines of the rank's log (canned logs of
gloo, NCCL and the c10d store; a real rank that prints gloo's error and exits)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests.helpers.waiting import wait_for
from trainguard.agent.detect.peerdiag import TAIL_BYTES, diagnose, read_tail
from trainguard.agent.eventlog import EventLog
from trainguard.agent.lifecycle.jobs import JobSpec, JobState
from trainguard.agent.lifecycle.launcher import Launcher
from trainguard.agent.lifecycle.plans import PlanStore
from trainguard.agent.lifecycle.ranks import LaunchContext
from trainguard.agent.lifecycle.supervisor import Supervisor

NODES = {"10.0.0.11": "node-a", "10.0.0.12": "node-b", "node-c": "node-c"}

GLOO_LOOPBACK = """\
[rank1]: Traceback (most recent call last):
[rank1]:   File "train.py", line 12, in <module>
[rank1]:     dist.init_process_group("gloo")
[rank1]: RuntimeError: Gloo connectFullMesh failed with [../third_party/gloo/gloo/transport/tcp/pair.cc:144] \
no error, Connection refused, remote=[127.0.1.1]:40321
"""
GLOO_PAIR = """\
step 0 loss 5.1
terminate called after throwing an instance of 'gloo::IoException'
  what():  [../third_party/gloo/gloo/transport/tcp/pair.cc:397] connect [10.0.0.12]:45678: Connection refused
"""
NCCL = "node-a:123:456 [0] NCCL INFO Bootstrap\nnode-a:123:456 [0] misc/socket.cc:484 NCCL WARN " \
       "Net : Connect to 10.0.0.12<43211> failed : Connection timed out\n"
STORE = """\
torch.distributed.DistNetworkError: The client socket has timed out after 900000ms while trying to connect to \
(node-c, 29500).
"""
HEALTHY = "step 99 loss 1.2\nall good: connect to the dashboard at 10.0.0.12:3000\nbye\n"


def test_gloo_refused_on_loopback_says_the_host_name_resolves_to_loopback() -> None:
    found = diagnose(GLOO_LOOPBACK.splitlines(), NODES.get)
    assert found is not None and found.transport == "gloo" and found.reason == "refused"
    assert (found.address, found.port, found.node) == ("127.0.1.1", 40321, None)
    assert "/etc/hosts" in found.fix and "cluster.advertise" in found.fix and "GLOO_SOCKET_IFNAME" in found.fix
    assert "rank 1 could not reach 127.0.1.1:40321" in found.message("train", 1)


def test_each_transport_names_the_node_behind_the_address() -> None:
    pair = diagnose(GLOO_PAIR.splitlines(), NODES.get)
    assert pair is not None and (pair.node, pair.port, pair.reason) == ("node-b", 45678, "refused")
    assert "GLOO_SOCKET_IFNAME" in pair.fix and "node node-b" in pair.message("train", 3)
    nccl = diagnose(NCCL.splitlines(), NODES.get)
    assert nccl is not None and (nccl.transport, nccl.node, nccl.port, nccl.reason) == ("nccl", "node-b", 43211,
                                                                                       "timed out")
    assert "route and firewall" in nccl.fix
    store = diagnose(STORE.splitlines(), NODES.get)
    assert store is not None and (store.transport, store.node, store.port) == ("c10d store", "node-c", 29500)


def test_a_log_without_a_connection_failure_gives_no_diagnosis() -> None:
    assert diagnose(HEALTHY.splitlines(), NODES.get) is None
    assert diagnose(["Connection refused"], NODES.get) is None  # no address: nothing to name
    assert diagnose([], None) is None


def test_the_tail_reader_follows_no_link_and_reads_a_bounded_tail(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("root:x:0:0 Connection refused, remote=[10.0.0.12]:1\n")
    link = tmp_path / "rank0.log"
    link.symlink_to(secret)
    assert read_tail(str(link)) == []  # a rank that swapped its log for a link learns nothing
    os.mkfifo(tmp_path / "fifo.log")
    assert read_tail(str(tmp_path / "fifo.log")) == []
    big = tmp_path / "big.log"
    big.write_bytes(b"x" * (3 * TAIL_BYTES) + b"\n" + GLOO_PAIR.encode() + b"\xff\xfe\n")
    lines = read_tail(str(big))
    assert lines[-1].startswith("\ufffd") and sum(len(x) for x in lines) <= TAIL_BYTES
    assert diagnose(lines, NODES.get) is not None
    assert read_tail(str(tmp_path / "missing.log")) == []


@pytest.mark.parametrize("mode", ["cold"])
def test_a_rank_that_dies_of_an_unreachable_peer_is_named_in_an_event(tmp_path: Path, mode: str) -> None:
    events = EventLog(str(tmp_path / "events"), "n1", fsync=False)
    plans = PlanStore(str(tmp_path / "plans"))

    def ctx(spec: JobSpec) -> LaunchContext:
        return LaunchContext(telemetry_socket=str(tmp_path / "none.sock"), plan_path=plans.path(spec.job),
                             log_dir=str(tmp_path / "jobs" / spec.job))

    sup = Supervisor(events, plans, Launcher(mode=mode), ctx, stop_grace_s=3)  # type: ignore[arg-type]
    sup.peer_node_of = NODES.get
    script = f"import sys\nsys.stderr.write({GLOO_PAIR!r})\nsys.exit(1)\n"
    try:
        sup.submit(JobSpec("span", 1, command=[sys.executable, "-c", script], max_restarts=0))
        wait_for(lambda: sup.jobs["span"].state in (JobState.FAILED, JobState.SUCCEEDED), 60, "the job ends")
        found = [e for e in events.since(0) if e["kind"] == "rank_peer_unreachable"]
        assert len(found) == 1, [e["kind"] for e in events.since(0)]
        event = found[0]
        assert "could not reach node node-b (10.0.0.12:45678)" in event["message"]
        assert event["fields"]["peer_node"] == "node-b" and "GLOO_SOCKET_IFNAME" in event["fields"]["fix"]
        assert event["job"] == "span" and event["cause"] == "peer_unreachable"
    finally:
        sup.close()
