"""What a detector found: the kind of failure, where, and the evidence that goes into its event."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Finding:
    kind: str  # "hang" | "loss_diverged"
    job: str
    message: str
    step: int
    evidence: dict[str, Any] = field(default_factory=dict)
