"""What a rank gets of the agent: an allow-listed environment and never the agent's privileges.

The agent runs as root with capabilities; a rank runs a user's code. A rank therefore starts from
the few variables of the agent's environment that training reads (``PATH``, locale, ``CUDA_*``,
``NCCL_*`` ...), not all of it (the agent's own credentials stay the agent's), and leaves root
through ``setpriv`` (to ``launcher.user``, or root with every capability cleared) only after the
launcher has put it in its job's cgroup, which only root may do.

Whatever runs as root on the way (the cgroup join's shell, ``setpriv``) must not be steered by a
job's environment: the dynamic loader obeys ``LD_PRELOAD`` and its kin in any process that is not
set-uid, so a job asking for ``LD_PRELOAD=/tmp/x.so`` would run its code as root there. Those
variables travel under other names and are put back by a shell that already runs as the rank
(``RESTORE_SCRIPT``).
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass

RANK_ENV_NAMES = frozenset({
    "PATH", "LANG", "LANGUAGE", "TZ", "HOME", "USER", "LOGNAME", "SHELL", "TERM", "PYTHONPATH", "TMPDIR",
    "VIRTUAL_ENV", "CONDA_PREFIX", "LD_LIBRARY_PATH", "HF_HOME", "XDG_CACHE_HOME", "PYTHONUNBUFFERED",
})
RANK_ENV_PREFIXES = ("LC_", "CUDA_", "NCCL_", "GLOO_", "OMP_", "MKL_", "KMP_", "OPENBLAS_", "NVIDIA_", "TORCH_",
                     "PYTORCH_", "TORCHELASTIC_", "TRAINGUARD_", "PET_")

# Variables the dynamic loader, libc or /bin/sh act on in any process (glibc's list of "unsecure"
# variables, which it drops only for set-uid programs, the shell's start-up hooks, and bash's
# exported functions, which override builtins where /bin/sh is bash).
UNSECURE_NAMES = frozenset({
    "GCONV_PATH", "GETCONF_DIR", "HOSTALIASES", "LOCALDOMAIN", "LOCPATH", "NIS_PATH", "NLSPATH",
    "RESOLV_HOST_CONF", "RES_OPTIONS", "TZDIR", "ENV", "BASH_ENV", "SHELLOPTS", "PS4", "IFS", "CDPATH",
})
UNSECURE_PREFIXES = ("LD_", "MALLOC_", "GLIBC_", "BASH_FUNC_")
DEFERRED = "TRAINGUARD_DEFERRED"

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")

# Runs as the rank, after the privilege drop: the deferred variables get their own names back.
RESTORE_SCRIPT = (f'for n in ${DEFERRED}; do eval "export $n=\\"\\${DEFERRED}_$n\\""; '
                  f'unset "{DEFERRED}_$n"; done; unset {DEFERRED}; exec "$@"')


class RankUserError(ValueError):
    """``launcher.user`` names no user of this host."""


@dataclass(frozen=True)
class RankUser:
    name: str
    uid: int
    gid: int
    home: str

    @classmethod
    def lookup(cls, name: str) -> RankUser:
        try:
            entry = pwd.getpwnam(name)
        except KeyError:
            raise RankUserError(f"launcher.user: no user {name!r} on this host") from None
        return cls(entry.pw_name, entry.pw_uid, entry.pw_gid, entry.pw_dir)


def unsecure(name: str) -> bool:
    return name in UNSECURE_NAMES or name.startswith(UNSECURE_PREFIXES)


def agent_env_for_ranks(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The part of the agent's environment a rank starts from."""
    env = os.environ if environ is None else environ
    return {k: v for k, v in env.items() if k in RANK_ENV_NAMES or k.startswith(RANK_ENV_PREFIXES)}


def user_env(user: RankUser) -> dict[str, str]:
    """What login would set for the rank's user (the agent's own HOME and USER are root's)."""
    return {"HOME": user.home, "USER": user.name, "LOGNAME": user.name}


def can_drop() -> bool:
    """The agent is root and can leave it through ``setpriv`` (util-linux)."""
    return os.geteuid() == 0 and shutil.which("setpriv") is not None


def drop_argv(user: RankUser | None, *, keep_setuid: bool = False) -> list[str]:
    """``setpriv`` argv prefix: to ``user`` with no supplementary groups, or (None) root without
    capabilities; ``keep_setuid`` keeps only CAP_SETUID/CAP_SETGID (the warm launcher, whose
    forked ranks drop to the user themselves). Empty when the agent is not root."""
    if not can_drop():
        return []
    argv = ["setpriv"]
    if user is not None:
        argv += [f"--reuid={user.uid}", f"--regid={user.gid}", "--clear-groups"]
    argv += [f"--bounding-set={'-all,+setuid,+setgid' if keep_setuid else '-all'}", "--inh-caps=-all",
             "--ambient-caps=-all", "--no-new-privs", "--"]
    return argv


def defer_unsecure(env: Mapping[str, str]) -> tuple[dict[str, str], bool]:
    """``env`` with the unsecure variables renamed for ``RESTORE_SCRIPT``; True when any was.
    A name that is not a plain variable name is dropped (the shell could not restore it)."""
    out: dict[str, str] = {}
    deferred: list[str] = []
    for key, value in env.items():
        if not unsecure(key):
            out[key] = value
        elif _NAME.match(key):
            out[f"{DEFERRED}_{key}"] = value
            deferred.append(key)
    if deferred:
        out[DEFERRED] = " ".join(deferred)
    return out, bool(deferred)
