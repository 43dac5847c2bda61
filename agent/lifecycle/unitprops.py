"""Which systemd properties a job spec may set on its ranks' units: only ones that tighten.

A job's ``unit_properties`` reach ``systemd-run -p`` with PID 1 making the unit, so a property
like ``User=root`` or ``AmbientCapabilities=CAP_SYS_ADMIN`` would let whoever may submit a job
choose its ranks' privileges. The allow-list below names resource limits and sandboxing settings;
a sandboxing setting is accepted only with a value that turns it on, never one that resets it.
"""

from __future__ import annotations

import re

_NAME = re.compile(r"[A-Z][A-Za-z0-9]*\Z")

# Resource limits and scheduling: they bound the job, they grant nothing.
LIMITS = frozenset({
    "CPUQuota", "CPUQuotaPeriodSec", "CPUWeight", "StartupCPUWeight", "CPUAffinity", "AllowedCPUs",
    "AllowedMemoryNodes", "NUMAPolicy", "NUMAMask", "MemoryMax", "MemoryHigh", "MemoryLow", "MemoryMin",
    "MemorySwapMax", "TasksMax", "IOWeight", "StartupIOWeight", "IOReadBandwidthMax", "IOWriteBandwidthMax",
    "IOReadIOPSMax", "IOWriteIOPSMax", "Nice", "CPUSchedulingPolicy", "IOSchedulingClass",
    "IOSchedulingPriority", "LimitNOFILE", "LimitMEMLOCK", "LimitCORE", "LimitSTACK", "LimitNPROC",
    "RuntimeMaxSec", "TimeoutStopSec", "UMask",
})
# Sandboxing whose every non-empty value other than "no" restricts the unit further.
TIGHTENING_PREFIXES = ("Protect", "Private", "Restrict")
TIGHTENING = frozenset({
    "NoNewPrivileges", "LockPersonality", "MemoryDenyWriteExecute", "SystemCallFilter",
    "SystemCallArchitectures", "SystemCallErrorNumber", "ReadOnlyPaths", "InaccessiblePaths",
    "ReadWritePaths", "IPAddressDeny", "KeyringMode", "RemoveIPC",
})
# Named so that the refusal says why; anything else not on the lists is refused too.
PRIVILEGE = frozenset({
    "User", "Group", "DynamicUser", "SupplementaryGroups", "AmbientCapabilities", "CapabilityBoundingSet",
    "SecureBits", "Delegate", "PAMName", "RootDirectory", "RootImage", "BindPaths", "BindReadOnlyPaths",
    "IPAddressAllow", "OOMScoreAdjust", "Environment", "EnvironmentFile", "PassEnvironment",
})
_OFF = frozenset({"no", "false", "0", "off"})


def check_unit_property(prop: str) -> str | None:
    """Why ``prop`` ("Name=value") may not be set by a job, or None when it may."""
    name, sep, value = prop.partition("=")
    name = name.strip()
    if not sep or not _NAME.match(name):
        return f"{prop!r} is not a systemd property like \"MemoryMax=8G\""
    if "\n" in value or "\x00" in value:
        return f"{name}: a value must be one line"
    if not value.strip():
        return f"{name}: an empty value resets the setting; give a value"
    if name in PRIVILEGE or name.startswith(("Exec", "Device")):
        return f"{name} is refused: a job may not choose its ranks' user, privileges, devices or commands"
    if name in LIMITS:
        return None
    if name in TIGHTENING or name.startswith(TIGHTENING_PREFIXES):
        if value.strip().lower() in _OFF:
            return f"{name}={value} is refused: a job may only tighten its units' sandbox"
        return None
    return f"{name} is not on the allow-list of unit properties (resource limits and Protect*/Private*/Restrict* settings)"
