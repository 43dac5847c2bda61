"""How well a step's gradient agrees with the step before it: the controller's LR-too-low signal.

``cos(g_t, -u_{t-1})``, the cosine between this step's gradient and the previous parameter update
reversed, is the sign of the hypergradient of the loss with respect to the LR (Baydin et al.,
"Online learning rate adaptation with hypergradient descent", ICLR 2018): positive when the last
step went downhill and more of the same would still go downhill (the step was too short), negative
when it overshot. Averaged over a control window it is a noise-robust progress signal that needs no
second run: the agent's controller raises the LR of a window whose mean is clearly positive.

Measured on the bench's GPT with AdamW (bench/controller.py's model, windows of 50 steps after the
first 100): about +0.1 to +0.25 at 10x below the default LR, within +-0.03 at the default and at
3x and 10x above it. So it finds an LR that is too low, not one that is too high (those show in
the loss, where the strategies look).

Call ``after_step()`` after ``optimizer.step()`` and before the gradients are cleared; it keeps two
copies of the parameters (the last ones and the last update). Under DDP the gradients are the
reduced ones, so every rank reports the same value; with sharded parameters (FSDP, TP) it is this
rank's shard's cosine, an estimate of the whole.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (no collective inside a step), a plain tensor as it is."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


class UpdateAlignment:
    def __init__(self, params: Iterable[torch.nn.Parameter]) -> None:
        self.params = [p for p in params if p.requires_grad]
        self._last: list[torch.Tensor] | None = None
        self._update: list[torch.Tensor] | None = None

    @torch.no_grad()
    def after_step(self) -> float | None:
        """This step's cos(g_t, -u_{t-1}); None for the first two steps or without gradients."""
        cos: float | None = None
        if self._update is not None:
            sums: list[torch.Tensor] = []
            for p, u in zip(self.params, self._update, strict=True):
                if p.grad is not None:
                    g = _local(p.grad.detach()).float()
                    sums.append(torch.stack([-(g * u).sum(), g.pow(2).sum(), u.pow(2).sum()]))
            if sums:
                dot, gg, uu = torch.stack(sums).sum(0).tolist()  # one device sync for the step
                denom = math.sqrt(gg * uu)
                cos = max(-1.0, min(1.0, dot / denom)) if denom > 0 else None
        if self._last is None:
            self._last = [_local(p.detach()).float().clone() for p in self.params]
            return cos
        if self._update is None:
            self._update = [torch.empty_like(t) for t in self._last]
        for p, last, u in zip(self.params, self._last, self._update, strict=True):
            u.copy_(_local(p.detach())).sub_(last)
            last.copy_(_local(p.detach()))
        return cos
