"""A second identity for the attack tests: a forked child that drops to an unused uid before it
acts, the way a local user or a job's rank would, so the agent's defences are tried from outside."""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable
from typing import Any

ATTACKER_UID = 54_321
"""A uid no account on this machine has (the tests run as root and give it nothing else)."""


def as_attacker(action: Callable[..., Any], *args: Any, uid: int = ATTACKER_UID) -> None:
    """Run ``action(*args)`` in a child that is ``uid`` (no root left in it); raises on a failure."""
    if os.geteuid() != 0:
        raise RuntimeError("the attack tests need root to act as a second uid")
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            os.close(read)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            action(*args)
            code = 0
        except BaseException:  # noqa: BLE001 - told to the parent through the pipe
            os.write(write, traceback.format_exc().encode()[-4000:])
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read, "rb") as fh:
        err = fh.read()
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"attacker action failed: {err.decode(errors='replace')}")
