"""Member offsets of kernel structs, read from the running kernel's BTF (/sys/kernel/btf/vmlinux).

bcc compiles against whatever headers are linked as the kernel build tree (here Debian's 6.1 headers
on a 6.18 kernel), so a field read through a header struct would land at the wrong offset. BTF
describes the running kernel itself; programs that must read a task_struct field take the offset
from here and read it with ``bpf_probe_read_kernel`` at ``(char *)task + offset``.

Only what that needs is parsed: the type table, struct/union members (anonymous ones followed),
and names. Pure Python, no bcc.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

VMLINUX_BTF = Path("/sys/kernel/btf/vmlinux")

_MAGIC = 0xEB9F
# Kinds (include/uapi/linux/btf.h) and the size of the data that follows each btf_type record.
_STRUCT, _UNION, _TYPEDEF, _VOLATILE, _CONST, _RESTRICT, _TYPE_TAG = 4, 5, 8, 9, 10, 11, 18


def _trailer(kind: int, vlen: int) -> int:
    if kind in (1, 14, 17):  # INT, VAR, DECL_TAG
        return 4
    if kind == 3:  # ARRAY
        return 12
    if kind in (_STRUCT, _UNION, 15, 19):  # members, DATASEC vars, ENUM64 values
        return 12 * vlen
    if kind in (6, 13):  # ENUM values, FUNC_PROTO params
        return 8 * vlen
    return 0


class BtfError(RuntimeError):
    """BTF missing, malformed, or without the struct/member asked for."""


@dataclass(frozen=True)
class _Type:
    kind: int
    name: str
    size_or_type: int
    members: tuple[tuple[str, int, int], ...]  # (name, type id, bit offset)


class Btf:
    """The type table of one BTF blob."""

    def __init__(self, blob: bytes) -> None:
        if len(blob) < 24:
            raise BtfError("BTF blob too short")
        magic, _version, _flags, hdr_len = struct.unpack_from("<HBBI", blob, 0)
        if magic != _MAGIC:
            raise BtfError(f"bad BTF magic {magic:#x}")
        type_off, type_len, str_off, str_len = struct.unpack_from("<IIII", blob, 8)
        types_start = hdr_len + type_off
        strs = blob[hdr_len + str_off : hdr_len + str_off + str_len]
        self._strs = strs
        self._types: list[_Type | None] = [None]  # type id 0 is void
        self._by_name: dict[tuple[int, str], int] = {}
        pos, end = types_start, types_start + type_len
        unpack = struct.unpack_from
        while pos < end:
            name_off, info, size_or_type = unpack("<III", blob, pos)
            pos += 12
            kind = (info >> 24) & 0x1F
            vlen = info & 0xFFFF
            members: tuple[tuple[str, int, int], ...] = ()
            if kind in (_STRUCT, _UNION):
                kflag = info >> 31
                ms = []
                for i in range(vlen):
                    m_name, m_type, m_off = unpack("<III", blob, pos + 12 * i)
                    ms.append((self._str(m_name), m_type, m_off & 0xFFFFFF if kflag else m_off))
                members = tuple(ms)
            name = self._str(name_off) if kind in (_STRUCT, _UNION) else ""
            self._types.append(_Type(kind, name, size_or_type, members))
            if name:
                self._by_name.setdefault((kind, name), len(self._types) - 1)
            pos += _trailer(kind, vlen)

    def _str(self, off: int) -> str:
        end = self._strs.index(b"\0", off)
        return self._strs[off:end].decode()

    def _resolve(self, type_id: int) -> _Type | None:
        # Follow typedef/const/volatile to the struct or union underneath.
        for _ in range(32):
            t = self._types[type_id]
            if t is None or t.kind not in (_TYPEDEF, _VOLATILE, _CONST, _RESTRICT, _TYPE_TAG):
                return t
            type_id = t.size_or_type
        return None

    def _find(self, t: _Type, member: str) -> int | None:
        for name, type_id, bit_off in t.members:
            if name == member:
                return bit_off
            if not name:  # anonymous struct/union: its members belong to the parent
                inner = self._resolve(type_id)
                if inner is not None and inner.kind in (_STRUCT, _UNION):
                    sub = self._find(inner, member)
                    if sub is not None:
                        return bit_off + sub
        return None

    def member_offset(self, struct_name: str, member: str) -> int:
        """Byte offset of ``member`` in ``struct struct_name``; BtfError when absent or a bitfield."""
        type_id = self._by_name.get((_STRUCT, struct_name))
        if type_id is None:
            raise BtfError(f"struct {struct_name} not in BTF")
        t = self._types[type_id]
        assert t is not None
        bit_off = self._find(t, member)
        if bit_off is None:
            raise BtfError(f"struct {struct_name} has no member {member}")
        if bit_off % 8:
            raise BtfError(f"{struct_name}.{member} is a bitfield")
        return bit_off // 8


def load(path: Path = VMLINUX_BTF) -> Btf:
    try:
        return Btf(path.read_bytes())
    except OSError as exc:
        raise BtfError(f"cannot read {path}: {exc.strerror}") from exc
