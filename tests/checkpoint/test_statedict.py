"""trainguard.checkpoint.statedict: the state DCP's get_state_dict gives, built from learned names, equal to
DCP's own at every call (keys in order, the same tensors, equal plain values), through optimizer
steps, LR changes, a new parameter group, and models whose names DCP rewrites (DDP's ``module.``)."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.conftest import join_ranks
from trainguard.checkpoint.statedict import VERIFY_EVERY, LearnedStateDict, LearnedStateDicts

OPTS = StateDictOptions(flatten_optimizer_state_dict=True)


def _equal(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert list(a) == list(b)
    for key, x in a.items():
        y = b[key]
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor) and x.data_ptr() == y.data_ptr() and torch.equal(x, y), key
        else:
            assert x == y, key


def _train(model: nn.Module, optim: torch.optim.Optimizer) -> None:
    optim.zero_grad()
    model(torch.randn(4, 8)).pow(2).mean().backward()
    optim.step()


def _check_calls(model: nn.Module, optim: torch.optim.Optimizer, calls: int = 2 * VERIFY_EVERY + 3) -> LearnedStateDict:
    getter = LearnedStateDict(model, optim, OPTS)
    for i in range(calls):
        _train(model, optim)
        for group in optim.param_groups:
            group["lr"] = 0.01 * (i + 1)
        built = getter()
        reference = get_state_dict(model, optim, options=OPTS)
        _equal(built[0], reference[0])
        _equal(built[1], reference[1])
    return getter


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 1))


def test_adamw_with_two_groups_is_built_without_dcp_and_equals_it() -> None:
    model = _model()
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    optim = torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}])
    getter = _check_calls(model, optim)
    assert getter.enabled and getter.built >= 2 * VERIFY_EVERY - 2  # all but the first and the checks


def test_sgd_without_state_and_a_group_added_later() -> None:
    model = _model()
    optim = torch.optim.SGD(list(model[0].parameters()), lr=0.1)
    getter = _check_calls(model, optim, 5)
    assert getter.built == 4
    optim.add_param_group({"params": list(model[1].parameters()) + list(model[2].parameters()), "lr": 0.2})
    for _ in range(3):
        _train(model, optim)
        _equal(getter()[1], get_state_dict(model, optim, options=OPTS)[1])
    assert getter.enabled and getter.built == 6  # the call after the change asked DCP and learned again


def test_tied_weights_give_dcp_own_names_or_dcp_itself() -> None:
    """Two names for one tensor: whichever name DCP gives the optimizer's entry, the result is its."""
    torch.manual_seed(0)
    emb = nn.Embedding(10, 8)
    head = nn.Linear(8, 10, bias=False)
    head.weight = emb.weight
    model = nn.ModuleDict({"emb": emb, "head": head})

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.parts = model

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.parts["head"](self.parts["emb"](x.long().abs() % 10).mean(1))

    tied = Tied()
    optim = torch.optim.Adam(tied.parameters())
    getter = LearnedStateDict(tied, optim, OPTS)
    for _ in range(5):
        optim.zero_grad()
        tied(torch.randint(0, 10, (4, 3))).pow(2).mean().backward()
        optim.step()
        built = getter()
        reference = get_state_dict(tied, optim, options=OPTS)
        _equal(built[0], reference[0])
        _equal(built[1], reference[1])


def test_a_full_state_dict_is_left_to_dcp() -> None:
    model = _model()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    getter = LearnedStateDict(model, optim, StateDictOptions(flatten_optimizer_state_dict=True, full_state_dict=True))
    getter()
    getter()
    assert not getter.enabled and getter.built == 0


def _ddp_rank(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=1)
    try:
        torch.manual_seed(0)
        model = DDP(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)))
        optim = torch.optim.AdamW(model.parameters())
        getter = _check_calls(model, optim)
        names = list(getter()[0])
        with open(out, "w") as fh:
            fh.write(f"{getter.built} {','.join(names)}")
    finally:
        dist.destroy_process_group()


def test_ddp_names_without_its_module_prefix(tmp_path: Any) -> None:
    """DDP's ``module.`` prefix is DCP's to drop: learned by position, not by a rule of ours."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "out"
    join_ranks(mp.start_processes(_ddp_rank, args=(port, str(out)), nprocs=1, start_method="fork", join=False), "ddp")
    built, names = out.read_text().split(" ")
    assert int(built) >= 2 * VERIFY_EVERY - 2
    assert names.split(",") == ["0.weight", "0.bias", "2.weight", "2.bias"]


@pytest.mark.parametrize("calls", [1, VERIFY_EVERY])
def test_the_checks_call_dcp(calls: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first call and every VERIFY_EVERY-th are DCP's own."""
    import trainguard.checkpoint.statedict as sd

    model = _model()
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _train(model, optim)
    asked = []
    real = sd.get_state_dict

    def counting(*args: Any, **kwargs: Any) -> Any:
        asked.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(sd, "get_state_dict", counting)
    getter = LearnedStateDict(model, optim, OPTS)
    for _ in range(calls):
        getter()
    assert len(asked) == (1 if calls == 1 else 2)


def test_the_pairs_are_kept_while_they_come_back_and_replaced_by_others() -> None:
    model, other = _model(), _model()
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _train(model, optim)
    learned = LearnedStateDicts(OPTS)
    for _ in range(3):
        [(msd, osd)] = learned([(model, optim)])
        _equal(msd, get_state_dict(model, optim, options=OPTS)[0])
    first = learned.kept[0]
    assert first.built == 2
    other_optim = torch.optim.SGD(other.parameters(), lr=0.1)
    learned([(other, other_optim)])
    assert [g.model for g in learned.kept] == [other]  # the old model is no longer held here
