"""TCP retransmits, node-wide and per rank where the socket's owner is known."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from .base import MapReader, Program

RETRANSMIT = "tcp:tcp_retransmit_skb"
SOCK_STATE = "sock:inet_sock_set_state"


@dataclass(frozen=True)
class TcpSnapshot:
    node: int = 0
    ranks: dict[int, int] = field(default_factory=dict)


class TcpRetransmits(Program):
    """Retransmits run in softirq or timer context, where the current task is whoever was
    interrupted. The owner is taken from the socket instead: ``inet_sock_set_state`` fires in the
    connecting process when it enters SYN_SENT, so a rank's outgoing connections are mapped to its
    slot. Sockets of unknown owner (accepted ones) fall back to the current task, which is only
    right when the retransmit happens in the rank's own send path."""

    name = "tcpretrans"
    hooks = ((RETRANSMIT, "tg_tcp_retransmit"), (SOCK_STATE, "tg_tcp_state"))
    optional = frozenset({SOCK_STATE})
    rank_arrays = ("tg_tcp_rank",)

    def check_fields(self) -> str | None:
        if self.has(SOCK_STATE) and self.need_fields(SOCK_STATE, "skaddr", "newstate"):
            del self.fields[SOCK_STATE]  # owner mapping off, counting still works
        return self.need_fields(RETRANSMIT, "skaddr")

    def body(self) -> str:
        owner = ""
        lookup = "u32 *o = 0;"
        if self.has(SOCK_STATE):
            proto = "if (args->protocol != 6 /* IPPROTO_TCP */) return 0;" if self.has(SOCK_STATE, "protocol") else ""
            owner = f"""
BPF_TABLE("lru_hash", u64, u32, tg_sock_owner, 16384);  /* socket -> rank slot */

int tg_tcp_state(struct tg_args_inet_sock_set_state *args) {{
    {proto}
    u64 sk = (u64)args->skaddr;
    if (args->newstate == 7 /* TCP_CLOSE */) {{
        tg_sock_owner.delete(&sk);
        return 0;
    }}
    if (args->newstate != 2 /* TCP_SYN_SENT: in connect(), in the owner's context */)
        return 0;
    u32 idx1 = tg_current_idx1();
    if (idx1) {{
        u32 i = idx1 - 1;
        tg_sock_owner.update(&sk, &i);
    }}
    return 0;
}}
"""
            lookup = "u32 *o = tg_sock_owner.lookup(&sk);"
        return owner + f"""
BPF_PERCPU_ARRAY(tg_tcp_node, u64, 1);
BPF_ARRAY(tg_tcp_rank, u64, TG_MAX_TRACKED);

int tg_tcp_retransmit(struct tg_args_tcp_retransmit_skb *args) {{
    u32 zero = 0;
    u64 *n = tg_tcp_node.lookup(&zero);
    if (n)
        *n += 1;
    u64 sk = (u64)args->skaddr;
    {lookup}
    u32 idx1 = o ? *o + 1 : tg_current_idx1();
    if (idx1) {{
        u32 i = idx1 - 1;
        u64 *c = tg_tcp_rank.lookup(&i);
        if (c)
            __sync_fetch_and_add(c, 1);
    }}
    return 0;
}}
"""

    def read(self, module: MapReader, idxs: Iterable[int]) -> TcpSnapshot:
        node = sum(int(v) for v in module.percpu_get("tg_tcp_node", 0))
        return TcpSnapshot(node, {i: int(module.array_get("tg_tcp_rank", i)) for i in idxs})
