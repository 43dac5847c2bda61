"""Trainer configuration, data sampler and schedule: pure functions, no process groups."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainguard.trainer.config import ConfigError, ParallelConfig, TrainConfig, config_from_cli
from trainguard.trainer.data import Sampler, split_counts, val_index
from trainguard.trainer.model import stage_layers


def test_round_trip_through_json() -> None:
    cfg = TrainConfig.from_dict({
        "model": {"layers": 4, "d_model": 64, "heads": 4, "context": 32},
        "parallel": {"pp": 2, "dp": 2, "tp": 2, "pp_schedule": "interleaved", "microbatches": 2},
        "optim": {"lr": 1e-3, "warmup": 3}, "steps": 7, "global_batch": 8, "precision": "bf16",
        "bf16_after_step": 2, "activation_checkpointing": "attention", "faults": ["nan:step=3"],
        "ckpt_dir": "/tmp/x", "ckpt_every": 5})
    again = TrainConfig.from_json(json.dumps(cfg.to_dict()))
    assert again == cfg
    assert again.parallel.world_size == 8 and again.parallel.num_stages == 4


@pytest.mark.parametrize("body, key", [
    ({"parallel": {"tp": 3}}, "parallel.tp: 3 does not divide model.heads=4"),
    ({"model": {"d_model": 30, "heads": 4}}, "model.heads"),
    ({"parallel": {"dp": 0}}, "parallel.dp"),
    ({"parallel": {"pp_schedule": "zb"}}, "parallel.pp_schedule"),
    ({"parallel": {"dp_mode": "zero3"}}, "parallel.dp_mode"),
    ({"optim": {"lr": -1}}, "optim.lr"),
    ({"optim": {"lr": "fast"}}, "optim.lr"),
    ({"precision": "fp8"}, "precision"),
    ({"activation_checkpointing": "some"}, "activation_checkpointing"),
    ({"steps": 1.5}, "steps"),
    ({"parallel": {"dp": 3}, "global_batch": 2}, "global_batch"),
    ({"parallel": {"pp": 2, "microbatches": 3}, "global_batch": 8}, "parallel.microbatches"),
    ({"parallel": {"pp": 2}, "grad_accum": 2}, "grad_accum"),
    ({"parallel": {"pp": 4}, "model": {"layers": 2}}, "model.layers"),
    ({"compression": "int8", "parallel": {"dp": 2}}, "compression"),
    ({"modle": {}}, "modle: unknown key"),
    ({"model": {"width": 3}}, "model.width: unknown key"),
    ({"faults": "kill"}, "faults"),
])
def test_errors_name_the_key(body: dict, key: str) -> None:
    with pytest.raises(ConfigError) as err:
        TrainConfig.from_dict(body)
    assert str(err.value).startswith(key.split(":")[0]), str(err.value)
    assert key in str(err.value)


def test_check_world_before_any_process_group() -> None:
    p = ParallelConfig(dp=2, tp=2, pp=2)
    p.check_world(8)
    with pytest.raises(ConfigError, match=r"parallel: pp\*dp\*tp = 2\*2\*2 = 8 != world size 4"):
        p.check_world(4)


def test_config_from_cli() -> None:
    spec = config_from_cli(nproc=4, tp=2, steps=9, faults=["kill:rank=1,step=4"],
                           overrides=["model.layers=2", "optim.lr=0.01", "precision=bf16", "data.cache_dir=/c"])
    cfg = TrainConfig.from_dict(spec)
    assert (cfg.parallel.dp, cfg.parallel.tp, cfg.steps, cfg.model.layers) == (2, 2, 9, 2)
    assert cfg.optim.lr == 0.01 and cfg.precision == "bf16" and cfg.data.cache_dir == "/c"
    assert cfg.faults == ["kill:rank=1,step=4"]
    with pytest.raises(ConfigError, match="parallel.dp"):
        config_from_cli(nproc=3, tp=2)
    with pytest.raises(ConfigError, match="parallel"):
        config_from_cli(nproc=4, dp=1)
    with pytest.raises(ConfigError, match="model.nope"):
        config_from_cli(nproc=1, overrides=["model.nope=1"])


def test_config_module_does_not_import_torch() -> None:
    code = "import sys, trainer.config; sys.exit(1 if 'torch' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


@settings(max_examples=60, deadline=None)
@given(n=st.integers(5, 60), splits=st.lists(st.lists(st.integers(0, 7), min_size=3, max_size=3), min_size=1,
                                             max_size=12))
def test_sampler_never_skips_or_repeats_when_the_split_changes(n: int, splits: list[list[int]]) -> None:
    """Whatever per-rank split each step uses, the concatenation is the epoch's permutation."""
    sampler = Sampler(n, seed=3)
    taken: list[int] = []
    for sizes in splits:
        parts = sampler.next_step(sizes)
        assert [len(p) for p in parts] == sizes
        taken.extend(int(i) for p in parts for i in p)
    reference = Sampler(n, seed=3)
    assert taken == [int(i) for i in reference.take(len(taken))]
    for epoch_start in range(0, len(taken) - n + 1, n):
        assert sorted(taken[epoch_start:epoch_start + n]) == list(range(n))  # each epoch: every sample once


def test_sampler_state_resumes_the_same_sequence() -> None:
    a = Sampler(50, seed=1)
    a.next_step([7, 9])
    state = a.state()
    rest = a.take(60)
    b = Sampler(50, seed=1)
    b.load_state(state)
    assert np.array_equal(b.take(60), rest)


def test_helpers() -> None:
    assert split_counts(10, 4) == [3, 3, 2, 2]
    assert [stage_layers(4, 4, s) for s in range(4)] == [[0], [1], [2], [3]]
    assert sum((stage_layers(7, 3, s) for s in range(3)), []) == list(range(7))
    v = val_index(100, 8)
    assert len(set(v.tolist())) == 8 and v.max() < 100


def test_lr_schedule() -> None:
    from trainguard.trainer.train import lr_at
    cfg = TrainConfig.from_dict({"steps": 100, "optim": {"lr": 1.0, "warmup": 10, "min_lr_ratio": 0.1}})
    assert lr_at(cfg, 0) == pytest.approx(0.1)
    assert lr_at(cfg, 9) == pytest.approx(1.0)
    assert lr_at(cfg, 10) == pytest.approx(1.0)
    assert lr_at(cfg, 55) == pytest.approx(0.55)
    assert lr_at(cfg, 100) == pytest.approx(0.1)
    flat = TrainConfig.from_dict({"optim": {"lr": 0.5, "warmup": 0, "cosine": False}})
    assert lr_at(flat, 50) == 0.5
