"""How the LR follows a change of the global batch that healing made (a rank excluded, a node lost
or back): one rule for the controller and for the cluster's plan carry-over, whatever strategy runs.

* ``sqrt`` (default): LR x sqrt(new / old), the rule for Adam-type optimizers (Malladi et al.,
  "On the SDEs and scaling rules for adaptive gradient algorithms"; Granziol et al.);
* ``linear``: LR x new / old (Goyal et al., SGD with momentum);
* ``adascale``: the AdaScale gain ratio (1 + B_noise / old) / (1 + B_noise / new) from the measured
  gradient noise scale: linear while the batch is far below the noise scale, flat far above it.
  Without an estimate (it needs dp >= 2 and some steps) it falls back to ``sqrt`` and says so;
* ``none``: the LR stays.

>>> follow_batch("sqrt", 16, 8, None)[0] == 0.5 ** 0.5
True
>>> follow_batch("linear", 8, 16, None)
(2.0, 'linear: LR x 16/8 = x2')
>>> follow_batch("adascale", 16, 8, None)[1]
'adascale without a noise-scale estimate yet, sqrt instead: LR x sqrt(8/16) = x0.707'
>>> follow_batch("none", 16, 8, None)
(1.0, 'rule none: LR unchanged')
"""

from __future__ import annotations

import math
from typing import Literal

Rule = Literal["sqrt", "linear", "adascale", "none"]
RULES: tuple[str, ...] = ("sqrt", "linear", "adascale", "none")


def gain_ratio(batch: float, base: float, noise: float) -> float:
    """AdaScale gain of ``batch`` over ``base``: (1 + B_noise / base) / (1 + B_noise / batch)."""
    return (1.0 + noise / base) / (1.0 + noise / batch)


def follow_batch(rule: str, old_batch: int, new_batch: int, noise_scale: float | None) -> tuple[float, str]:
    """The LR multiplier for a global batch going from ``old_batch`` to ``new_batch`` samples, and
    how it was worked out (for the event's reason)."""
    if old_batch <= 0 or new_batch <= 0 or new_batch == old_batch:
        return 1.0, f"global batch unchanged ({new_batch}): LR unchanged"
    if rule == "none":
        return 1.0, "rule none: LR unchanged"
    if rule == "linear":
        factor = new_batch / old_batch
        return factor, f"linear: LR x {new_batch}/{old_batch} = x{factor:.3g}"
    if rule == "adascale" and noise_scale is not None and math.isfinite(noise_scale) and noise_scale > 0:
        factor = gain_ratio(new_batch, old_batch, noise_scale)
        return factor, (f"adascale: LR x (1 + {noise_scale:.3g}/{old_batch}) / (1 + {noise_scale:.3g}/{new_batch}) "
                        f"= x{factor:.3g} (gradient noise scale {noise_scale:.3g} samples)")
    factor = math.sqrt(new_batch / old_batch)
    prefix = "adascale without a noise-scale estimate yet, sqrt instead" if rule == "adascale" else "sqrt"
    return factor, f"{prefix}: LR x sqrt({new_batch}/{old_batch}) = x{factor:.3g}"
