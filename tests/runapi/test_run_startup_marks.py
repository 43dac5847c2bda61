"""What a rank tells the agent about itself, from real gloo ranks over a real socket: its attempt,
what of the plan it applies, and the marks that split a recovery's start-up into the script's own
start-up and its rendezvous (``trainguard.init`` entered; ``init_process_group`` entered and
returned, where the rank timed it)."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import trainguard
from bench.trainjobs import TelemetryCapture
from tests.conftest import join_ranks
from trainguard.agent.lifecycle.launcher import free_port
from trainguard.agent.wire import (
    APPLIES_ALL,
    APPLIES_LR,
    APPLIES_STOP,
    Telemetry,
    applies_mask,
    applies_names,
)
from trainguard.run import rendezvous_clock

REPO = Path(__file__).resolve().parents[2]
UNTIMED_INIT = dist.distributed_c10d.init_process_group
"""torch's own function, bound before anything wraps it: a script calling it is not timed."""


def _ranks(rank: int, nproc: int, port: int, sock: str, order: str) -> None:
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TRAINGUARD_SOCKET": sock,
                       "TRAINGUARD_JOB": "marks", "TORCHELASTIC_RESTART_COUNT": "2"})
    torch.set_num_threads(1)
    if order == "init_first":
        run = trainguard.init(batch_size=4)  # a script that reads run.plan.batch_size
        dist.init_process_group("gloo", rank=rank, world_size=nproc)
    elif order == "group_first":
        rendezvous_clock.watch()  # what importing a framework's callback does
        dist.init_process_group("gloo", rank=rank, world_size=nproc)
        run = trainguard.init()
    else:
        UNTIMED_INIT("gloo", rank=rank, world_size=nproc)
        run = trainguard.init(applies=("lr", "stop"))
    t = torch.zeros(1)
    for step in range(3):
        with run.step(step, samples=4):
            dist.all_reduce(t)
    run.close()
    dist.destroy_process_group()


def _messages(tmp_path: Path, order: str) -> dict[int, Telemetry]:
    sock = str(tmp_path / "t.sock")
    cap = TelemetryCapture(sock)
    try:
        port = free_port()
        # spawned, not forked: a fork inherits the torch and thread state the worker's earlier tests left
        join_ranks(mp.start_processes(_ranks, args=(2, port, sock, order), nprocs=2, start_method="spawn",
                                      join=False), "_ranks")
        deadline = time.monotonic() + 10
        while {m.rank for m in cap.messages} != {0, 1} and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        cap.close()
    assert not cap.errors, cap.errors
    first: dict[int, Telemetry] = {}
    for msg in cap.messages:
        first.setdefault(msg.rank, msg)
    assert sorted(first) == [0, 1], cap.messages
    return first


def test_a_rank_that_inits_before_its_group_tells_both_and_what_it_applies(tmp_path: Path) -> None:
    for msg in _messages(tmp_path, "init_first").values():
        assert msg.attempt == 2
        assert msg.applies == APPLIES_ALL  # it gave init its batch size: it takes the plan's
        assert msg.init_at is not None and msg.rdzv_begin is not None and msg.group_ready is not None
        assert msg.init_at <= msg.rdzv_begin <= msg.group_ready, msg


def test_a_group_brought_up_before_init_is_still_timed_and_not_counted_as_start_up(tmp_path: Path) -> None:
    # As a Hugging Face Trainer does while it is built: importing trainguard first is enough.
    for msg in _messages(tmp_path, "group_first").values():
        assert msg.applies == APPLIES_LR | APPLIES_STOP  # no batch size of its own: not the plan's either
        assert msg.rdzv_begin is not None and msg.group_ready is not None and msg.init_at is not None
        assert msg.rdzv_begin <= msg.group_ready <= msg.init_at, msg


def test_an_untimed_rendezvous_is_left_out_rather_than_guessed(tmp_path: Path) -> None:
    for msg in _messages(tmp_path, "untimed").values():
        assert msg.init_at is not None and msg.rdzv_begin is None and msg.group_ready is None, msg
        assert applies_names(msg.applies) == ["lr", "stop"]


def test_unknown_plan_parts_are_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown plan part 'batch'"):
        trainguard.init(applies=("batch",), environ={})
    assert applies_mask(()) == 0 and applies_names(None) == []


@pytest.mark.parametrize("name", ["hf", "lightning"])
def test_the_callbacks_declare_no_batch_sizes_and_time_the_rendezvous(name: str) -> None:
    pytest.importorskip({"hf": "transformers", "lightning": "lightning"}[name])
    module = importlib.import_module(f"trainguard.integrations.{name}")
    assert "batch_sizes" not in module.APPLIES and applies_mask(module.APPLIES) == APPLIES_LR | APPLIES_STOP
    # In a fresh process that imported trainguard before torch: importing the callback is what wraps
    # init_process_group (the framework calls it before the callback's init).
    code = (f"import trainguard, torch.distributed as d; import trainguard.integrations.{name}; "
            "print(getattr(d.init_process_group, '__trainguard_timed__', False))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.stdout.strip() == "True", out.stderr[-2000:]
