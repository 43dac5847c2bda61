"""DCP metadata is read with an allow-listed unpickler (trainguard/checkpoint/dcpsafe.py): a ``.metadata``
pickle whose ``__reduce__`` runs a command is refused before anything in it runs, through the
loader ranks use (``trainguard.checkpoint.dcpstate.load``); real checkpoints still load."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from trainguard.checkpoint.dcpsafe import SafeFileSystemReader, UnsafeMetadataError, loads_metadata
from trainguard.checkpoint.dcpstate import META, load


class _Exploit:
    """What an attacker pickles: unpickling it calls ``os.system``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.system, (f"touch {self.marker}",)


def _saved(tmp_path: Path) -> tuple[Path, nn.Module]:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    path = tmp_path / "ckpt"
    dcp.save({"model": model.state_dict(), "step": 7}, checkpoint_id=str(path))
    (path / META).write_text(json.dumps({"step": 7}))
    return path, model


def test_real_metadata_loads(tmp_path: Path) -> None:
    path, model = _saved(tmp_path)
    fresh = nn.Linear(4, 3)
    meta = load(str(path), {"model": fresh}, rank=0)
    assert meta["step"] == 7 and torch.equal(fresh.weight, model.weight)


def test_malicious_reduce_in_metadata_is_refused_and_never_runs(tmp_path: Path) -> None:
    path, _ = _saved(tmp_path)
    marker = tmp_path / "pwned"
    (path / ".metadata").write_bytes(pickle.dumps(_Exploit(marker)))
    with pytest.raises(CheckpointException) as ei:  # DCP's own wrapper of a rank's failure
        load(str(path), {"model": nn.Linear(4, 3)}, rank=0)
    assert "posix.system, which DCP metadata never holds" in str(ei.value)
    with pytest.raises(UnsafeMetadataError, match="system"):
        SafeFileSystemReader(str(path)).read_metadata()
    assert not marker.exists()


def test_metadata_that_is_not_dcp_metadata_is_refused(tmp_path: Path) -> None:
    with pytest.raises(UnsafeMetadataError, match="not DCP Metadata"):
        loads_metadata(pickle.dumps({"a": 1}))
    with pytest.raises(UnsafeMetadataError):
        loads_metadata(pickle.dumps(Path("/etc/passwd").open))  # a bound method: builtins.getattr
