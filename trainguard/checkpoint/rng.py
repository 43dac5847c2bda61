"""A rank's RNG states, the one place that reads, encodes and restores them: as tensors (a
checkpoint's ``rng/rank<N>.pt``), as bytes (a snapshot's skeleton, the all-gather of a memory-tier
save) and packed into one length-prefixed blob (that all-gather's row)."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Mapping
from typing import Any

import torch

from trainguard.checkpoint.dcpreplay import object_bytes
from trainguard.checkpoint.snapshot.errors import SnapshotError

_CUDA_BUILT = torch.backends.cuda.is_built()


def rng_states() -> dict[str, Any]:
    """This process's RNG states, as snapshots and checkpoints keep them (copies: the generators go on)."""
    return {"torch": torch.default_generator.get_state(),
            "cuda": torch.cuda.get_rng_state() if _CUDA_BUILT and torch.cuda.is_initialized() else None}


def rng_bytes() -> dict[str, bytes | None]:
    """``rng_states`` as bytes, which a snapshot pickles into its skeleton: as a tensor of the slot
    it went through the copy of the state's tensors and its layout's signature (~20 us more). Read
    straight from the state tensor's memory (through numpy: ~3 us more between two steps)."""
    return {name: _tensor_bytes(t) if t is not None else None for name, t in rng_states().items()}


_STAND_INS: dict[int, bytes] = {}


def _stand_in(length: int) -> bytes:
    """Random bytes of ``length``, the same all along: what a pickle holds in place of an RNG
    state until ``fill_stand_ins`` finds and overwrites them."""
    found = _STAND_INS.get(length)
    if found is None:
        found = _STAND_INS[length] = os.urandom(length)
    return found


def stand_ins(states: Mapping[str, torch.Tensor | None]) -> dict[str, bytes | None]:
    return {name: _stand_in(t.numel()) if t is not None else None for name, t in states.items()}


def fill_stand_ins(raw: bytes, states: Mapping[str, torch.Tensor | None]) -> bytearray:
    """``raw`` (a pickle whose first values are ``stand_ins(states)``, in their order) with each
    stand-in overwritten by its state's bytes. Random bytes (5,056 for the CPU generator, 16 for
    CUDA's), a stand-in is not found before its own place, the first after the one before it."""
    out = bytearray(raw)
    at = 0
    for state in states.values():
        if state is None:
            continue
        n = state.numel()
        at = out.find(_stand_in(n), at)
        if at < 0:
            raise SnapshotError("an RNG state's place in the snapshot's skeleton was not found")
        out[at:at + n] = _tensor_bytes(state)
        at += n
    return out


def _tensor_bytes(tensor: torch.Tensor) -> bytes:
    """A contiguous CPU uint8 tensor's bytes (an RNG state)."""
    return ctypes.string_at(tensor.data_ptr(), tensor.numel())


def _rng_tensor(value: Any) -> Any:
    return torch.frombuffer(bytearray(value), dtype=torch.uint8) if isinstance(value, (bytes, bytearray)) else value


def set_rng_states(rng: Mapping[str, Any]) -> None:
    """Put back what ``rng_states`` (or a snapshot's ``rng_bytes``) gave (CUDA's only where CUDA
    is in use)."""
    torch.set_rng_state(_rng_tensor(rng["torch"]))
    if rng.get("cuda") is not None and torch.cuda.is_initialized():
        torch.cuda.set_rng_state(_rng_tensor(rng["cuda"]))


def pack(states: Mapping[str, bytes | None]) -> bytes:
    """``rng_bytes`` as one blob: the CPU generator's length (4 bytes) and bytes, then CUDA's
    (absent when unused)."""
    cpu = states["torch"] or b""
    return len(cpu).to_bytes(4, "little") + cpu + (states.get("cuda") or b"")


def unpack(blob: bytes) -> dict[str, bytes | None]:
    """``pack``'s states as bytes again."""
    n = int.from_bytes(blob[:4], "little")
    return {"torch": blob[4:4 + n], "cuda": blob[4 + n:] or None}


def write_rng_file(path: str, rng: Mapping[str, Any] | None = None) -> None:
    """RNG states (this rank's by default; tensors or bytes) as tensors in a checkpoint's
    ``rng/rank<N>.pt``, pickled in memory first: torch.save straight into a full filesystem fails
    with a zip writer's "unexpected pos" instead of the OSError that says why. In torch's legacy
    format (``torch.load`` reads it): ~40 us against ~300 us for the zip format."""
    states = rng if rng is not None else rng_states()
    raw = object_bytes({name: _rng_tensor(value) for name, value in states.items()})
    with open(path, "wb") as fh:
        fh.write(raw)


def load_rng_file(path: str) -> None:
    """Put back the RNG states of ``write_rng_file``'s file, where there is one."""
    if os.path.exists(path):
        set_rng_states(torch.load(path, weights_only=True))  # never unpickle arbitrary objects
