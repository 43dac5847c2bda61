"""Saves replayed from a DCP template (trainguard.checkpoint.dcpreplay) read back exactly as dcp.save's own; the
state a save resolves is what DCP's own getters give."""

from __future__ import annotations

import io
import os
import pickle
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from trainguard.checkpoint.dcpreplay import ReplaySaver, object_bytes
from trainguard.checkpoint.dcpstate import _OPTIM_OPTS, _dcp_state, _resolved, _save_alone_dcp, load
from trainguard.checkpoint.tier import TierWriter
from trainguard.run.environment import RunEnvironment


@pytest.mark.parametrize("value", [0.05, 1e-300, 0, -3, 2**70, True, None, "adam", b"\x00\xff", (0.9, 0.999),
                                   [1, 2.5], {"a": 1, "b": [None]}, {1: "int key"}])
def test_object_bytes_are_torch_saves_legacy_bytes(value: Any) -> None:
    raw = io.BytesIO()
    torch.save(value, raw, _use_new_zipfile_serialization=False)
    assert object_bytes(value) == raw.getvalue()
    assert torch.load(io.BytesIO(object_bytes(value)), weights_only=False) == value


def test_object_bytes_of_a_value_holding_a_tensor_load_back() -> None:
    value = {"t": torch.arange(4.0), "n": 2}
    back = torch.load(io.BytesIO(object_bytes(value)), weights_only=False)
    assert torch.equal(back["t"], value["t"]) and back["n"] == 2


def _state(width: int = 6) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, width), nn.BatchNorm1d(width), nn.Linear(width, 2))
    model[2].to(torch.bfloat16)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _train(model, optim)
    return {"model": model, "optim": optim, "step": 3, "name": "run-a", "mask": torch.tensor([True, False, True]),
            "pair": (torch.ones(2, dtype=torch.float64), 7)}


def _train(model: nn.Module, optim: torch.optim.Optimizer) -> None:
    x = torch.randn(8, 4)
    h = model[1](model[0](x))
    loss = model[2](h.to(torch.bfloat16)).float().pow(2).mean()
    optim.zero_grad()
    loss.backward()
    optim.step()


def _tree(state: dict[str, Any]) -> dict[str, Any]:
    return _resolved(_dcp_state(state))


def _flat_equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_flat_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_flat_equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _read(path: str, like: dict[str, Any]) -> dict[str, Any]:
    """What dcp.load fills into a state shaped like ``like`` (tensors zeroed first)."""
    target = {k: (v.clone().zero_() if isinstance(v, torch.Tensor) else v) for k, v in _tree(like).items()}

    def zeroed(node: Any) -> Any:
        if isinstance(node, torch.Tensor):
            return torch.zeros_like(node)
        if isinstance(node, dict):
            return {k: zeroed(v) for k, v in node.items()}
        if isinstance(node, (list, tuple)):
            return type(node)(zeroed(v) for v in node)
        return node

    target = zeroed(target)
    dcp.load(target, checkpoint_id=path, no_dist=True)
    return target


def test_a_replayed_save_reads_back_as_dcp_saves_own(tmp_path: Any) -> None:
    state = _state()
    saver = ReplaySaver()
    first = str(tmp_path / "first")
    os.makedirs(first)
    saver.save(first, _tree(state), _save_alone_dcp)
    assert (saver.full_saves, saver.replayed) == (1, 0)

    _train(state["model"], state["optim"])  # new bytes, the same layout
    state["optim"].param_groups[0]["lr"] = 5e-4
    state["step"], state["name"] = 4, "run-b"  # plain values may change, kind and all
    replayed, reference = str(tmp_path / "replayed"), str(tmp_path / "reference")
    os.makedirs(replayed)
    saver.save(replayed, _tree(state), _save_alone_dcp)
    assert (saver.full_saves, saver.replayed) == (1, 1)
    _save_alone_dcp(reference, _tree(state))

    got, want = _read(replayed, state), _read(reference, state)
    assert _flat_equal(got, want)
    assert _flat_equal(got, _tree(state))
    assert got["step"] == 4 and got["name"] == "run-b"
    # The metadata is DCP's own: only the storage table and the save's identity are new.
    with open(os.path.join(replayed, ".metadata"), "rb") as fh:
        meta = pickle.load(fh)
    with open(os.path.join(first, ".metadata"), "rb") as fh:
        template = pickle.load(fh)
    assert meta.state_dict_metadata == template.state_dict_metadata
    assert meta.planner_data == template.planner_data
    assert meta.storage_data.keys() == template.storage_data.keys()
    data = os.path.getsize(os.path.join(replayed, "__0_0.distcp"))
    assert sum(info.length for info in meta.storage_data.values()) == data


def test_a_changed_layout_is_saved_by_dcp_and_becomes_the_template(tmp_path: Any) -> None:
    saver = ReplaySaver()
    for i, state in enumerate([_state(6), _state(6), _state(9), _state(9)]):
        path = str(tmp_path / f"s{i}")
        os.makedirs(path)
        if i == 3:
            state["step"] = torch.tensor(5)  # a plain value turned tensor: not the template's kind
        saver.save(path, _tree(state), _save_alone_dcp)
        assert _flat_equal(_read(path, state), _tree(state))
    assert (saver.full_saves, saver.replayed) == (3, 1)


def test_tier_writer_saves_replay_and_load_restores_the_state(tmp_path: Any) -> None:
    """Through the memory tier's own writer (in the training process) and ``load``."""
    env = RunEnvironment.from_environ({"TRAINGUARD_JOB": "j", "TRAINGUARD_SOCKET": str(tmp_path / "none.sock"),
                                       "TRAINGUARD_CKPT_MEMORY_ROOT": str(tmp_path / "mem")})
    writer = TierWriter(env, background=False)
    state = _state()
    paths = []
    for label in (1, 2, 3):
        _train(state["model"], state["optim"])
        state["step"] = label
        paths.append(writer.save(label, state, {"plan": {}}))
    assert all(p is not None for p in paths)
    assert writer._replay.replayed == 2
    fresh = _state()
    fresh["step"] = 0
    meta = load(str(paths[-1]), fresh, rank=0)
    assert meta["step"] == 3 and fresh["step"] == 3
    assert _flat_equal(_tree(fresh), _tree(state))


def test_one_model_and_its_optimizer_resolve_as_dcps_two_getters_give_them() -> None:
    state = _state()
    tree = _tree(state)
    model_sd = get_model_state_dict(state["model"])
    optim_sd = get_optimizer_state_dict(state["model"], state["optim"], options=_OPTIM_OPTS)
    assert _flat_equal(tree["model"], model_sd) and list(tree["model"]) == list(model_sd)
    assert _flat_equal(tree["optim"], optim_sd) and list(tree["optim"]) == list(optim_sd)
    assert tree["step"] == 3 and tree["name"] == "run-a"
    # Two models: each goes through its own getter.
    two = {"a": nn.Linear(2, 2), "b": nn.Linear(2, 3)}
    resolved = _tree(two)
    assert _flat_equal(resolved["b"], get_model_state_dict(two["b"]))
