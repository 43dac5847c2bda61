"""The cluster key: an HMAC-SHA256 key that only the cluster's agents hold (``cluster.key_file``).

What agents write for each other through places others can reach (job records in etcd, peer
checkpoint copies held by another node) carries an HMAC by this key, and an agent acts only on
what verifies: an etcd writer or a holder without the key can neither make agents run a command
nor slip altered checkpoint data into a restore. Every signature names its domain (``job-record``,
``manifest``) so a signature of one kind can never pass for another.

The key file must be a regular file owned by the agent's user (root in production) with no group
or other permissions (0600 or 0400), holding at least 32 characters (``openssl rand -hex 32``).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import stat
from dataclasses import replace

from trainguard.agent.checkpoint.errors import CheckpointCorrupt
from trainguard.agent.checkpoint.manifest import Manifest

MIN_KEY_CHARS = 32
MAX_KEY_BYTES = 4096
SIG_PREFIX = "hmac-sha256:"
MANIFEST_DOMAIN = "manifest"


class KeyFileError(ValueError):
    """The key file cannot be used; the message names ``cluster.key_file`` and says why."""


def load_key(path: str, *, key: str = "cluster.key_file") -> bytes:
    """The key in ``path``; KeyFileError naming ``key`` when it is missing, too open or too short."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise KeyFileError(f"{key}: cannot open {path!r}: {exc.strerror or exc} (a symlink is refused too)") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise KeyFileError(f"{key}: {path!r} is not a regular file")
        if st.st_mode & 0o077:
            raise KeyFileError(f"{key}: {path!r} has mode {stat.S_IMODE(st.st_mode):04o}: group or others may "
                               f"read or change the cluster key; refusing it (fix: chmod 600 {path})")
        if st.st_uid != os.geteuid():
            raise KeyFileError(f"{key}: {path!r} is owned by uid {st.st_uid}, not by the agent's user "
                               f"(uid {os.geteuid()}); refusing it (fix: chown {os.geteuid()} {path})")
        raw = os.read(fd, MAX_KEY_BYTES + 1)
    finally:
        os.close(fd)
    if len(raw) > MAX_KEY_BYTES:
        raise KeyFileError(f"{key}: {path!r} is longer than {MAX_KEY_BYTES} bytes; expected one key")
    data = raw.strip()
    if len(data) < MIN_KEY_CHARS:
        raise KeyFileError(f"{key}: {path!r} holds fewer than {MIN_KEY_CHARS} characters "
                           "(make one with: openssl rand -hex 32 > FILE; chmod 600 FILE)")
    return data


def sign(key: bytes, domain: str, payload: bytes) -> str:
    """``hmac-sha256:<hex>`` over ``domain`` and ``payload``."""
    mac = hmac.new(key, domain.encode() + b"\0" + payload, hashlib.sha256)
    return SIG_PREFIX + mac.hexdigest()


def verify(key: bytes, domain: str, payload: bytes, signature: object) -> bool:
    """Whether ``signature`` is ``sign(key, domain, payload)`` (compared in constant time)."""
    if not isinstance(signature, str) or not signature.startswith(SIG_PREFIX) or len(signature) > 128:
        return False
    return hmac.compare_digest(sign(key, domain, payload).encode(), signature.encode())


def write_key(path: str) -> str:
    """Create a new key file at ``path`` (0600, fails if it exists); returns ``path``. Every node of a
    cluster needs a copy of the same file."""
    import secrets

    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, (secrets.token_hex(32) + "\n").encode())
    finally:
        os.close(fd)
    return path


def _manifest_payload(origin: str, manifest: Manifest) -> bytes:
    # The origin is bound in: a copy signed as one node's cannot be presented as another's.
    return origin.encode() + b"\n" + replace(manifest, signature="").to_json()


def sign_manifest(key: bytes, origin: str, manifest: Manifest) -> Manifest:
    """``manifest`` with its signature as ``origin``'s (it covers every file's path, size, checksum)."""
    return replace(manifest, signature=sign(key, MANIFEST_DOMAIN, _manifest_payload(origin, manifest)))


def check_manifest(key: bytes, origin: str, manifest: Manifest, where: str = "") -> None:
    """Raise CheckpointCorrupt unless ``manifest`` carries ``origin``'s valid signature."""
    if not manifest.signature:
        raise CheckpointCorrupt(f"{where}manifest of {manifest.job} step {manifest.step} is not signed by {origin}")
    if not verify(key, MANIFEST_DOMAIN, _manifest_payload(origin, manifest), manifest.signature):
        raise CheckpointCorrupt(f"{where}manifest of {manifest.job} step {manifest.step} has a bad signature "
                                f"(not written by {origin} with this cluster's key, or altered since)")
