"""Run counts and run time of loaded BPF programs, straight from the bpf(2) syscall (no bcc).

With statistics enabled (``BPF_ENABLE_STATS``, held while its fd is open, or the
``kernel.bpf_stats_enabled`` sysctl) the kernel counts, per program, how often it ran and for how
long: the true kernel-side cost of the collector, charged to whatever task was running. Programs of
any process are found by walking program ids and picked by name prefix (the collector's are all
``tg_*``). Used by bench/overhead.py, and by the collector to export its own kernel-side cost.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

_SYS_BPF = 321  # x86_64
_BPF_PROG_GET_NEXT_ID, _BPF_PROG_GET_FD_BY_ID, _BPF_OBJ_GET_INFO_BY_FD, _BPF_ENABLE_STATS = 11, 13, 15, 32
# offsets in struct bpf_prog_info (uapi, append-only): name[16] at 64, run_time_ns at 192, run_cnt at 200
_INFO_SIZE, _NAME_OFF, _RUN_TIME_OFF, _RUN_CNT_OFF = 232, 64, 192, 200

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def _bpf(cmd: int, attr: ctypes.Array[ctypes.c_char]) -> int:
    rc = _libc.syscall(_SYS_BPF, cmd, attr, len(attr))
    if rc < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return int(rc)


@dataclass(frozen=True)
class ProgStats:
    prog_id: int
    name: str
    run_cnt: int
    run_time_ns: int


def enable_stats() -> int:
    """Turn run-time statistics on while the returned fd stays open (close it to turn them off)."""
    attr = ctypes.create_string_buffer(8)
    ctypes.c_uint32.from_buffer(attr, 0).value = 0  # BPF_STATS_RUN_TIME
    return _bpf(_BPF_ENABLE_STATS, attr)


def _info(fd: int) -> ctypes.Array[ctypes.c_char]:
    info = ctypes.create_string_buffer(_INFO_SIZE)
    q = ctypes.create_string_buffer(16)
    ctypes.c_uint32.from_buffer(q, 0).value = fd
    ctypes.c_uint32.from_buffer(q, 4).value = _INFO_SIZE
    ctypes.c_uint64.from_buffer(q, 8).value = ctypes.addressof(info)
    _bpf(_BPF_OBJ_GET_INFO_BY_FD, q)
    return info


def fd_stats(fd: int) -> tuple[int, int]:
    """(run count, run time ns) of the program behind ``fd``; zeros while stats are off."""
    info = _info(fd)
    return (ctypes.c_uint64.from_buffer(info, _RUN_CNT_OFF).value,
            ctypes.c_uint64.from_buffer(info, _RUN_TIME_OFF).value)


def program_stats(prefix: str = "tg_") -> list[ProgStats]:
    """Every loaded program whose name starts with ``prefix`` (names are cut at 15 characters)."""
    out: list[ProgStats] = []
    prog_id = 0
    while True:
        attr = ctypes.create_string_buffer(16)
        ctypes.c_uint32.from_buffer(attr, 0).value = prog_id
        try:
            _bpf(_BPF_PROG_GET_NEXT_ID, attr)
        except OSError:
            return out  # ENOENT: no more programs
        prog_id = ctypes.c_uint32.from_buffer(attr, 4).value
        fd_attr = ctypes.create_string_buffer(16)
        ctypes.c_uint32.from_buffer(fd_attr, 0).value = prog_id
        try:
            fd = _bpf(_BPF_PROG_GET_FD_BY_ID, fd_attr)
        except OSError:
            continue  # unloaded meanwhile
        try:
            info = _info(fd)
        finally:
            os.close(fd)
        name = info.raw[_NAME_OFF:_NAME_OFF + 16].split(b"\0", 1)[0].decode(errors="replace")
        if name.startswith(prefix):
            out.append(ProgStats(prog_id, name, ctypes.c_uint64.from_buffer(info, _RUN_CNT_OFF).value,
                                 ctypes.c_uint64.from_buffer(info, _RUN_TIME_OFF).value))
