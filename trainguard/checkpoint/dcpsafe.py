"""Loading a DCP checkpoint without running code from it: its ``.metadata`` is read by an unpickler
that admits only the classes ``torch.distributed.checkpoint`` metadata is made of, and its
non-tensor values go through ``torch.load(weights_only=True)`` (DCP's own reader unpickles both
without limits). A checkpoint is written by the job's ranks; ranks may run as root, so a pickle
planted in one must never reach ``pickle.load``.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

_METADATA_CLASSES = frozenset({
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
})
_BUILTINS = frozenset({"dict", "list", "tuple", "set", "frozenset", "int", "float", "complex", "bool", "str",
                       "bytes", "bytearray", "slice", "range"})


class UnsafeMetadataError(pickle.UnpicklingError):
    """A checkpoint's metadata names something a DCP metadata pickle never holds."""


class MetadataUnpickler(pickle.Unpickler):
    """Admits DCP's metadata classes, torch dtypes/layouts/memory formats and plain builtins."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_CLASSES:
            return super().find_class(module, name)
        if module == "builtins" and name in _BUILTINS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype | torch.layout | torch.memory_format):
            return getattr(torch, name)
        raise UnsafeMetadataError(f"checkpoint metadata refers to {module}.{name}, which DCP metadata never holds")


def loads_metadata(raw: bytes) -> Metadata:
    """A ``.metadata`` pickle's contents; UnsafeMetadataError for anything but DCP metadata."""
    value = MetadataUnpickler(io.BytesIO(raw)).load()
    if not isinstance(value, Metadata):
        raise UnsafeMetadataError(f"checkpoint metadata is a {type(value).__name__}, not DCP Metadata")
    return value


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose metadata goes through ``MetadataUnpickler``."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as fh:
            metadata = loads_metadata(fh.read())
        storage = getattr(metadata, "storage_meta", None)
        if storage is None:
            storage = metadata.storage_meta = StorageMeta()
        storage.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` whose non-tensor values load with ``weights_only=True``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded
