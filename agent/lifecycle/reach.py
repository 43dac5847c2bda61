"""Whether ``launcher.user`` can reach what its ranks run: the program they exec, the script they
read, the directory they start in. Checked when a job is submitted, so a job that cannot start is
one clear error naming the directory in the way, not a crash loop of ``203/EXEC`` or
``Permission denied`` in rank logs.

The check reads mode bits as the kernel would for that uid and its groups. A path component with
an access ACL is given the benefit of the doubt (its mask may grant more than the bits say): the
check refuses only what is certain to fail.
"""

from __future__ import annotations

import grp
import os
import pwd
import shutil
import stat
from dataclasses import dataclass

R, W, X = 4, 2, 1
ACL_XATTR = "system.posix_acl_access"


@dataclass(frozen=True)
class Identity:
    uid: int
    gids: frozenset[int]

    @classmethod
    def of(cls, uid: int, gid: int) -> Identity:
        """``uid`` with its primary group and its supplementary groups (ranks keep none: setpriv
        clears them, systemd's User= keeps the user's own)."""
        try:
            name = pwd.getpwuid(uid).pw_name
            extra = {g.gr_gid for g in grp.getgrall() if name in g.gr_mem}
        except KeyError:
            extra = set()
        return cls(uid, frozenset({gid, *extra}))


def _has_acl(path: str) -> bool:
    try:
        os.getxattr(path, ACL_XATTR)
    except OSError:
        return False
    return True


def _grants(st: os.stat_result, who: Identity, bits: int) -> bool:
    if who.uid == 0:
        return True
    if st.st_uid == who.uid:
        shift = 6
    elif st.st_gid in who.gids:
        shift = 3
    else:
        shift = 0
    return (st.st_mode >> shift) & bits == bits


def _describe(path: str, st: os.stat_result) -> str:
    try:
        owner = pwd.getpwuid(st.st_uid).pw_name
    except KeyError:
        owner = str(st.st_uid)
    try:
        group = grp.getgrgid(st.st_gid).gr_name
    except KeyError:
        group = str(st.st_gid)
    return f"{path} is {stat.S_IMODE(st.st_mode):04o} {owner}:{group}"


def blocker(path: str, who: Identity, bits: int) -> str | None:
    """Why ``who`` cannot use ``path`` with ``bits`` (R, X, R | X) after walking to it, or None.
    Both the path as given and where its links lead are walked: each directory needs search (x)."""
    path = os.path.abspath(path)
    real = os.path.realpath(path)
    for target in dict.fromkeys((path, real)):
        walked = "/"
        for part in target.split("/")[1:-1]:
            walked = os.path.join(walked, part)
            try:
                st = os.stat(walked)
            except OSError as exc:
                return f"{walked}: {exc.strerror}"
            if not _grants(st, who, X) and not _has_acl(walked):
                return _describe(walked, st)
    try:
        st = os.stat(real)
    except OSError as exc:
        return f"{real}: {exc.strerror}"
    if not _grants(st, who, bits) and not _has_acl(real):
        return _describe(real, st)
    return None


def program_blocker(argv0: str, path_env: str | None, who: Identity) -> str | None:
    """Why ``who`` cannot exec ``argv0`` (found on ``path_env`` as exec would), or None."""
    found = argv0 if "/" in argv0 else shutil.which(argv0, path=path_env or os.defpath)
    if found is None:
        return None  # not found at all: the rank's own error says so in its log
    return blocker(found, who, R | X if _is_script(found) else X)


def _is_script(path: str) -> bool:
    """A ``#!`` script is read by its interpreter, so it needs r as well as x."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            return False  # never open a FIFO or device a job names: the read could block the API
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        return os.read(fd, 2) == b"#!"
    except OSError:
        return False
    finally:
        os.close(fd)
