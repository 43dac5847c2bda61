"""trainguard.run.alignment on problems whose answer is known: a quadratic bowl under plain SGD. Too
small a step keeps going the same way (cosine +1), an overshooting one flips sign (cosine -1)."""

from __future__ import annotations

import math

import torch

from trainguard.run.alignment import UpdateAlignment


def cosines(lr: float, steps: int = 6) -> list[float | None]:
    x = torch.nn.Parameter(torch.tensor([3.0, -1.0, 2.0]))
    opt = torch.optim.SGD([x], lr=lr)
    align = UpdateAlignment([x])
    out = []
    for _ in range(steps):
        opt.zero_grad()
        (0.5 * (x * x).sum()).backward()
        opt.step()
        out.append(align.after_step())
    return out


def test_a_short_step_keeps_agreeing_with_the_last_update() -> None:
    got = cosines(0.05)
    assert got[:2] == [None, None]  # needs one update before the gradient it is compared with
    assert all(c is not None and math.isclose(c, 1.0, abs_tol=1e-5) for c in got[2:]), got


def test_an_overshooting_step_disagrees() -> None:
    got = cosines(1.9)  # x -> -0.9 x: every step jumps across the minimum
    assert all(c is not None and math.isclose(c, -1.0, abs_tol=1e-5) for c in got[2:]), got


def test_parameters_without_gradients_are_left_out() -> None:
    used = torch.nn.Parameter(torch.ones(2))
    unused = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([used, unused], lr=0.1)
    align = UpdateAlignment([used, unused])
    values = []
    for _ in range(4):
        opt.zero_grad()
        (used * used).sum().backward()
        opt.step()
        values.append(align.after_step())
    assert values[2] is not None and math.isclose(values[2], 1.0, abs_tol=1e-5)
    frozen = torch.nn.Parameter(torch.ones(2), requires_grad=False)
    assert UpdateAlignment([frozen]).params == []
