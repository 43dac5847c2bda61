"""Block I/O latency per device, request issue to completion (biolatency's tracepoint mode)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from ..hist import Log2Hist
from .base import MapReader, Program, hist_from

ISSUE = "block:block_rq_issue"
COMPLETE = "block:block_rq_complete"


def dev_major_minor(dev: int) -> tuple[int, int]:
    """The kernel's internal dev_t (12-bit major, 20-bit minor), as block tracepoints report it."""
    return dev >> 20, dev & 0xFFFFF


@dataclass(frozen=True)
class BlockIoSnapshot:
    devices: dict[int, Log2Hist] = field(default_factory=dict)  # kernel dev_t -> histogram


class BlockIoLatency(Program):
    """Since 5.x the block tracepoints carry no request pointer; a request is matched from issue to
    completion by (dev, sector), as bcc's biolatency does when it runs on tracepoints."""

    name = "biolatency"
    hooks = ((ISSUE, "tg_bio_issue"), (COMPLETE, "tg_bio_complete"))

    def check_fields(self) -> str | None:
        return self.need_fields(ISSUE, "dev", "sector") or self.need_fields(COMPLETE, "dev", "sector")

    def body(self) -> str:
        return """
struct tg_bio_key { u64 sector; u32 dev; u32 pad; };
BPF_TABLE("lru_hash", struct tg_bio_key, u64, tg_bio_start, 16384);
BPF_HASH(tg_bio_dev, u32, struct tg_hist, 256);

int tg_bio_issue(struct tg_args_block_rq_issue *args) {
    struct tg_bio_key k = {};
    k.dev = args->dev;
    k.sector = args->sector;
    u64 ts = bpf_ktime_get_ns();
    tg_bio_start.update(&k, &ts);
    return 0;
}

int tg_bio_complete(struct tg_args_block_rq_complete *args) {
    struct tg_bio_key k = {};
    k.dev = args->dev;
    k.sector = args->sector;
    u64 *tsp = tg_bio_start.lookup(&k);
    if (!tsp)
        return 0;
    u64 delta = bpf_ktime_get_ns() - *tsp;
    tg_bio_start.delete(&k);
    u32 dev = k.dev;
    struct tg_hist zero = {};
    struct tg_hist *h = tg_bio_dev.lookup_or_try_init(&dev, &zero);
    if (h)
        tg_hist_add(h, delta);
    return 0;
}
"""

    def read(self, module: MapReader, idxs: Iterable[int]) -> BlockIoSnapshot:
        return BlockIoSnapshot({int(k.value): hist_from(v) for k, v in module.hash_items("tg_bio_dev")})
