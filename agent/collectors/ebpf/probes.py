"""Can this process load tracing BPF programs here? One-line reasons when not (pure checks)."""

from __future__ import annotations

from pathlib import Path

_CAP_SYS_ADMIN, _CAP_PERFMON, _CAP_BPF = 21, 38, 39


def privilege_problem(euid: int, proc_status: str) -> str | None:
    """None if this process may load tracing BPF programs: root, or CAP_BPF + CAP_PERFMON
    (or CAP_SYS_ADMIN) in its effective set, as the systemd unit grants."""
    if euid == 0:
        return None
    caps = 0
    for line in proc_status.splitlines():
        if line.startswith("CapEff:"):
            caps = int(line.split()[1], 16)
    if caps >> _CAP_SYS_ADMIN & 1 or (caps >> _CAP_BPF & 1 and caps >> _CAP_PERFMON & 1):
        return None
    return f"needs root or CAP_BPF+CAP_PERFMON (running as uid {euid} without them)"


def headers_problem(modules_dir: Path, kheaders: Path = Path("/sys/kernel/kheaders.tar.xz")) -> str | None:
    """bcc compiles against the kernel build tree (``build``, whose generic half Debian keeps
    in ``source``), or against the kernel's own kheaders archive when it has one."""
    if kheaders.exists():
        return None
    build, source = modules_dir / "build", modules_dir / "source"
    if not (build / "include").is_dir():
        return f"no kernel headers at {build} (install linux-headers and link them there)"
    if not any((d / "include/linux/kconfig.h").is_file() for d in (build, source)):
        return f"kernel headers at {build} are incomplete: link the common half as {source}"
    return None
