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
flat copies of the parameters (the last ones and the last update). Under DDP the gradients are the
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


def _terms(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """-g.u, g.g and u.u of two flat vectors, the sums the cosine is made of."""
    return torch.stack([-torch.dot(g, u), torch.dot(g, g), torch.dot(u, u)])


class UpdateAlignment:
    """Keeps the parameters and the last update as one flat vector each, so that a step costs a
    few whole-vector operations (two concatenations, three dot products, a subtraction) rather than
    a handful per parameter: per parameter it was ~150 small ops a step for the bench's GPT, a
    few percent of a CPU step."""

    def __init__(self, params: Iterable[torch.nn.Parameter]) -> None:
        self.params = [p for p in params if p.requires_grad]
        self._last: torch.Tensor | None = None
        self._update: torch.Tensor | None = None

    @staticmethod
    def _flat(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
        return torch.cat([_local(t.detach()).reshape(-1).float() for t in tensors])

    @torch.no_grad()
    def after_step(self) -> float | None:
        """This step's cos(g_t, -u_{t-1}); None for the first two steps or without gradients."""
        cos: float | None = None
        if self._update is not None:
            cos = self._cosine(self._update)
        current = self._flat(self.params) if self.params else None
        if current is not None and self._last is not None and current.shape == self._last.shape:
            self._update = current - self._last
        else:
            self._update = None
        self._last = current
        return cos

    def _cosine(self, update: torch.Tensor) -> float | None:
        grads = [p.grad for p in self.params]
        if all(g is not None for g in grads):
            g = self._flat(g for g in grads if g is not None)
            if g.shape != update.shape:
                return None
            dot, gg, uu = _terms(g, update).tolist()
        else:
            # Parameters without a gradient this step are left out of all three sums.
            sums: list[torch.Tensor] = []
            at = 0
            for p, grad in zip(self.params, grads, strict=True):
                n = _local(p.detach()).numel()
                if grad is not None:
                    sums.append(_terms(_local(grad.detach()).reshape(-1).float(), update[at:at + n]))
                at += n
            if not sums:
                return None
            dot, gg, uu = torch.stack(sums).sum(0).tolist()  # one device sync for the step
        denom = math.sqrt(gg * uu)
        return max(-1.0, min(1.0, dot / denom)) if denom > 0 else None
