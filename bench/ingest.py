"""Telemetry ingest: how many messages per second the agent takes in, and what CPU it spends.

The receiver runs in its own process so its CPU time can be read from /proc/<pid>/stat. Two
receivers run side by side on the same offered load:

* baseline: the bare socket loop (drain with recv until EAGAIN, then poll), no decoding;
* agent:    agent.telemetry.TelemetryServer into a RankTable (decode, validate, store), plus a
            table snapshot once a second as the daemon's main loop takes one.

Loads: 1,024 simulated ranks at 10 steps/s each (10,240 msg/s offered, each rank at its own
phase, sent non-blocking the way trainguard/run/link.py's TelemetrySender does, so a full socket queue
shows up as sender-side drops), then one blocking sender as fast as the receiver takes them
(the receiver's maximum rate).

    python bench/ingest.py [--quick] [--qlen N]

``--qlen N`` raises net.unix.max_dgram_qlen to N for the run (root; restored afterwards).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from trainguard.agent.telemetry import read_dgram_qlen  # noqa: E402
from trainguard.agent.wire import Telemetry  # noqa: E402

CLK_TCK = os.sysconf("SC_CLK_TCK")


# -- receiver process ---------------------------------------------------------------------------


def serve(mode: str, path: str) -> None:
    """Run a receiver until stdin closes; answer 'stats' lines with a JSON line."""
    if mode == "agent":
        from trainguard.agent.ranktable import RankTable
        from trainguard.agent.telemetry import TelemetryServer

        table = RankTable()
        server = TelemetryServer(path, table)
        server.start()

        def stats() -> dict[str, object]:
            s = server.stats()
            return {"received": s.received_total, "stored": s.messages_total,
                    "dropped": sum(s.dropped_total.values()), "ranks": len(table)}
    else:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.bind(path)
        sock.setblocking(False)
        counts = {"received": 0}

        def loop() -> None:
            poller = select.poll()
            poller.register(sock.fileno(), select.POLLIN)
            recv = sock.recv
            n = 0
            while True:
                try:
                    while True:
                        recv(4097)
                        n += 1
                except BlockingIOError:
                    counts["received"] = n
                poller.poll(1000)

        import threading

        threading.Thread(target=loop, daemon=True).start()

        def stats() -> dict[str, object]:
            return {"received": counts["received"], "stored": 0, "dropped": 0, "ranks": 0}

    print("READY", flush=True)
    next_snapshot = time.monotonic() + 1.0
    while True:
        # The main thread stands in for the daemon's loop: a snapshot a second, commands between.
        ready, _, _ = select.select([sys.stdin], [], [], max(0.0, next_snapshot - time.monotonic()))
        if ready:
            line = sys.stdin.readline()
            if not line or line.strip() == "quit":
                return
            print(json.dumps(stats()), flush=True)
        if time.monotonic() >= next_snapshot:
            if mode == "agent" and not os.environ.get("BENCH_NO_SNAPSHOT"):
                table.snapshot()
            next_snapshot += 1.0


class Receiver:
    def __init__(self, mode: str, path: str) -> None:
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve", mode, "--path", path],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None and self.proc.stdout.readline().strip() == "READY"

    def cpu_s(self) -> float:
        with open(f"/proc/{self.proc.pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLK_TCK

    def stats(self) -> dict[str, int]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("stats\n")
        self.proc.stdin.flush()
        result: dict[str, int] = json.loads(self.proc.stdout.readline())
        return result

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# -- senders ------------------------------------------------------------------------------------


def _message(rank: int, step: int) -> bytes:
    return Telemetry(
        job="bench", rank=rank, local_rank=rank % 8, pid=10000 + rank, step=step, wall_time=time.time(),
        step_s=0.1, data_s=0.004, fwd_bwd_s=0.06 + (rank % 7) * 0.001, comm_s=0.03, opt_s=0.006,
        samples=32, tokens=32 * 512, loss=2.0 + 1.0 / (step + 1), grad_norm=1.1, local_grad_sq=0.3, lr=3e-4,
        batch_size=32, mem_bytes=(2 << 30) + rank, plan_version=1,
    ).encode()


def paced_sender(path: str, ranks: list[int], rate: float, duration: float, start_at: float, out: mp.Queue) -> None:
    """Each rank sends one message per 1/rate seconds at its own phase, from its own non-blocking
    socket like the trainer (a socket's send buffer caps what it alone can have queued)."""
    socks = {}
    for r in ranks:
        socks[r] = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        socks[r].setblocking(False)
    period = 1.0 / rate
    # Per-rank phases spread over the period; pre-encode a few steps per rank (encoding is the
    # trainer's cost, not the agent's, and would eat the CPU the receiver needs).
    schedule = sorted(((i * period / len(ranks)) % period, r) for i, r in enumerate(ranks))
    payloads = {r: [_message(r, s) for s in range(4)] for r in ranks}
    sent = eagain = 0
    k = 0
    while time.time() < start_at:
        time.sleep(0.001)
    t0 = time.monotonic()
    end = t0 + duration
    cycle = 0
    while True:
        base = t0 + cycle * period
        if base >= end:
            break
        for offset, rank in schedule:
            due = base + offset
            delay = due - time.monotonic()
            if delay > 0.0005:
                time.sleep(delay)
            try:
                socks[rank].sendto(payloads[rank][k & 3], path)
                sent += 1
            except BlockingIOError:
                eagain += 1
        cycle += 1
        k += 1
    out.put((sent, eagain))


def flood_sender(path: str, duration: float, start_at: float, out: mp.Queue) -> None:
    """Blocking sends as fast as the receiver drains them."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    payloads = [_message(r, s) for r in range(1024) for s in range(2)]
    sent = 0
    while time.time() < start_at:
        time.sleep(0.001)
    end = time.monotonic() + duration
    n = len(payloads)
    while time.monotonic() < end:
        for i in range(256):
            sock.sendto(payloads[(sent + i) % n], path)
        sent += 256
    out.put((sent, 0))


# -- one run ------------------------------------------------------------------------------------


@dataclass
class Row:
    receiver: str
    load: str
    offered: float
    ingested: float
    sender_drops: int
    agent_drops: int
    cpu_share: float
    """CPU seconds the receiver process used per wall second (1.0 = one core)."""

    @property
    def us_per_msg(self) -> float:
        return self.cpu_share / self.ingested * 1e6 if self.ingested > 0 else float("nan")

    @property
    def msgs_per_cpu_s(self) -> float:
        """Messages one fully busy core would take in at this cost."""
        return self.ingested / self.cpu_share if self.cpu_share > 0 else float("nan")


def run_one(mode: str, load: str, duration: float, ranks: int, rate: float, senders: int) -> Row:
    d = tempfile.mkdtemp(prefix="tg-bench-")
    path = os.path.join(d, "t.sock")
    rx = Receiver(mode, path)
    ctx = mp.get_context("fork")
    out: mp.Queue = ctx.Queue()
    try:
        start_at = time.time() + 0.5
        if load == "paced":
            procs = [ctx.Process(target=paced_sender,
                                 args=(path, list(range(i, ranks, senders)), rate, duration, start_at, out))
                     for i in range(senders)]
        else:
            procs = [ctx.Process(target=flood_sender, args=(path, duration, start_at, out))]
        for p in procs:
            p.start()
        while time.time() < start_at:
            time.sleep(0.001)
        before, cpu0, t0 = rx.stats(), rx.cpu_s(), time.monotonic()
        results = [out.get() for _ in procs]
        time.sleep(0.2)  # let the receiver finish what is queued
        after, cpu1, t1 = rx.stats(), rx.cpu_s(), time.monotonic()
        for p in procs:
            p.join()
    finally:
        rx.close()
        shutil.rmtree(d, ignore_errors=True)
    sent = sum(s for s, _ in results)
    eagain = sum(e for _, e in results)
    received = after["received"] - before["received"]
    return Row(
        receiver=mode, load=load,
        offered=(sent + eagain) / duration if load == "paced" else float("nan"),
        ingested=received / duration,
        sender_drops=eagain,
        agent_drops=after["dropped"] - before["dropped"],
        cpu_share=(cpu1 - cpu0) / (t1 - t0),
    )


def set_qlen(value: int) -> None:
    with open("/proc/sys/net/unix/max_dgram_qlen", "w") as fh:
        fh.write(f"{value}\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="short runs (about 30 s in all)")
    ap.add_argument("--ranks", type=int, default=1024)
    ap.add_argument("--rate", type=float, default=10.0, help="steps per second per rank")
    ap.add_argument("--senders", type=int, default=2, help="sender processes for the paced load")
    ap.add_argument("--qlen", type=int, default=0, help="raise net.unix.max_dgram_qlen for the run (root)")
    ap.add_argument("--serve", choices=["agent", "baseline"], help=argparse.SUPPRESS)
    ap.add_argument("--path", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(args.serve, args.path)
        return 0

    paced_s, flood_s = (5.0, 3.0) if args.quick else (20.0, 10.0)
    original_qlen = read_dgram_qlen()
    if args.qlen and original_qlen is not None and args.qlen != original_qlen:
        set_qlen(args.qlen)
    try:
        qlen = read_dgram_qlen()
        rows = []
        for load, duration in (("paced", paced_s), ("flood", flood_s)):
            for mode in ("baseline", "agent"):
                rows.append(run_one(mode, load, duration, args.ranks, args.rate, args.senders))
    finally:
        if args.qlen and original_qlen is not None and args.qlen != original_qlen:
            set_qlen(original_qlen)

    offered = args.ranks * args.rate
    with open("/proc/pressure/cpu") as fh:
        cpu_pressure = fh.readline().split()[1]  # "avg10=…": how contended the CPUs were
    print(f"telemetry ingest: {args.ranks} ranks x {args.rate:g} steps/s = {offered:,.0f} msg/s offered; "
          f"paced {paced_s:g} s, flood {flood_s:g} s; net.unix.max_dgram_qlen={qlen}; {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f}, CPU pressure {cpu_pressure}")
    print(f"{'receiver':<9} {'load':<6} {'offered msg/s':>14} {'ingested msg/s':>15} {'sender drops':>13} "
          f"{'agent drops':>12} {'CPU share':>10} {'CPU us/msg':>11} {'msgs/CPU-s':>11}")
    for r in rows:
        offered_s = "max" if r.load == "flood" else f"{r.offered:,.0f}"
        print(f"{r.receiver:<9} {r.load:<6} {offered_s:>14} {r.ingested:>15,.0f} {r.sender_drops:>13,} "
              f"{r.agent_drops:>12,} {r.cpu_share:>10.3f} {r.us_per_msg:>11.1f} {r.msgs_per_cpu_s:>11,.0f}")
    base_paced, agent_paced, base_flood, agent_flood = rows
    # CPU time per message is what the receiver costs whatever else runs; wall rates on a shared,
    # busy machine also measure the neighbours, so the ratios use CPU time.
    cpu_ratio = agent_paced.us_per_msg / base_paced.us_per_msg if base_paced.us_per_msg > 0 else float("inf")
    capacity_ratio = agent_flood.msgs_per_cpu_s / base_flood.msgs_per_cpu_s if base_flood.msgs_per_cpu_s else 0.0
    headroom = agent_flood.msgs_per_cpu_s / offered
    drop_ratio = agent_paced.sender_drops / max(agent_paced.offered * paced_s, 1)
    print(f"agent vs baseline CPU per message at {offered:,.0f} msg/s: {cpu_ratio:.2f}x; agent vs baseline messages per "
          f"CPU-second at full rate: {capacity_ratio:.2f}; one core of agent / offered load: {headroom:.1f}x")
    print(f"RESULT msgs_per_s={agent_flood.ingested:.0f} agent_cpu_share={agent_paced.cpu_share:.3f} "
          f"msgs_per_cpu_s={agent_flood.msgs_per_cpu_s:.0f} us_per_msg={agent_paced.us_per_msg:.1f} "
          f"cpu_cost_ratio={cpu_ratio:.2f} capacity_ratio={capacity_ratio:.2f} headroom_ratio={headroom:.2f} "
          f"sender_drop_ratio={drop_ratio:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
