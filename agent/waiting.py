"""Polling until something holds: how the cluster demo waits for its agents and its job."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def wait_for(pred: Callable[[], Any], timeout: float, what: str = "condition", interval: float = 0.1) -> Any:
    """Call ``pred`` every ``interval`` s until it returns something truthy (returned), or raise
    TimeoutError naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
