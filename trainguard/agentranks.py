"""This node's ranks of a multi-node ``trainguard run`` under the local agent."""

from __future__ import annotations

import sys
from typing import Any, TextIO


class AgentRanks:
    def __init__(self, client: Any, command: list[str], job: str, nproc: int, max_restarts: int,
                 environ: dict[str, str], *, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> None:
        raise NotImplementedError

    def start(self, rnd: Any, block: Any) -> None:
        raise NotImplementedError

    def poll(self) -> Any:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError
