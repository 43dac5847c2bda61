"""What an agent without root runs without, said once per start.

An agent run by a user (``trainguard run`` hosting one where no node agent runs, or ``trainguard
agent`` started by hand) keeps snapshots, restores, verdicts, plans and events; what needs root
is off. Each such feature becomes one ``feature_off`` event with the reason, so the user and the
event log learn it once instead of from a warning per attempt.
"""

from __future__ import annotations

from collections.abc import Mapping

FEATURE_OFF = "feature_off"


def features_off(*, euid: int, ebpf_wanted: bool, collectors: Mapping[str, tuple[bool, str | None]],
                 cgroups_mode: str, cgroups_reason: str) -> list[tuple[str, str]]:
    """(feature, one-line message) for each feature the agent wanted and runs without."""
    out: list[tuple[str, str]] = []
    up, why = collectors.get("ebpf", (True, None))
    if ebpf_wanted and not up:
        reason = (why or "unavailable").removeprefix("eBPF off: ")
        out.append(("ebpf", f"eBPF off: {reason}; rank exits are seen through waitpid and /proc instead"))
    if cgroups_mode == "auto" and cgroups_reason.startswith("not available"):
        reason = cgroups_reason.removeprefix("not available: ")
        out.append(("cgroups", f"cgroups off: {reason}; no per-job memory or CPU limits or OOM attribution"))
    if euid != 0:
        out.append(("systemd_units", f"systemd units off: the agent runs as uid {euid}, not as the system "
                    "service; the job's ranks are its children"))
        out.append(("other_users", f"other users' processes off: the agent runs as uid {euid}; it tracks and "
                    "signals only this user's ranks (launcher.user needs root)"))
    return out
