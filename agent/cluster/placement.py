"""Topology-aware rank placement for a job that spans nodes.

The trainer lays ranks out as ``rank = (pp_idx * dp + dp_idx) * tp + tp_idx`` (tp fastest, as
``init_device_mesh(("pp", "dp", "tp"))``). Tensor-parallel groups exchange activations every
layer, so they must stay inside a node; data-parallel replicas only all-reduce gradients once
per step and may span nodes. ``place`` hands every node a contiguous block of global ranks whose
size is a multiple of ``tp`` (so no tp group is ever split), fills nodes in name order, and says
what it chose and why; ``Placement.rank_env`` gives the torchrun-style environment of one local
rank (global RANK = the node's offset + local rank, the leader-chosen MASTER_ADDR/PORT, which is
where torch's c10d TCPStore for the rendezvous runs).
"""

from __future__ import annotations

from dataclasses import dataclass, field


class PlacementError(ValueError):
    """The job cannot be placed on these nodes; the message says why."""


@dataclass(frozen=True)
class NodeBlock:
    node: str
    rank_offset: int
    nproc: int


@dataclass(frozen=True)
class Placement:
    dp: int
    tp: int
    pp: int
    blocks: tuple[NodeBlock, ...]
    notes: tuple[str, ...] = field(default=())

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def master_node(self) -> str:
        return self.blocks[0].node

    def block(self, node: str) -> NodeBlock | None:
        return next((b for b in self.blocks if b.node == node), None)

    def rank_env(self, node: str, local_rank: int, master_addr: str, master_port: int) -> dict[str, str]:
        b = self.block(node)
        if b is None or not 0 <= local_rank < b.nproc:
            raise PlacementError(f"node {node} has no local rank {local_rank} in this placement")
        return {
            "RANK": str(b.rank_offset + local_rank),
            "LOCAL_RANK": str(local_rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_WORLD_SIZE": str(b.nproc),
            "GROUP_RANK": str(self.blocks.index(b)),
            "MASTER_ADDR": master_addr,
            "MASTER_PORT": str(master_port),
        }

    def describe(self) -> str:
        parts = [f"{b.node}: ranks {b.rank_offset}-{b.rank_offset + b.nproc - 1}" for b in self.blocks]
        return f"dp={self.dp} tp={self.tp} pp={self.pp} on {len(self.blocks)} node(s): " + "; ".join(parts)

    def check(self) -> list[str]:
        """Every tp group inside one node (an invariant ``place`` guarantees; checked again for
        placements read back from etcd). Returns the violations."""
        owner: dict[int, str] = {}
        for b in self.blocks:
            for r in range(b.rank_offset, b.rank_offset + b.nproc):
                owner[r] = b.node
        bad = []
        for start in range(0, self.world_size, self.tp):
            nodes = {owner.get(r) for r in range(start, start + self.tp)}
            if len(nodes) != 1 or None in nodes:
                bad.append(f"tp group of ranks {start}-{start + self.tp - 1} spans {sorted(map(str, nodes))}")
        return bad


def place(dp: int, tp: int, pp: int, slots: dict[str, int], first: str | None = None) -> Placement:
    """Place dp x tp x pp ranks on nodes with ``slots`` free ranks each (name order; ``first``, when
    it has room, takes the first block, so global rank 0 and the c10d store run there)."""
    for key, v in (("dp", dp), ("tp", tp), ("pp", pp)):
        if v < 1:
            raise PlacementError(f"{key} must be >= 1, got {v}")
    world = dp * tp * pp
    order = sorted(slots, key=lambda n: (n != first, n))
    usable = {n: (slots[n] // tp) * tp for n in order if slots[n] >= tp}
    notes = []
    for n, s in sorted(slots.items()):
        if s < tp:
            notes.append(f"{n} skipped: {s} slot(s) cannot hold a tp={tp} group")
        elif s % tp:
            notes.append(f"{n}: {s % tp} slot(s) left idle (tp groups of {tp} stay inside a node)")
    if sum(usable.values()) < world:
        raise PlacementError(f"{world} ranks (dp={dp} tp={tp} pp={pp}) need more room: usable slots "
                             f"{usable or '{}'} hold {sum(usable.values())} in whole tp groups")
    blocks, offset = [], 0
    for n, s in usable.items():
        if offset >= world:
            break
        take = min(s, world - offset)
        blocks.append(NodeBlock(n, offset, take))
        offset += take
    placement = Placement(dp, tp, pp, tuple(blocks), tuple(notes))
    assert not placement.check(), placement.check()
    return placement
