"""The memory tier with a real torch.distributed.checkpoint save/load (single process, no process
group): a DCP writer whose file opener is ``open_for_overwrite`` reuses the pruned checkpoint's
files, the result verifies and loads back bit-exact. This is the recipe the trainer follows."""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")

from trainguard.agent.checkpoint.memory import MemoryTier  # noqa: E402
from trainguard.checkpoint.dcpstate import ReuseFileSystem  # noqa: E402 - the API's own writer, under test here


@pytest.fixture
def memory() -> Iterator[MemoryTier]:
    root = Path("/dev/shm") / f"trainguard-test-{uuid.uuid4().hex}"
    yield MemoryTier(root, keep=1, spare_buffers=1)
    subprocess.run(["rm", "-rf", str(root)], check=False)


def save(memory: MemoryTier, step: int, state: dict[str, Any]) -> Path:
    path = memory.stage("job", step)
    writer = dcp.FileSystemWriter(path, single_file_per_rank=True)
    writer.fs = ReuseFileSystem()
    dcp.save(state, storage_writer=writer, no_dist=True)
    memory.commit("job", step)
    return memory.step_path("job", step)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_save_into_reused_buffers_loads_back_exactly(memory: MemoryTier) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    save(memory, 1, {"model": model.state_dict()})
    shard = next(memory.step_path("job", 1).glob("*.distcp"))
    inode = shard.stat().st_ino
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    save(memory, 2, {"model": model.state_dict()})
    path = save(memory, 3, {"model": model.state_dict()})  # step 1's files are reused here
    assert memory.reused_stages >= 1
    assert any(p.stat().st_ino == inode for p in path.glob("*.distcp"))
    assert memory.verify("job", 3).ok

    fresh = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    target = {"model": fresh.state_dict()}
    dcp.load(target, checkpoint_id=str(path), no_dist=True)
    fresh.load_state_dict(target["model"])
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, expected[k]), k
