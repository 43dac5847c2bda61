"""Symlink-safe file handling for trees that another identity (a job's ranks, a local user) can
write, for an agent that runs as root.

Every operation starts at a trusted directory (one the agent made and checked, ``ensure_agent_dir``)
and walks the rest of the path one component at a time with ``O_NOFOLLOW``, acting through the
last directory's file descriptor (``dir_fd``): a symlink planted anywhere below the trusted
directory is refused, never followed, so the agent never reads, writes, renames or deletes outside
the tree through it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import struct
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC

JobOwner = Callable[[str], "tuple[int, int] | None"]
"""(uid, gid) that a job's subtrees belong to (its ranks' user), or None: the agent's own."""


class UnsafeTreeError(OSError):
    """A path the agent refuses to use: a symlink, another owner, group/other-writable, or outside
    its trusted tree."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(errno.EPERM, f"unsafe path {path}: {reason}")
        self.path = path
        self.reason = reason


@dataclass(frozen=True)
class DirCheck:
    """What ``ensure_agent_dir`` found and did: ``ok``, ``created``, ``tightened`` (the agent's own,
    group/other write taken away) or ``taken_over`` (the unsafe one was moved to ``moved_to`` and a
    fresh one made)."""

    path: str
    action: str
    reason: str = ""
    moved_to: str = ""


def dir_problem(st: os.stat_result, uids: Iterable[int], *, group_writable_ok: bool = False) -> str | None:
    """Why a directory's ``lstat`` makes it unsafe for the agent, or None."""
    if stat.S_ISLNK(st.st_mode):
        return "it is a symlink"
    if not stat.S_ISDIR(st.st_mode):
        return "it is not a directory"
    if st.st_uid not in set(uids):
        return f"it is owned by uid {st.st_uid}"
    writable = 0o002 if group_writable_ok else 0o022
    if st.st_mode & writable:
        return f"its mode {stat.S_IMODE(st.st_mode):o} lets group/other write it"
    return None


def _check_ancestors(path: str, uid: int) -> None:
    """Every directory above ``path`` belongs to root or the agent and, when others may write it,
    is sticky (``/dev/shm``, ``/tmp``): nobody else can then rename or replace what the agent puts
    there."""
    parent = os.path.dirname(path)
    while True:
        st = os.stat(parent)
        if st.st_uid not in (0, uid):
            raise UnsafeTreeError(parent, f"a parent of {path} is owned by uid {st.st_uid}")
        if st.st_mode & 0o002 and not st.st_mode & stat.S_ISVTX:
            raise UnsafeTreeError(parent, f"a parent of {path} is world-writable without the sticky bit")
        up = os.path.dirname(parent)
        if up == parent:
            return
        parent = up


def ensure_agent_dir(path: str | os.PathLike[str], *, mode: int = 0o755, takeover: bool = True,
                     uid: int | None = None) -> DirCheck:
    """Make sure ``path`` is a directory the agent made: owned by ``uid`` (the agent's), not
    group/other-writable, not a symlink. A missing one is created; an unsafe one is moved aside and
    made anew (``takeover``) or refused (UnsafeTreeError)."""
    target = os.path.abspath(path)
    me = os.geteuid() if uid is None else uid
    os.makedirs(os.path.dirname(target), mode=0o755, exist_ok=True)
    _check_ancestors(target, me)
    reason, moved_to = "", ""
    for _ in range(5):
        try:
            st = os.lstat(target)
        except FileNotFoundError:
            try:
                os.mkdir(target, mode)
            except FileExistsError:
                continue  # someone made it between the lstat and the mkdir: check what it is
            os.chmod(target, mode, follow_symlinks=False)  # the umask may have cut the mode
            st = os.lstat(target)
            if dir_problem(st, (me,)) is None:
                action = "taken_over" if moved_to else "created"
                return DirCheck(target, action, reason, moved_to)
            continue
        problem = dir_problem(st, (me,))
        if problem is None:
            return DirCheck(target, "taken_over" if moved_to else "ok", reason, moved_to)
        if stat.S_ISDIR(st.st_mode) and st.st_uid == me and tighten(target):
            return DirCheck(target, "tightened", problem, moved_to)
        if not takeover:
            raise UnsafeTreeError(target, problem)
        reason = reason or problem
        aside = f"{target}.unsafe-{uuid.uuid4().hex[:12]}"
        try:
            os.rename(target, aside)  # the entry itself: a symlink is moved, never followed
        except OSError as exc:
            raise UnsafeTreeError(target, f"{problem}, and it cannot be moved aside: {exc.strerror}") from exc
        moved_to = aside
    raise UnsafeTreeError(target, f"{reason or 'it keeps changing'}; gave up making it safe")


def tighten(path: str | os.PathLike[str]) -> bool:
    """Take group/other write away from a directory of the agent's own (a mount point made with
    1777, say); through an fd, so a symlink swapped in meanwhile is not followed. True when done."""
    try:
        fd = os.open(path, _DIR_FLAGS)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            return False
        os.fchmod(fd, stat.S_IMODE(st.st_mode) & ~0o022 & ~stat.S_ISVTX)
        return True
    finally:
        os.close(fd)


def relparts(root: str | os.PathLike[str], path: str | os.PathLike[str]) -> list[str]:
    """The components of ``path`` below ``root`` (lexically); UnsafeTreeError if it is not below."""
    r = os.path.abspath(root)
    p = os.path.abspath(path)
    if p == r:
        return []
    if not p.startswith(r.rstrip("/") + "/"):
        raise UnsafeTreeError(str(path), f"not inside {r}")
    parts = p[len(r.rstrip("/")) + 1:].split("/")
    if any(x in ("", ".", "..") for x in parts):
        raise UnsafeTreeError(str(path), "an empty, '.' or '..' part")
    return parts


def open_root(root: str | os.PathLike[str]) -> int:
    """An fd of the trusted directory itself (its last component must not be a symlink)."""
    return os.open(root, _DIR_FLAGS)


_ACL_ACCESS, _ACL_DEFAULT = "system.posix_acl_access", "system.posix_acl_default"
_ACL_UNDEFINED_ID = 0xFFFFFFFF
# Tags of linux/posix_acl_xattr.h: user::, user:<uid>:, group::, mask::, other::.
_ACL_USER_OBJ, _ACL_USER, _ACL_GROUP_OBJ, _ACL_MASK, _ACL_OTHER = 0x01, 0x02, 0x04, 0x10, 0x20


def agent_acl(uid: int, owner: int, group: int, other: int) -> bytes:
    """An ACL in the kernel's xattr form (version 2): the owner, group and others get the given
    bits and ``uid`` (the agent) rwx, within a rwx mask."""
    entries = [(_ACL_USER_OBJ, owner, _ACL_UNDEFINED_ID), (_ACL_USER, 0o7, uid),
               (_ACL_GROUP_OBJ, group, _ACL_UNDEFINED_ID), (_ACL_MASK, 0o7, _ACL_UNDEFINED_ID),
               (_ACL_OTHER, other, _ACL_UNDEFINED_ID)]
    return struct.pack("<I", 2) + b"".join(struct.pack("<HHI", tag, perm, ident) for tag, perm, ident in entries)


def grant_agent_access(fd: int) -> bool:
    """Let the agent keep reading and pruning directory ``fd`` (the agent's, about to be handed to
    a job's user) and what the job's ranks make below it: under its unit the agent has no
    CAP_DAC_READ_SEARCH or CAP_FOWNER, and a rank's snapshot slots are 0640. Made below it is
    the rank's and the agent's alone, whatever the rank's umask (the default ACL's group and
    other entries are empty; a file's own mode still caps the agent, through the mask). False
    where the filesystem has no ACLs (modes alone decide then)."""
    mode = stat.S_IMODE(os.fstat(fd).st_mode)
    me = os.geteuid()
    try:
        os.setxattr(fd, _ACL_ACCESS, agent_acl(me, (mode >> 6) & 0o7, (mode >> 3) & 0o7, mode & 0o7))
        os.setxattr(fd, _ACL_DEFAULT, agent_acl(me, 0o7, 0, 0))
    except OSError as exc:
        if exc.errno in (errno.ENOTSUP, errno.EOPNOTSUPP):
            return False
        raise
    return True


def open_dir_at(fd: int, parts: Iterable[str], *, create: bool = False, mode: int = 0o755,
                owner: tuple[int, int] | None = None) -> int:
    """Walk ``parts`` from directory ``fd`` without following a symlink; returns a new fd (the
    caller closes it; ``fd`` stays open). ``create``: make missing directories (``owner``: chown
    what was made to that (uid, gid))."""
    cur = os.dup(fd)
    try:
        for part in parts:
            made = False
            if create:
                try:
                    os.mkdir(part, mode, dir_fd=cur)
                    made = True
                except FileExistsError:
                    pass
            try:
                nxt = os.open(part, _DIR_FLAGS, dir_fd=cur)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise UnsafeTreeError(part, "a symlink or not a directory") from exc
                raise
            if made and owner is not None:
                try:
                    # Set while the directory is still the agent's (only its owner may), then given away.
                    grant_agent_access(nxt)
                    os.fchown(nxt, owner[0], owner[1])
                except BaseException:
                    os.close(nxt)
                    raise
            os.close(cur)
            cur = nxt
        return cur
    except BaseException:
        os.close(cur)
        raise


@contextlib.contextmanager
def dir_fd(root: str | os.PathLike[str], path: str | os.PathLike[str], *, create: bool = False,
           mode: int = 0o755, owner: tuple[int, int] | None = None) -> Iterator[int]:
    """An fd of directory ``path`` below ``root``, reached without following a symlink."""
    rfd = open_root(root)
    try:
        fd = open_dir_at(rfd, relparts(root, path), create=create, mode=mode, owner=owner)
    finally:
        os.close(rfd)
    try:
        yield fd
    finally:
        os.close(fd)


@contextlib.contextmanager
def parent_fd(root: str | os.PathLike[str], path: str | os.PathLike[str]) -> Iterator[tuple[int, str]]:
    """(fd of the directory holding ``path``, its last name), reached without following symlinks."""
    parts = relparts(root, path)
    if not parts:
        raise UnsafeTreeError(str(path), "is the trusted root itself")
    rfd = open_root(root)
    try:
        fd = open_dir_at(rfd, parts[:-1])
    finally:
        os.close(rfd)
    try:
        yield fd, parts[-1]
    finally:
        os.close(fd)


def rmtree_beneath(root: str | os.PathLike[str], path: str | os.PathLike[str]) -> bool:
    """Remove ``path`` (a tree, a file or a symlink: the link itself) below ``root``; never follows
    a symlink, at any depth. False when nothing was there or something could not be removed."""
    try:
        with parent_fd(root, path) as (fd, name):
            st = os.lstat(name, dir_fd=fd)
            if not stat.S_ISDIR(st.st_mode):
                os.unlink(name, dir_fd=fd)
                return True
            failed: list[BaseException] = []
            shutil.rmtree(name, dir_fd=fd, onerror=lambda *a: failed.append(a[2][1]))
            return not failed
    except OSError:
        return False


def unlink_beneath(root: str | os.PathLike[str], path: str | os.PathLike[str]) -> bool:
    try:
        with parent_fd(root, path) as (fd, name):
            os.unlink(name, dir_fd=fd)
            return True
    except OSError:
        return False


def rename_beneath(root: str | os.PathLike[str], src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
    """``rename(src, dst)``, both below ``root``, each reached without following a symlink."""
    with parent_fd(root, src) as (sfd, sname), parent_fd(root, dst) as (dfd, dname):
        os.rename(sname, dname, src_dir_fd=sfd, dst_dir_fd=dfd)


def open_beneath(root: str | os.PathLike[str], path: str | os.PathLike[str], flags: int, mode: int = 0o640) -> int:
    """``os.open`` of a file below ``root``: no symlink followed, the file's own name included."""
    with parent_fd(root, path) as (fd, name):
        return os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=fd)


def write_atomic_at(fd: int, name: str, data: bytes, *, durable: bool, mode: int = 0o640) -> None:
    """Write ``name`` in directory ``fd`` through a temp file and a rename (fsync'd with the
    directory when ``durable``): a reader sees the old contents or the new, never half."""
    tmp = f".{name}.{uuid.uuid4().hex[:8]}.partial"
    out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=fd)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(out, view):]
        if durable:
            os.fsync(out)
    except BaseException:
        os.close(out)
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=fd)
        raise
    os.close(out)
    os.replace(tmp, name, src_dir_fd=fd, dst_dir_fd=fd)
    if durable:
        os.fsync(fd)


def write_atomic(path: str | os.PathLike[str], data: bytes, *, durable: bool = True, mode: int = 0o640,
                 root: str | os.PathLike[str] | None = None) -> None:
    """Replace file ``path`` atomically, fsync'd with its directory (records the agent keeps).
    ``root``: a trusted directory above it, from which no symlink is followed."""
    p = os.path.abspath(path)
    if root is None:
        fd = os.open(os.path.dirname(p), _DIR_FLAGS)
        try:
            write_atomic_at(fd, os.path.basename(p), data, durable=durable, mode=mode)
        finally:
            os.close(fd)
        return
    with parent_fd(root, p) as (fd, name):
        write_atomic_at(fd, name, data, durable=durable, mode=mode)


def walk_files(root: str | os.PathLike[str], path: str | os.PathLike[str] | None = None, *,
               uids: Iterable[int] | None = None) -> list[tuple[str, os.stat_result]]:
    """Regular files under ``path`` (default: ``root``) as (relative POSIX path, lstat), sorted;
    walked through directory fds. Raises UnsafeTreeError on a symlink, a special file, or (with
    ``uids``) an entry owned by another uid or writable by others."""
    allowed = set(uids) if uids is not None else None
    out: list[tuple[str, os.stat_result]] = []

    def check(rel: str, st: os.stat_result) -> None:
        if allowed is not None and st.st_uid not in allowed:
            raise UnsafeTreeError(rel or ".", f"owned by uid {st.st_uid}")
        if allowed is not None and st.st_mode & 0o002:
            raise UnsafeTreeError(rel or ".", f"mode {stat.S_IMODE(st.st_mode):o} lets others write it")

    def walk(fd: int, prefix: str) -> None:
        for name in sorted(os.listdir(fd)):
            rel = f"{prefix}{name}"
            st = os.lstat(name, dir_fd=fd)
            check(rel, st)
            if stat.S_ISDIR(st.st_mode):
                sub = os.open(name, _DIR_FLAGS, dir_fd=fd)
                try:
                    walk(sub, rel + "/")
                finally:
                    os.close(sub)
            elif stat.S_ISREG(st.st_mode):
                out.append((rel, st))
            else:
                raise UnsafeTreeError(rel, "a symlink or special file")

    with dir_fd(root, root if path is None else path) as top:
        check("", os.fstat(top))
        walk(top, "")
    return out


def chown_tree(root: str | os.PathLike[str], path: str | os.PathLike[str], uid: int, gid: int) -> None:
    """Give a subtree below ``root`` to (uid, gid) (a job's own tree), never through a symlink."""
    with dir_fd(root, path) as top:
        os.chown(top, uid, gid)

        def walk(fd: int) -> None:
            for name in os.listdir(fd):
                st = os.lstat(name, dir_fd=fd)
                os.chown(name, uid, gid, dir_fd=fd, follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode):
                    sub = os.open(name, _DIR_FLAGS, dir_fd=fd)
                    try:
                        walk(sub)
                    finally:
                        os.close(sub)

        walk(top)


def copy_tree_beneath(src_root: str | os.PathLike[str], src: str | os.PathLike[str],
                      dst_root: str | os.PathLike[str], dst: str | os.PathLike[str], *,
                      uids: Iterable[int] | None = None) -> int:
    """Copy the regular files under ``src`` (below trusted ``src_root``) into a new tree ``dst``
    (below trusted ``dst_root``); no symlink followed on either side, and a source holding a link,
    a special file or (with ``uids``) another owner's entry is refused before anything is copied.
    Returns the bytes copied."""
    files = walk_files(src_root, src, uids=uids)
    copied = 0
    with dir_fd(src_root, src) as sfd, dir_fd(dst_root, dst, create=True) as dfd:
        for rel, _ in files:
            parts = rel.split("/")
            sub_src = open_dir_at(sfd, parts[:-1])
            sub_dst = open_dir_at(dfd, parts[:-1], create=True)
            try:
                fin = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=sub_src)
                try:
                    fout = os.open(parts[-1], os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                                   0o640, dir_fd=sub_dst)
                    try:
                        while chunk := os.read(fin, 1 << 20):
                            view = memoryview(chunk)
                            while view:
                                view = view[os.write(fout, view):]
                            copied += len(chunk)
                    finally:
                        os.close(fout)
                finally:
                    os.close(fin)
            finally:
                os.close(sub_src)
                os.close(sub_dst)
    return copied
