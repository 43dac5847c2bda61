"""DCP saves of a state whose layout has not changed since the last one, written without DCP's planner.

A rank that writes its memory-tier checkpoints alone (the background writer, ``trainguard.checkpoint.savewriter``)
saves the same layout save after save: the same keys, the same tensor shapes, the same kinds of
values; only the bytes change. ``dcp.save`` plans every item again each time and serialises each
one through ``torch.save`` (~40 us for a float, ~80 us for a tensor, a class built per item): ~10 ms
for a 40-item state, ~280 ms for a 2,400-item one (an AdamW state's hyperparameters are flattened
into one item per parameter each), all of it CPU taken from the ranks on a node whose cores they fill.

So the first save of a layout goes through ``dcp.save`` and its metadata is kept as the template.
A later save whose flattened state matches it item for item (the same keys; tensors of the same
dtype and shape, unsharded; plain values where the template has plain values) is written directly:
each item in torch's legacy serialisation, which DCP's loader reads with ``torch.load`` (a tensor's
header worked out once per dtype and shape, then its bytes; a plain value pickled between two
constant parts), back to back into the template's data file, and the template's metadata with the
new offsets and lengths. A reader (``dcp.load``, its planners, a reshard to another world size)
sees DCP's own metadata; only the storage table is new. Anything else is saved by ``dcp.save``,
which then becomes the template.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)

from trainguard.agent.checkpoint.memory import open_for_overwrite

_PLAIN = (int, float, bool, str, bytes, type(None))


def _legacy_parts() -> tuple[bytes, bytes] | None:
    """The constant head and tail of ``torch.save(value, _use_new_zipfile_serialization=False)``
    around ``pickle.dumps(value, protocol=2)`` for a value without tensors (None: torch writes
    it differently, and every value goes through ``torch.save``)."""
    raw = io.BytesIO()
    torch.save(None, raw, _use_new_zipfile_serialization=False)
    body, tail = pickle.dumps(None, protocol=2), pickle.dumps([], protocol=2)
    whole = raw.getvalue()
    if not whole.endswith(body + tail):
        return None
    head = whole[:len(whole) - len(body) - len(tail)]
    probe = io.BytesIO()
    torch.save((0.5, 3, "x"), probe, _use_new_zipfile_serialization=False)
    return (head, tail) if probe.getvalue() == head + pickle.dumps((0.5, 3, "x"), protocol=2) + tail else None


_LEGACY = _legacy_parts()


def _plain(value: Any) -> bool:
    if isinstance(value, (tuple, list)):
        return type(value) in (tuple, list) and all(_plain(v) for v in value)
    if isinstance(value, dict):
        return type(value) is dict and all(_plain(k) and _plain(v) for k, v in value.items())
    return type(value) in _PLAIN


def object_bytes(value: Any) -> bytes:
    """``value`` as ``torch.save`` writes it in its legacy format (which ``torch.load`` reads):
    ~0.4 us for a plain value instead of ~16 us."""
    if _LEGACY is not None and _plain(value):
        return _LEGACY[0] + pickle.dumps(value, protocol=2) + _LEGACY[1]
    raw = io.BytesIO()
    torch.save(value, raw, _use_new_zipfile_serialization=False)
    return raw.getvalue()


class _TensorHeads:
    """The legacy serialisation of a contiguous tensor is a header (the pickled rebuild call, the
    storage's key and element count) and then the storage's bytes: the header depends only on the
    dtype and shape, so it is worked out once for each."""

    def __init__(self) -> None:
        self._heads: dict[tuple[torch.dtype, tuple[int, ...]], bytes | None] = {}

    def head(self, dtype: torch.dtype, shape: tuple[int, ...]) -> bytes | None:
        key = (dtype, shape)
        if key not in self._heads:
            self._heads[key] = self._make(dtype, shape)
        return self._heads[key]

    @staticmethod
    def _make(dtype: torch.dtype, shape: tuple[int, ...]) -> bytes | None:
        try:
            probe = torch.arange(torch.Size(shape).numel(), dtype=torch.int64).to(dtype).reshape(shape)
            raw = io.BytesIO()
            torch.save(probe, raw, _use_new_zipfile_serialization=False)
            whole, data = raw.getvalue(), _data(probe).tobytes()
        except (RuntimeError, TypeError, ValueError):
            return None  # a dtype without a byte view (or a numpy one): dcp.save does it
        if not data or not whole.endswith(data):
            return None  # an empty tensor, or a layout this does not understand: dcp.save does it
        return whole[:len(whole) - len(data)]


def _data(tensor: torch.Tensor) -> Any:
    """The bytes of a contiguous CPU tensor, as a buffer (no copy)."""
    return tensor.reshape(-1).view(torch.uint8).numpy()


@dataclasses.dataclass
class _Template:
    metadata: Metadata
    metadata_name: str
    data_name: str
    index: dict[str, MetadataIndex]
    """Each item's key in the storage table, by its flattened name."""


class ReplaySaver:
    """Saves of one writer (see the module docstring). ``save(path, tree, full)`` writes ``tree``
    into the directory ``path``; ``full(path, tree)`` is the ``dcp.save`` to use when the layout
    is new. ``replayed`` and ``full_saves`` count what each save took."""

    def __init__(self) -> None:
        self._template: _Template | None = None
        self._heads = _TensorHeads()
        self.replayed = 0
        self.full_saves = 0

    def save(self, path: str, tree: Mapping[str, Any], full: Callable[[str, Mapping[str, Any]], None]) -> None:
        if self._template is not None and self._replay(path, tree, self._template):
            self.replayed += 1
            return
        self._template = None
        full(path, tree)
        self.full_saves += 1
        self._template = _read_template(path)

    def _replay(self, path: str, tree: Mapping[str, Any], template: _Template) -> bool:
        """Write ``tree`` by ``template``; False (nothing written) when it does not match it."""
        try:
            flat, _ = flatten_state_dict(dict(tree))
        except Exception:  # noqa: BLE001 - a tree DCP's flattening refuses: dcp.save says why
            return False
        described = template.metadata.state_dict_metadata
        if flat.keys() != described.keys():
            return False
        items: list[tuple[MetadataIndex, Any, Any]] = []  # (key, header or None, data or bytes)
        for fqn, value in flat.items():
            md = described[fqn]
            if isinstance(value, torch.Tensor):
                if (type(value) is not torch.Tensor or not isinstance(md, TensorStorageMetadata)
                        or len(md.chunks) != 1 or value.device.type != "cpu" or value.dtype != md.properties.dtype
                        or tuple(value.shape) != tuple(md.size)):
                    return False
                head = self._heads.head(value.dtype, tuple(value.shape))
                if head is None:
                    return False
                items.append((template.index[fqn], head, _data(value.detach().contiguous())))
            elif isinstance(md, BytesStorageMetadata):
                items.append((template.index[fqn], None, object_bytes(value)))
            else:
                return False
        table: dict[MetadataIndex, _StorageInfo] = {}
        offset = 0
        with open_for_overwrite(os.path.join(path, template.data_name)) as fh:
            for key, head, data in items:
                if head is not None:
                    fh.write(head)
                fh.write(data)
                length = len(head or b"") + memoryview(data).nbytes  # bytes, or a tensor's numpy view
                table[key] = _StorageInfo(template.data_name, offset, length)
                offset += length
        metadata = dataclasses.replace(template.metadata, storage_data=table,
                                       storage_meta=StorageMeta(checkpoint_id=path, save_id=str(uuid.uuid4())))
        tmp = os.path.join(path, template.metadata_name + ".tmp")
        with open_for_overwrite(tmp) as fh:
            pickle.dump(metadata, fh)
        os.replace(tmp, os.path.join(path, template.metadata_name))
        return True


def _read_template(path: str) -> _Template | None:
    """The template of the save just written into ``path`` (None: one this cannot replay)."""
    names = [n for n in os.listdir(path) if n.endswith(".metadata")]
    if len(names) != 1:
        return None
    try:
        with open(os.path.join(path, names[0]), "rb") as fh:
            metadata = pickle.load(fh)
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ImportError):
        return None
    if not isinstance(metadata, Metadata) or not metadata.storage_data:
        return None
    files = {info.relative_path for info in metadata.storage_data.values()}
    if len(files) != 1 or any(info.transform_descriptors for info in metadata.storage_data.values()):
        return None
    index: dict[str, MetadataIndex] = {}
    for key in metadata.storage_data:
        if key.fqn in index:
            return None  # a tensor in several chunks (sharded): not this writer's kind of save
        index[key.fqn] = key
    if index.keys() != metadata.state_dict_metadata.keys():
        return None
    return _Template(metadata, names[0], files.pop(), index)
