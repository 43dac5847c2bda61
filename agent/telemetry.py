"""The agent's end of the telemetry socket: receive, validate, store.

Linux caps how many datagrams wait on a unix datagram socket at ``net.unix.max_dgram_qlen``
(10 by default, 512 where systemd's sysctl defaults apply), whatever SO_RCVBUF says; a rank that
finds the queue full drops its message (the sender never blocks). So the receiver thread empties
the queue first and decodes afterwards, a short batch at a time, and wakes the instant data
arrives. ``ensure_dgram_qlen`` lets the daemon raise the cap before the socket is created.

Who sent a datagram is known from the kernel, not from the message: the socket has SO_PASSCRED
set, so every datagram comes with its sender's pid (SCM_CREDENTIALS, which an unprivileged process
cannot forge). ``sender_check(job, pid)`` (installed by the daemon) says whether that pid may
report for that job: a job the agent launched takes telemetry only from its own rank processes
(or their descendants); anything else is dropped and counted as ``forged``.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import select
import socket
import stat
import struct
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from prometheus_client.metrics_core import Metric

from trainguard.agent import health
from trainguard.agent.ranktable import RankTable, RankTableConfig, RankView, TableSnapshot
from trainguard.agent.wire import MAX_DATAGRAM_BYTES, Telemetry, WireError, decode_telemetry, split_datagram

__all__ = ["RankTable", "RankTableConfig", "RankView", "TableSnapshot", "TelemetryServer", "TelemetryStats",
           "ensure_dgram_qlen", "read_dgram_qlen"]

log = logging.getLogger(__name__)

_QLEN_SYSCTL = "sys/net/unix/max_dgram_qlen"
# Datagrams decoded between two looks at the socket queue, and most held undecoded in between.
_DECODE_BATCH = 8
_PENDING_MAX = 4096
_RCVBUF_BYTES = 8 << 20
_CREDS = struct.Struct("3i")  # struct ucred: pid, uid, gid
_CMSG_SPACE = socket.CMSG_SPACE(_CREDS.size)


def _sender_pid(ancillary: list[tuple[int, int, bytes]]) -> int:
    """The sending process's pid from SCM_CREDENTIALS (0 when the kernel sent none)."""
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS and len(data) >= _CREDS.size:
            return int(_CREDS.unpack_from(data)[0])
    return 0


def read_dgram_qlen(proc_root: str = "/proc") -> int | None:
    """The kernel's cap on queued datagrams per unix socket, or None when it cannot be read."""
    try:
        with open(os.path.join(proc_root, _QLEN_SYSCTL)) as fh:
            return int(fh.read().strip())
    except (OSError, ValueError):
        return None


def ensure_dgram_qlen(minimum: int, proc_root: str = "/proc") -> int | None:
    """Raise ``net.unix.max_dgram_qlen`` to at least ``minimum`` (needs root; only ever raises it).

    Only sockets created afterwards get the new cap. Returns the cap now in force (None: unknown).
    """
    current = read_dgram_qlen(proc_root)
    if current is None or current >= minimum:
        return current
    try:
        with open(os.path.join(proc_root, _QLEN_SYSCTL), "w") as fh:
            fh.write(f"{minimum}\n")
    except OSError as exc:
        log.warning("cannot raise net.unix.max_dgram_qlen from %d to %d: %s", current, minimum, exc)
        return current
    return read_dgram_qlen(proc_root)


@dataclass(frozen=True)
class TelemetryStats:
    received_total: int
    """Datagrams read from the socket."""
    messages_total: int
    """Datagrams decoded and stored in the table."""
    dropped_total: dict[str, int]
    """Datagrams not stored, by reason (a WireError reason, 'unknown_job' or 'table_full')."""
    callback_errors_total: int
    queue_limit: int | None
    """net.unix.max_dgram_qlen as it was when the socket was created."""


class TelemetryServer:
    """Receives rank telemetry on a unix datagram socket into a RankTable, on its own thread.

    ``on_message`` runs on the receiver thread for every stored message; keep it quick. An
    exception in it is counted and logged once, never fatal. ``accept_unknown_jobs`` (when given)
    sets the table's flag of that name. ``min_queue`` raises net.unix.max_dgram_qlen to at least
    that before the socket is created (root only; see the module docstring). The server is also a
    metric source (``metrics()``).
    """

    name = "telemetry"

    def __init__(
        self,
        path: str,
        table: RankTable,
        on_message: Callable[[Telemetry], None] | None = None,
        *,
        mode: int = 0o660,
        group: int | None = None,
        clock: Callable[[], float] = time.time,
        proc_root: str = "/proc",
        poll_interval_s: float = 1.0,
        accept_unknown_jobs: bool | None = None,
        min_queue: int | None = None,
    ) -> None:
        if accept_unknown_jobs is not None:
            table.set_accept_unknown_jobs(accept_unknown_jobs)
        self.path = path
        self.min_queue = min_queue
        self.table = table
        self.on_message = on_message
        self.sender_check: Callable[[str, int], bool] | None = None
        """``(job, sender pid) -> allowed``; None: every sender is taken at its word."""
        self.mode = mode
        self.group = group
        """The socket's group (the ranks' group when they run as ``launcher.user``; None: the agent's)."""
        self._clock = clock
        self._proc_root = proc_root
        self._poll_ms = max(1, int(poll_interval_s * 1000))
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._wake_r, self._wake_w = -1, -1
        self._stopping = threading.Event()
        self.received_total = 0
        self.messages_total = 0
        self.dropped_total: dict[str, int] = {}
        self.callback_errors_total = 0
        self.queue_limit: int | None = None
        self._metrics: Any = None

    # -- lifecycle ----------------------------------------------------------------------------

    def bind(self) -> None:
        """Create and bind the socket (``start`` does this when needed). Raises OSError when the
        path is held by a live listener or by something that is not a socket."""
        if self._sock is not None:
            return
        self._remove_stale()
        if self.min_queue:
            # Must happen before socket(): the kernel copies the cap into each socket at creation.
            ensure_dgram_qlen(self.min_queue, self._proc_root)
        self.queue_limit = read_dgram_qlen(self._proc_root)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            # For unix datagrams the queue cap above is what limits bursts, but a big buffer costs
            # nothing and keeps the memory accounting out of the way.
            for opt in (getattr(socket, "SO_RCVBUFFORCE", None), socket.SO_RCVBUF):
                if opt is None:
                    continue
                try:
                    sock.setsockopt(socket.SOL_SOCKET, opt, _RCVBUF_BYTES)
                    break
                except OSError:
                    continue
            sock.bind(self.path)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        except BaseException:
            sock.close()
            raise
        try:
            if self.group is not None:
                # The group before the mode: the umask's mode gives the group no write, so the
                # ranks' group can send only once the socket is the mode this server chose.
                os.chown(self.path, -1, self.group, follow_symlinks=False)
            os.chmod(self.path, self.mode)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            with contextlib.suppress(OSError):
                os.unlink(self.path)  # ours: we just bound it
            raise
        self._sock = sock

    def start(self) -> None:
        if self._thread is not None:
            return
        self.bind()
        self._stopping.clear()
        self._wake_r, self._wake_w = os.pipe()
        self._thread = threading.Thread(target=self._run, name="telemetry-rx", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread, close and remove the socket. Safe to call twice."""
        self._stopping.set()
        if self._wake_w >= 0:
            with contextlib.suppress(OSError):
                os.write(self._wake_w, b"x")
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        for fd in (self._wake_r, self._wake_w):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._wake_r, self._wake_w = -1, -1
        if self._sock is not None:
            self._sock.close()
            self._sock = None
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)

    def __enter__(self) -> TelemetryServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stats(self) -> TelemetryStats:
        return TelemetryStats(
            received_total=self.received_total,
            messages_total=self.messages_total,
            dropped_total=dict(self.dropped_total),
            callback_errors_total=self.callback_errors_total,
            queue_limit=self.queue_limit,
        )

    def metrics(self) -> Iterable[Metric]:
        """Telemetry counters and per-rank figures as Prometheus families (see agent.exporter)."""
        if self._metrics is None:
            from trainguard.agent.exporter import TelemetryMetrics  # the exporter imports this module

            self._metrics = TelemetryMetrics(self.table, self)
        return self._metrics.metrics()  # type: ignore[no-any-return]

    # -- internals ----------------------------------------------------------------------------

    def _remove_stale(self) -> None:
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(st.st_mode):
            raise OSError(errno.EEXIST, f"{self.path} exists and is not a socket; not removing it")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            probe.connect(self.path)
        except ConnectionRefusedError:
            os.unlink(self.path)  # left behind by an agent that died: nobody is bound to it
            return
        finally:
            probe.close()
        raise OSError(errno.EADDRINUSE, f"{self.path}: another process is receiving telemetry there")

    def _run(self) -> None:
        sock = self._sock
        assert sock is not None
        recvmsg = sock.recvmsg
        bufsize = MAX_DATAGRAM_BYTES + 1  # one byte more, so an oversized datagram shows as such
        poller = select.poll()
        poller.register(sock.fileno(), select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        stopping = self._stopping
        pending: list[tuple[bytes, int]] = []
        while not stopping.is_set():
            health.beat(self, self.name)
            # Empty the kernel queue into our own list first (a recv is ~1 us, a decode ~10 us),
            # then decode a few and look at the queue again: senders find room sooner.
            try:
                while len(pending) < _PENDING_MAX:
                    data, ancillary, _flags, _addr = recvmsg(bufsize, _CMSG_SPACE)
                    pending.append((data, _sender_pid(ancillary)))
            except (BlockingIOError, InterruptedError):
                pass
            except OSError as exc:  # should not happen on a bound datagram socket; do not spin
                log.warning("telemetry socket receive failed: %s", exc)
                time.sleep(0.1)
            if pending:
                batch = pending[:_DECODE_BATCH]
                del pending[:_DECODE_BATCH]
                try:
                    self._ingest(batch)
                except Exception as exc:  # noqa: BLE001 - a bad batch costs its messages, not the receiver
                    self.dropped_total["internal"] = self.dropped_total.get("internal", 0) + len(batch)
                    health.failed(self, self.name, exc)
                continue
            poller.poll(self._poll_ms)
        health.stopped(self, self.name)

    def _ingest(self, batch: list[tuple[bytes, int]]) -> None:
        good: list[Telemetry] = []
        dropped = self.dropped_total
        check = self.sender_check
        for datagram, sender in batch:
            if len(datagram) > MAX_DATAGRAM_BYTES:  # cut off by the receive buffer: not one part is whole
                self.received_total += 1
                dropped["size"] = dropped.get("size", 0) + 1
                continue
            parts = split_datagram(datagram)
            self.received_total += len(parts)
            for data in parts:
                try:
                    msg = decode_telemetry(data)
                    if check is not None and not check(msg.job, sender):
                        dropped["forged"] = dropped.get("forged", 0) + 1
                        continue
                    good.append(msg)
                except WireError as exc:
                    dropped[exc.reason] = dropped.get(exc.reason, 0) + 1
                except Exception:  # a decoder bug must cost one message, not the receiver thread
                    log.exception("telemetry decoder failed")
                    dropped["internal"] = dropped.get("internal", 0) + 1
        if not good:
            return
        result = self.table.add_many(good, self._clock())
        for reason, n in result.rejected.items():
            dropped[reason] = dropped.get(reason, 0) + n
        self.messages_total += len(result.accepted)
        callback = self.on_message
        if callback is not None:
            for msg in result.accepted:
                try:
                    callback(msg)
                except Exception:
                    if self.callback_errors_total == 0:
                        log.exception("telemetry on_message callback failed (logged once)")
                    self.callback_errors_total += 1
