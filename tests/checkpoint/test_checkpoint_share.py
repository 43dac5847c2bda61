"""A whole checkpoint sent from the ranks of the node that holds it to the ranks of the nodes
that do not (``trainguard.checkpoint.share``), over a real gloo group of forked ranks: three
ranks as node 0 (rank 0, holds it) and node 1 (ranks 1 and 2, receive one copy between them)."""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.conftest import join_ranks
from trainguard.agent.checkpoint.manifest import build_manifest, write_manifest
from trainguard.agent.lifecycle.launcher import free_port
from trainguard.checkpoint.share import ShareError, _check_entry, share

NODES = (0, 1, 1)
LOCAL = (0, 0, 1)


def make_checkpoint(root: Path) -> Path:
    ckpt = root / "held"
    (ckpt / "rng").mkdir(parents=True)
    (ckpt / "__0_0.distcp").write_bytes(os.urandom(300_000))
    (ckpt / "rng" / "rank0.pt").write_bytes(b"rng state")
    (ckpt / "meta.json").write_text(json.dumps({"step": 42}))
    write_manifest(ckpt, build_manifest(ckpt, "job", 42, {"whole": True}))
    return ckpt


def _rank(rank: int, world: int, port: int, held: str, out: str, damage: bool) -> None:
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    if damage and rank == 0:
        with open(os.path.join(held, "__0_0.distcp"), "r+b") as fh:
            fh.write(b"X")  # the manifest's checksum no longer matches
    report: dict[str, Any] = {}
    try:
        path, done = share(held if rank == 0 else None, rank=rank, world=world, node=NODES[rank],
                           local_rank=LOCAL[rank])
        assert path is not None
        files = {str(p.relative_to(path)): p.read_bytes().hex() for p in Path(path).rglob("*") if p.is_file()}
        report = {"path": path, "files": files}
        done()
        report["left_after_done"] = os.path.exists(path)
    except ShareError as exc:
        report = {"error": str(exc)}
    Path(out, f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


def run_ranks(tmp_path: Path, damage: bool = False) -> tuple[Path, list[dict[str, Any]]]:
    held = make_checkpoint(tmp_path)
    join_ranks(mp.start_processes(_rank, args=(3, free_port(), str(held), str(tmp_path), damage), nprocs=3,
                                  start_method="fork", join=False), "share")
    return held, [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]


def test_the_ranks_of_a_node_without_the_checkpoint_load_one_verified_copy(tmp_path: Path) -> None:
    held, reports = run_ranks(tmp_path)
    want = {str(p.relative_to(held)): p.read_bytes().hex() for p in held.rglob("*") if p.is_file()}
    assert reports[0]["path"] == str(held) and reports[0]["left_after_done"]
    # node 1's two ranks read one copy, made by its lowest local rank, gone once both loaded it
    assert reports[1]["path"] == reports[2]["path"] != str(held)
    assert reports[1]["files"] == reports[2]["files"] == want
    assert not reports[1]["left_after_done"] and not os.path.exists(reports[1]["path"])


def test_a_copy_that_does_not_match_its_manifest_fails_on_every_rank(tmp_path: Path) -> None:
    _held, reports = run_ranks(tmp_path, damage=True)
    assert all("error" in r for r in reports), reports
    assert "does not match its manifest" in reports[0]["error"] or "could not receive" in reports[0]["error"]
    assert "does not match its manifest" in reports[1]["error"]


@pytest.mark.parametrize("entry", [["../escape", 1], ["/etc/passwd", 1], ["a", -1], "x"])
def test_a_bad_index_entry_is_refused(entry: object) -> None:
    with pytest.raises(ShareError):
        _check_entry(entry)
