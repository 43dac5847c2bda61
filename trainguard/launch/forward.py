"""Signals a batch system sends ``trainguard run`` ahead of a step's end (Slurm's ``--signal``,
SIGUSR1 or SIGUSR2 by convention), passed on to the ranks: a script that saves and requeues on
SIGUSR1 (Lightning's SLURM plugin does) gets it as under ``srun python train.py``.

A handler only queues what came (``SignalQueue``); the loop that runs the ranks forwards it, to
its child processes or through the agent, outside the handler.
"""

from __future__ import annotations

import signal
import threading
from collections import deque
from collections.abc import Callable

FORWARDABLE = ("SIGUSR1", "SIGUSR2")


class SignalQueue:
    """SIGUSR1 and SIGUSR2 caught for the ranks, until ``take``; ``wake`` is called on each."""

    def __init__(self, wake: Callable[[], None] | None = None) -> None:
        self.pending: deque[int] = deque()
        self.wake = wake
        self._previous: dict[int, object] = {}

    def install(self) -> SignalQueue:
        """Catch the signals (main thread only; elsewhere nothing is caught)."""
        if threading.current_thread() is threading.main_thread():
            for name in FORWARDABLE:
                signum = signal.Signals[name]
                self._previous[signum] = signal.signal(signum, self._caught)
        return self

    def restore(self) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)  # type: ignore[arg-type]  # what signal.signal returned
        self._previous.clear()

    def _caught(self, signum: int, _frame: object) -> None:
        self.pending.append(signum)
        if self.wake is not None:
            self.wake()

    def take(self) -> list[int]:
        got = []
        while self.pending:
            got.append(self.pending.popleft())
        return got


def name(signum: int) -> str:
    return signal.Signals(signum).name
