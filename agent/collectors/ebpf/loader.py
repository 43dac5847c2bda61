"""The one module that imports bcc: compile a C program, attach tracepoints, read and write maps.

Everything else in the eBPF collector talks to a ``LoadedModule`` through the few typed methods
below, so bcc's API (bytes names, ctypes keys, its one-fd-per-tracepoint bookkeeping) stays here.
"""

from __future__ import annotations

import ctypes
import logging
import os
import tempfile
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


class CompileError(RuntimeError):
    """The program did not compile or load; the message is one line (the first compiler error)."""


class AttachError(RuntimeError):
    """A tracepoint could not be attached."""


def _first_error(diagnostics: str) -> str:
    for line in diagnostics.splitlines():
        if "error:" in line:
            return line.split("error:", 1)[1].strip()
    lines = [ln.strip() for ln in diagnostics.splitlines() if ln.strip()]
    return lines[-1] if lines else "no diagnostics"


class _CaptureFd2:
    """libbcc writes clang diagnostics straight to fd 2; catch them for a one-line reason.

    The lock keeps two compiles from swapping stderr under each other.
    """

    _lock = threading.Lock()

    def __enter__(self) -> _CaptureFd2:
        self._lock.acquire()
        self._tmp = tempfile.TemporaryFile()
        self._saved = os.dup(2)
        os.dup2(self._tmp.fileno(), 2)
        self.text = ""
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            os.dup2(self._saved, 2)
            os.close(self._saved)
            self._tmp.seek(0)
            self.text = self._tmp.read().decode(errors="replace")
            self._tmp.close()
        finally:
            self._lock.release()


def _plain(value: Any) -> Any:
    return value.value if isinstance(value, ctypes._SimpleCData) else value


class LoadedModule:
    """A compiled and loaded BPF object: attach its functions, use its maps, poll its ring buffer."""

    def __init__(self, bpf: Any, lib: Any, tracepoint_type: int) -> None:
        self._bpf = bpf
        self._lib = lib
        self._tp_type = tracepoint_type
        # (tracepoint, function) -> perf event fd; bcc's own table keeps one fd per tracepoint,
        # and two programs here share sched:sched_switch.
        self._fds: dict[tuple[str, str], int] = {}
        self._has_ringbuf = False

    def attach_tracepoint(self, tracepoint: str, fn_name: str) -> None:
        try:
            fn = self._bpf.load_func(fn_name.encode(), self._tp_type)
        except Exception as exc:  # bcc raises bare Exception with the verifier log on stderr
            raise AttachError(f"load {fn_name}: {exc}") from exc
        cat, event = tracepoint.split(":")
        fd = self._lib.bpf_attach_tracepoint(fn.fd, cat.encode(), event.encode())
        if fd < 0:
            raise AttachError(f"attach {fn_name} to {tracepoint}: {os.strerror(-fd) if fd < -1 else 'failed'}")
        self._fds[(tracepoint, fn_name)] = fd

    def prog_fds(self) -> dict[str, int]:
        """Loaded functions (attached ones) -> their program fds."""
        return {name.decode(): fn.fd for name, fn in self._bpf.funcs.items()}

    def detach(self, tracepoint: str, fn_name: str) -> None:
        fd = self._fds.pop((tracepoint, fn_name), None)
        if fd is not None:
            self._lib.bpf_close_perf_event_fd(fd)

    def close(self) -> None:
        for key in list(self._fds):
            self.detach(*key)
        self._bpf.cleanup()

    # --- maps -------------------------------------------------------------------------------
    def _table(self, name: str) -> Any:
        # BPF.__getitem__ caches the table object; get_table() would make a new one each call and
        # drop the ring buffer callback it holds (a segfault at the next poll).
        return self._bpf[name]

    def array_get(self, name: str, index: int) -> Any:
        """One entry of a BPF_ARRAY: an int for scalar values, else the ctypes struct."""
        t = self._table(name)
        return _plain(t[t.Key(index)])

    def percpu_get(self, name: str, index: int) -> list[Any]:
        """One entry of a BPF_PERCPU_ARRAY: one value per possible CPU (ints or ctypes structs)."""
        t = self._table(name)
        return [_plain(v) for v in t[t.Key(index)]]

    def array_zero(self, name: str, index: int) -> None:
        t = self._table(name)
        t[t.Key(index)] = t.Leaf()

    def hash_items(self, name: str) -> list[tuple[Any, Any]]:
        return list(self._table(name).items())

    def hash_set(self, name: str, key: int, value: int) -> None:
        t = self._table(name)
        t[t.Key(key)] = t.Leaf(value)

    def hash_delete(self, name: str, key: int) -> None:
        t = self._table(name)
        try:
            del t[t.Key(key)]
        except KeyError:
            pass

    def hash_delete_where(self, name: str, pred: Callable[[Any, Any], bool]) -> None:
        t = self._table(name)
        for k, v in list(t.items()):
            if pred(k, v):
                try:
                    del t[k]
                except KeyError:
                    pass

    # --- events -----------------------------------------------------------------------------
    def open_ring_buffer(self, name: str, callback: Callable[[bytes], None]) -> None:
        def cb(_ctx: Any, data: Any, size: int) -> int:
            try:
                callback(ctypes.string_at(data, size))
            except Exception:  # a bad handler must not kill the poll thread
                log.exception("eBPF event handler failed")
            return 0

        self._table(name).open_ring_buffer(cb)
        self._has_ringbuf = True

    def ring_buffer_poll(self, timeout_ms: int) -> None:
        if self._has_ringbuf:
            self._bpf.ring_buffer_poll(timeout_ms)


class BccLoader:
    """Compiles programs with bcc; importing bcc is deferred so its absence is a reason, not a crash."""

    def __init__(self) -> None:
        self._bcc: Any = None

    def available(self) -> str | None:
        """None if bcc imports, else why not (one line)."""
        if self._bcc is not None:
            return None
        try:
            import bcc  # noqa: PLC0415 - the one place bcc is imported
        except Exception as exc:  # ImportError, or OSError when libbcc.so is missing
            return f"bcc not importable ({type(exc).__name__}: {exc})"
        self._bcc = bcc
        return None

    def compile(self, text: str, cflags: list[str] | None = None) -> LoadedModule:
        reason = self.available()
        if reason:
            raise CompileError(reason)
        bcc = self._bcc
        with _CaptureFd2() as cap:
            try:
                bpf = bcc.BPF(text=text.encode(), cflags=cflags or [])
            except Exception as exc:
                err: Exception | None = exc
            else:
                err = None
        if cap.text.strip():
            log.debug("bcc diagnostics:\n%s", cap.text)
        if err is not None:
            raise CompileError(_first_error(cap.text) if cap.text.strip() else str(err))
        from bcc.libbcc import lib  # noqa: PLC0415

        return LoadedModule(bpf, lib, bcc.BPF.TRACEPOINT)
