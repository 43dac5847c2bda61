"""The rank's rendezvous, timed: when ``torch.distributed.init_process_group`` was entered and when
it returned, for a recovery's timeline (the script's own start-up ends where its rendezvous begins).

``watch()`` wraps ``torch.distributed.init_process_group`` once, where torch.distributed is already
imported and its group is not up yet; it never imports torch itself (the node agent imports this
package). ``trainguard`` calls it when ``trainguard.run.run`` is imported and in ``trainguard.init``;
a script that calls ``init_process_group`` through a name it bound before either is not timed, and
its timeline then counts the rendezvous in the script's start-up, never the other way round.
"""

from __future__ import annotations

import functools
import sys
import time
from collections.abc import Callable
from typing import Any

_span: tuple[float, float] | None = None
_TIMED = "__trainguard_timed__"


def span() -> tuple[float, float] | None:
    """(entered, returned) of this process's ``init_process_group`` call, when it was timed."""
    return _span


def _timed(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        global _span
        begin = time.time()
        result = original(*args, **kwargs)
        _span = (begin, time.time())
        return result

    setattr(init_process_group, _TIMED, True)
    return init_process_group


def watch() -> bool:
    """Time the next ``init_process_group`` of this process; False where it cannot be (torch.distributed
    not imported or not available, its group already up)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or dist.is_initialized():
        return False
    current = getattr(dist, "init_process_group", None)
    if current is None:
        return False
    if not getattr(current, _TIMED, False):
        setattr(dist, "init_process_group", _timed(current))  # noqa: B010 - a module found at run time
    return True
