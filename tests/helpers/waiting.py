"""Polling until something holds: the one wait the tests share."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def wait_for(pred: Callable[[], Any], timeout: float = 30.0, what: str = "condition", *,
             interval: float = 0.05, diagnose: Callable[[], str] | None = None) -> Any:
    """Call ``pred`` every ``interval`` s until it returns something truthy, and return that.

    After ``timeout`` s (``pred`` is called once more at the deadline) raise AssertionError naming
    ``what``, followed by the text of ``diagnose()`` when given: what the test saw instead.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() >= deadline:
            break
        time.sleep(interval)
    detail = f"\n{diagnose()}" if diagnose is not None else ""
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}{detail}")
