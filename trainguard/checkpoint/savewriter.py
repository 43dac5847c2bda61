"""Memory-tier checkpoints written by a helper process, so that the training step is blocked only for
the copy of the state: saves are asynchronous.

When one rank writes a checkpoint alone (data-parallel replicas, or a single rank), the DCP save
itself (planning, one ``torch.save`` per tensor at ~0.15 ms each, the metadata, the commit: ~110 ms
for the recovery bench's 390-tensor state, with every rank waiting) runs in a child process forked
from that rank at its first save. Each save copies the state's tensors into a shared-memory buffer
(a memfd whose pages are kept from save to save, so the copy runs at memcpy speed), sends the
state's structure and plain values to the child over a pipe, and goes back to training; the child
rebuilds the state on views of the buffer and writes it (``write``, the caller's function).

Why a fork: a thread would hold the GIL against the training loop for the whole save, and a fresh
interpreter would import torch (seconds of CPU) on every job start; the fork costs ~7 ms once. The
child closes every descriptor it inherited but its own (a dead rank's gloo sockets must close when
the rank dies, not when its helper exits), freezes the inherited objects so that no collector of
its own finalizes them, takes default signal handling, and ends at the end of its request pipe (the
rank closed it or died) once the save in hand is written.

One save in flight: a save due while the previous one is being written waits for it first.
"""

from __future__ import annotations

import gc
import mmap
import multiprocessing.util
import os
import pickle
import select
import shutil
import signal
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from trainguard.checkpoint.snapshot.skeleton import TensorRef, TensorSpec, map_leaves, spec_nbytes
from trainguard.checkpoint.snapshot.slot import unmap

_ALIGN = 64
_LENGTH = struct.Struct("<Q")


@dataclass
class SaveJob:
    """One save for the child: the tensors lie in the buffer at ``specs``; ``tree`` is the state
    with a TensorRef for each tensor; the rest is what ``write`` needs to commit it."""

    label: int
    staging: str
    specs: list[TensorSpec]
    buffer_bytes: int
    tree: Any
    context: dict[str, Any] = field(default_factory=dict)


@dataclass
class SaveResult:
    label: int
    ok: bool
    error: str = ""
    seconds: float = 0.0
    """How long the child took to write and commit it."""


class WriteFailed(Exception):
    """Raised by a ``write`` function: the save failed, its message says why in one line."""


class SaveWriterError(Exception):
    """The helper cannot take this save (the caller writes it itself)."""


def _write_msg(fd: int, obj: Any) -> None:
    raw = pickle.dumps(obj, protocol=5)
    view = memoryview(_LENGTH.pack(len(raw)) + raw)
    while view:
        view = view[os.write(fd, view):]


def _read_exact(fd: int, n: int) -> bytes | None:
    chunks, got = [], 0
    while got < n:
        chunk = os.read(fd, n - got)
        if not chunk:
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _read_msg(fd: int) -> Any:
    head = _read_exact(fd, _LENGTH.size)
    if head is None:
        return None
    body = _read_exact(fd, _LENGTH.unpack(head)[0])
    return None if body is None else pickle.loads(body)


def _strip(value: Any, tensors: list[torch.Tensor]) -> Any:
    """``value`` with each tensor replaced by a TensorRef into ``tensors`` (anything else is pickled
    as it is). Only plain tensors: a sharded one is not a rank's to write alone."""
    def ref(v: Any) -> Any:
        if not isinstance(v, torch.Tensor):
            return v
        if type(v) not in (torch.Tensor, torch.nn.Parameter):
            raise SaveWriterError(f"a {type(v).__name__} is written in the training process")
        tensors.append(v)
        return TensorRef(len(tensors) - 1)

    return map_leaves(value, ref)


def _fill(value: Any, tensors: list[torch.Tensor]) -> Any:
    return map_leaves(value, lambda v: tensors[v.index] if isinstance(v, TensorRef) else v)


def _views(buf: torch.Tensor, specs: list[TensorSpec]) -> list[torch.Tensor]:
    return [buf.narrow(0, s.offset, spec_nbytes(s)).view(getattr(torch, s.dtype)).view(s.shape) for s in specs]


class _Buffer:
    """The memfd the state is copied into; its layout is kept while the tensors' shapes stay."""

    def __init__(self) -> None:
        self.fd = os.memfd_create("trainguard-save", os.MFD_CLOEXEC)
        self.size = 0
        self.mm: mmap.mmap | None = None
        self.signature: tuple[tuple[torch.dtype, tuple[int, ...]], ...] | None = None
        self.specs: list[TensorSpec] = []
        self.dsts: list[torch.Tensor] = []

    def copy_in(self, tensors: list[torch.Tensor]) -> tuple[list[TensorSpec], int]:
        signature = tuple((t.dtype, tuple(t.shape)) for t in tensors)
        if signature != self.signature:
            self._layout(tensors, signature)
        with torch.no_grad():
            torch._foreach_copy_(self.dsts, [t.detach() for t in tensors])
        return self.specs, self.size

    def _layout(self, tensors: list[torch.Tensor], signature: Any) -> None:
        specs, offset = [], 0
        for t in tensors:
            offset = -(-offset // _ALIGN) * _ALIGN
            specs.append(TensorSpec(offset, str(t.dtype).removeprefix("torch."), tuple(t.shape)))
            offset += t.numel() * t.element_size()
        size = max(_ALIGN, -(-offset // _ALIGN) * _ALIGN)
        self.dsts, self.signature = [], None
        if size > self.size or self.mm is None:
            if self.mm is not None:
                unmap(self.mm)
            # Allocated and touched now: a full /dev/shm fails here (ENOSPC), not as a SIGBUS
            # in the middle of a copy, and later copies find their pages in place.
            os.posix_fallocate(self.fd, 0, size)
            self.mm = mmap.mmap(self.fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            torch.frombuffer(self.mm, dtype=torch.uint8).zero_()
            self.size = size
        buf = torch.frombuffer(self.mm, dtype=torch.uint8)
        self.dsts = _views(buf, specs)
        self.specs, self.signature = specs, signature

    def close(self) -> None:
        self.dsts = []
        if self.mm is not None:
            unmap(self.mm)
            self.mm = None
        os.close(self.fd)


def _serve(req_fd: int, resp_fd: int, buf_fd: int, write: Callable[[SaveJob, Any], None]) -> None:
    """The child's loop: each request written and answered, until the request pipe ends."""
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    try:
        signal.set_wakeup_fd(-1)
    except ValueError:
        pass
    gc.freeze()  # the rank's objects are the rank's: never finalized here (their fds are closed below)
    keep = sorted({0, 1, 2, req_fd, resp_fd, buf_fd})
    for low, high in zip(keep, keep[1:] + [os.sysconf("SC_OPEN_MAX")], strict=True):
        os.closerange(low + 1, high)
    torch.set_num_threads(1)
    while True:
        job = _read_msg(req_fd)
        if job is None:
            return
        t0 = time.perf_counter()
        try:
            mm = mmap.mmap(buf_fd, job.buffer_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            try:
                tensors = _views(torch.frombuffer(mm, dtype=torch.uint8), job.specs)
                write(job, _fill(job.tree, tensors))
            finally:
                tensors = []
                unmap(mm)
            result = SaveResult(job.label, True, seconds=time.perf_counter() - t0)
        except BaseException as exc:  # noqa: BLE001 - every failure goes back to the rank as its answer
            shutil.rmtree(job.staging, ignore_errors=True)
            text = str(exc)[:300] if isinstance(exc, WriteFailed) else f"{type(exc).__name__}: {str(exc)[:300]}"
            result = SaveResult(job.label, False, text, time.perf_counter() - t0)
        _write_msg(resp_fd, result)


class SaveWriter:
    """The helper process of one rank (see the module docstring). ``write(job, state)`` runs in the
    child: it writes ``state`` (tensors are views of the buffer) into ``job.staging`` and commits."""

    def __init__(self, write: Callable[[SaveJob, Any], None]) -> None:
        self._write = write
        self._buffer = _Buffer()
        req_r, self._req_w = os.pipe2(os.O_CLOEXEC)
        self._resp_r, resp_w = os.pipe2(os.O_CLOEXEC)
        pid = os.fork()
        if pid == 0:  # the child
            try:
                os.close(self._req_w)
                os.close(self._resp_r)
                _serve(req_r, resp_w, self._buffer.fd, write)
            finally:
                os._exit(0)
        os.close(req_r)
        os.close(resp_w)
        self.pid = pid
        self._owner = os.getpid()
        self.in_flight: SaveJob | None = None
        self.alive = True
        self.closed = False
        # At exit, including that of a multiprocessing child, which skips atexit.
        multiprocessing.util.Finalize(self, self.close, exitpriority=10)

    def stage(self, label: int, staging: str, tree: Any, context: dict[str, Any]) -> SaveJob:
        """Copy ``tree``'s tensors into the buffer (the only part the step waits for). Raises
        SaveWriterError when the previous save did not finish in time or the buffer has no room."""
        if self.in_flight is not None:
            raise SaveWriterError("a save is still in flight: wait() first")
        tensors: list[torch.Tensor] = []
        stripped = _strip(tree, tensors)
        try:
            specs, size = self._buffer.copy_in(tensors)
        except (OSError, RuntimeError) as exc:
            raise SaveWriterError(f"cannot stage {sum(t.numel() * t.element_size() for t in tensors)} bytes "
                                  f"for the background save: {exc}") from exc
        return SaveJob(label, staging, specs, size, stripped, context)

    def submit(self, job: SaveJob) -> None:
        try:
            _write_msg(self._req_w, job)
        except (OSError, pickle.PicklingError, TypeError, AttributeError) as exc:
            if isinstance(exc, OSError):
                self._died()
            raise SaveWriterError(f"the background writer cannot take the save: {exc}") from exc
        self.in_flight = job

    def poll(self) -> SaveResult | None:
        """The in-flight save's answer when it came, without waiting."""
        return self.wait(0.0)

    def wait(self, timeout: float) -> SaveResult | None:
        """The in-flight save's answer (None: nothing in flight, or none within ``timeout``; a
        helper that died answers with a failure)."""
        job = self.in_flight
        if job is None:
            return None
        ready, _, _ = select.select([self._resp_r], [], [], timeout)
        if not ready:
            return None
        result = _read_msg(self._resp_r)
        self.in_flight = None
        if result is None:
            self._died()
            return SaveResult(job.label, False, "the background writer process died")
        assert isinstance(result, SaveResult)
        return result

    def _died(self) -> None:
        if self.alive:
            self.alive = False
            try:
                # Its end of the pipes closed: it is exiting (the pipes close only then).
                os.waitpid(self.pid, 0)
            except ChildProcessError:
                pass

    def close(self, timeout: float = 120.0) -> SaveResult | None:
        """Let the in-flight save finish (at most ``timeout``), end the child; its answer. Also
        called at the process's exit (a checkpoint handed over is committed before the rank
        is gone); a second call does nothing."""
        if self.closed or os.getpid() != self._owner:  # a fork of the rank holds no writer
            return None
        self.closed = True
        result = self.wait(timeout) if self.in_flight is not None else None
        try:
            os.close(self._req_w)
        except OSError:
            pass
        if self.alive:
            deadline = time.monotonic() + (5.0 if result is not None or self.in_flight is None else 0.0)
            while True:
                pid, _ = os.waitpid(self.pid, os.WNOHANG)
                if pid or time.monotonic() >= deadline:
                    break
                time.sleep(0.005)
            if not pid:
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)
            self.alive = False
        os.close(self._resp_r)
        self._buffer.close()
        return result
