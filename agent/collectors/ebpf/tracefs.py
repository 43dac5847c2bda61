"""Tracepoints as the running kernel describes them (tracefs ``events/<cat>/<event>/format``).

Feature probes read these files instead of guessing from kernel versions: whether a tracepoint
exists, and which fields it has (``sched_process_exit`` gained ``group_dead`` in 6.x,
``block_rq_issue`` lost its request pointer, ``mark_victim`` grew RSS fields). The C struct each
program reads its tracepoint record through is rendered from the same file, so a field's offset is
the running kernel's, not the one in the headers bcc compiles against.
"""

from __future__ import annotations

import ctypes
import os
import re
from dataclasses import dataclass
from pathlib import Path

CANDIDATE_ROOTS = (Path("/sys/kernel/tracing"), Path("/sys/kernel/debug/tracing"))

_FIELD = re.compile(r"field:(?P<decl>[^;]+);\s*offset:(?P<off>\d+);\s*size:(?P<size>\d+);\s*signed:(?P<signed>\d)")
_INT_TYPES = {(1, 0): "u8", (1, 1): "s8", (2, 0): "u16", (2, 1): "s16", (4, 0): "u32", (4, 1): "s32",
              (8, 0): "u64", (8, 1): "s64"}


@dataclass(frozen=True)
class Field:
    name: str
    offset: int
    size: int
    signed: bool
    array_len: int  # 0 for a scalar
    data_loc: bool  # a __data_loc field: a u32 (length << 16 | offset into the record)

    def c_decl(self) -> str:
        if self.data_loc:
            return f"u32 {self.name}"
        if self.array_len:
            elem = self.size // self.array_len
            ctype = "char" if elem == 1 else _INT_TYPES[(elem, 0)]
            return f"{ctype} {self.name}[{self.array_len}]"
        return f"{_INT_TYPES[(self.size, int(self.signed))]} {self.name}"


def parse_format(text: str) -> list[Field]:
    """The non-common fields of a tracepoint ``format`` file, in record order."""
    fields = []
    for m in _FIELD.finditer(text):
        decl = m.group("decl").strip()
        name_part = decl.split()[-1]
        array_len = 0
        am = re.match(r"(\w+)\[(\d*)\]$", name_part)
        name = am.group(1) if am else name_part.lstrip("*")
        if am and am.group(2):
            array_len = int(am.group(2))
        if name.startswith("common_"):
            continue
        fields.append(Field(name=name, offset=int(m.group("off")), size=int(m.group("size")),
                            signed=m.group("signed") == "1", array_len=array_len,
                            data_loc=decl.startswith("__data_loc")))
    return fields


def render_struct(struct_name: str, fields: list[Field]) -> str:
    """A C struct whose members sit at exactly the offsets the format file gives (explicit padding;
    the kernel lays records out naturally aligned, so no packing is needed)."""
    lines = [f"struct {struct_name} {{", "    u64 __common;"]
    pos = 8
    for i, f in enumerate(fields):
        if f.offset > pos:
            lines.append(f"    char __pad{i}[{f.offset - pos}];")
        lines.append(f"    {f.c_decl()};")
        pos = f.offset + f.size
    lines.append("};")
    return "\n".join(lines)


class Tracefs:
    """One tracefs mount; ``root`` is injectable so tests and probes can point elsewhere."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def exists(self, tracepoint: str) -> bool:
        cat, event = tracepoint.split(":")
        return (self.root / "events" / cat / event / "format").is_file()

    def fields(self, tracepoint: str) -> dict[str, Field]:
        cat, event = tracepoint.split(":")
        text = (self.root / "events" / cat / event / "format").read_text()
        return {f.name: f for f in parse_format(text)}


def find_tracefs(roots: tuple[Path, ...] = CANDIDATE_ROOTS) -> Tracefs | None:
    for root in roots:
        if (root / "events").is_dir():
            return Tracefs(root)
    return None


def mount_tracefs(target: Path = CANDIDATE_ROOTS[0]) -> str | None:
    """Mount tracefs at ``target`` (root only); returns None on success, else why it failed.

    Containers and minimal hosts often boot without tracefs mounted; bcc needs it to find a
    tracepoint's id and format. The mount is what ``mount -t tracefs tracefs /sys/kernel/tracing``
    does and is harmless to everything else on the host.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    rc = libc.mount(b"tracefs", os.fsencode(target), b"tracefs", 0, None)
    if rc != 0:
        err = ctypes.get_errno()
        return f"mount tracefs at {target}: {os.strerror(err)}"
    return None
