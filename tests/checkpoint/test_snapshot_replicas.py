"""Snapshots of data-parallel replicas shared out among the ranks (trainguard/checkpoint/snapshot/replicas.py): real
gloo ranks with a DDP model and AdamW each keep about a third of the common tensors, restore the
whole state bit-equal from the three slots, keep what is theirs alone (a buffer, the RNG, plain
values) in their own slot, and refuse a restore whose share is gone or of another structure instead
of half-loading it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from trainguard.agent.lifecycle.launcher import free_port
from trainguard.checkpoint.snapshot.replicas import holders, replicated_ids
from trainguard.checkpoint.snapshot.writer import SnapshotWriter

REPO = Path(__file__).resolve().parents[2]

_RANK = textwrap.dedent("""
    import json, os, sys, torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    from trainguard.agent.checkpoint.snapshots import mark_empty, slot_path
    from trainguard.checkpoint.snapshot.replicas import replicated_ids
    from trainguard.checkpoint.snapshot.errors import SnapshotError
    from trainguard.checkpoint.snapshot.writer import SnapshotWriter
    from trainguard.checkpoint.snapshot.load import load_snapshot

    directory, out = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    inner = nn.Sequential(nn.Linear(8, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 4))
    model = DDP(inner, broadcast_buffers=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(100 + rank)  # each rank its own batches: BatchNorm's statistics differ
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(16, 8)).pow(2).mean().backward()
        opt.step()
    state = {"model": model, "optim": opt, "epoch": 10 + rank}
    writer = SnapshotWriter(directory, rank, world, 0, share=True)
    writer.take(4, state, {"rank": rank})
    writer.close()
    alone = SnapshotWriter(directory + "-alone", rank, world, 0)  # the same state, kept whole
    alone.take(4, state, {"rank": rank})
    alone.close()
    common = replicated_ids(state)
    tensors = list(model.state_dict(keep_vars=True).values()) + [t for e in opt.state.values() for t in e.values()]
    replicated = sum(t.numel() * t.element_size() for t in tensors if id(t) in common)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    want_opt = [{n: t.clone() for n, t in opt.state[p].items()} for p in model.parameters()]
    want_rand = torch.rand(2)
    dist.barrier()

    with torch.no_grad():  # training went on after the snapshot
        for p in model.parameters():
            p.add_(1.0)
        for entry in opt.state.values():
            entry["exp_avg"].add_(1.0)
    inner[1].running_mean.zero_()
    state["epoch"] = -1
    meta = load_snapshot(directory, rank, world, 4, state)
    same = all(torch.equal(v, want[k]) for k, v in model.state_dict().items())
    same_opt = all(torch.equal(opt.state[p][n], t) for p, e in zip(model.parameters(), want_opt) for n, t in e.items())
    result = {"meta": meta, "epoch": state["epoch"], "same": same, "same_opt": same_opt,
              "same_rand": torch.equal(torch.rand(2), want_rand), "payload": writer.stats.state_bytes,
              "whole": alone.stats.state_bytes, "replicated": replicated}
    # Parameters given new memory alike on every rank (``p.data = ...``): each rank checks only the
    # tensors its slot keeps, and that still sees it, copied at once or by the helper thread.
    for overlap in (False, True):
        swap_dir = directory + f"-swap{int(overlap)}"
        w = SnapshotWriter(swap_dir, rank, world, 0, share=True, overlap=overlap)
        w.take(1, state, {})
        w.wait()
        with torch.no_grad():
            for p in model.parameters():
                p.data = p.detach().clone() + 5.0
        w.take(2, state, {})  # overlapped: skipped, the helper finds the memory moved
        w.take(3, state, {})
        w.close()
        want_swap = {k: v.clone() for k, v in model.state_dict().items()}
        dist.barrier()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        load_snapshot(swap_dir, rank, world, 3, state)
        result[f"swap_overlap_{overlap}"] = all(torch.equal(v, want_swap[k]) for k, v in model.state_dict().items())
    dist.barrier()
    if rank == 1:
        for slot in ("a", "b"):
            mark_empty(slot_path(directory, 1, slot))  # rank 1's slot, with its share, is gone
    dist.barrier()
    def refusal(step):
        try:
            load_snapshot(directory, rank, world, step, state)
        except SnapshotError as exc:
            return str(exc)
        return ""

    if rank != 1:
        result["refused"] = refusal(4)
    # Step 5 of a rank 1 whose state holds one more module: its slot is not the others' share.
    other = dict(state, extra=nn.Linear(4, 4)) if rank == 1 else state
    again = SnapshotWriter(directory, rank, world, 0, share=True)
    again.take(5, other, {})
    again.close()
    dist.barrier()
    if rank != 1:
        result["refused_other"] = refusal(5)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
        json.dump(result, fh)
    dist.destroy_process_group()
""")


@pytest.mark.timeout(120)
def test_three_ddp_ranks_keep_a_third_each_and_restore_the_whole_state(tmp_path: Path) -> None:
    world, port = 3, free_port()
    script = tmp_path / "rank.py"
    script.write_text(_RANK)
    directory, out = tmp_path / "snap", tmp_path / "out"
    out.mkdir()
    procs = [subprocess.Popen([sys.executable, str(script), str(directory), str(out)], cwd=tmp_path,
                              env={**os.environ, "PYTHONPATH": str(REPO), "RANK": str(r), "WORLD_SIZE": str(world),
                                   "LOCAL_RANK": str(r), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                                   "OMP_NUM_THREADS": "1"},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(world)]
    outputs = [p.communicate(timeout=110)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outputs
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    for rank, res in enumerate(results):
        assert res["same"] and res["same_opt"] and res["same_rand"], (rank, res)
        assert res["meta"] == {"rank": rank} and res["epoch"] == 10 + rank
        assert res["swap_overlap_False"] and res["swap_overlap_True"], (rank, res)
    # Parameters and AdamW's state (4 bytes an element, 3 copies, and the step counts): every rank
    # holds them alike, and the three slots keep them once, a third or so each, beside what each
    # rank keeps whole (BatchNorm's statistics, the RNG).
    replicated = results[0]["replicated"]
    assert replicated >= 4 * 3 * (8 * 64 + 64 + 64 + 64 + 64 * 4 + 4), results[0]
    saved = [res["whole"] - res["payload"] for res in results]
    assert abs(sum(saved) - 2 * replicated) <= 64 * 3 * world, (saved, replicated)
    assert all(0.55 * replicated < s < 0.8 * replicated for s in saved), (saved, replicated)
    # Rank 1's share gone: the others refuse the step (the caller falls back to a checkpoint).
    for rank in (0, 2):
        assert "rank 1 has no complete snapshot of step 4" in results[rank]["refused"], results[rank]
        assert "rank 1's snapshot of step 5 holds another structure" in results[rank]["refused_other"], results[rank]


def test_shares_are_contiguous_about_equal_and_the_same_on_every_rank() -> None:
    sizes: list[int | None] = [400, None, 100, 100, 200, None, 300, 100, 100, 400, 8]
    by_rank = [holders(sizes, 3, r) for r in range(3)]
    owner = [0 if h == -1 else h for h in by_rank[0]]  # rank 0's view: -1 is its own
    for r in range(3):  # every rank sees the same assignment, with -1 for its own share
        for i, size in enumerate(sizes):
            assert by_rank[r][i] == (-1 if size is None or owner[i] == r else owner[i]), (r, i)
    replicated = [owner[i] for i, s in enumerate(sizes) if s is not None]
    assert replicated == sorted(replicated) and set(replicated) == {0, 1, 2}  # one run each
    shares = [sum(s for s, o in zip(sizes, owner, strict=True) if s is not None and o == r) for r in range(3)]
    assert sum(shares) == 1708 and max(shares) < 1.5 * min(shares), shares
    assert holders([None, None], 4, 0) == (-1, -1)


def test_without_ddp_nothing_is_shared_and_every_rank_keeps_its_whole_state(tmp_path: Path) -> None:
    # A plain module and its optimizer may differ between ranks (no DDP keeps them alike).
    model = nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    assert replicated_ids({"model": model, "optim": opt}) == set()
    writer = SnapshotWriter(str(tmp_path), 0, 2, 0, share=True)
    writer.take(1, {"model": model, "optim": opt}, {})
    # weight and bias, and their momentum, all kept in this rank's slot (the RNG goes in the skeleton)
    assert writer.stats.state_bytes == 2 * 8 * 9 * 4
    writer.close()
