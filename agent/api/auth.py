"""Bearer tokens for the control API.

The token file holds one token per line, optionally followed by a role::

    # comment lines and blank lines are ignored
    3f9c0e...            # a bare token is an admin token (the cross-node shared token)
    77ab12...  read      # dashboards: GET routes only
    c0ffee...  admin

The file must not be readable or writable by "other": a token anyone on the node can read is no
gate. Such a file is refused with a message that says how to fix it, rather than silently used.
Tokens are compared with ``hmac.compare_digest`` against every known token (no early exit), so the
time taken does not tell which token, or how much of one, matched.
"""

from __future__ import annotations

import enum
import hmac
import os
import stat
import threading
from pathlib import Path

MIN_TOKEN_CHARS = 16


class Role(enum.IntEnum):
    """Ordered: a role may call every route that needs its level or lower."""

    READ = 1
    ADMIN = 2


class TokenFileError(ValueError):
    """The token file cannot be used; the message names the file and says why."""


def parse_token_file(path: Path, *, enforce_mode: bool = True) -> dict[str, Role]:
    """Read ``path`` into token -> role. Raises TokenFileError with a one-line reason."""
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            raw = f.read(1 << 20)
    except OSError as e:
        raise TokenFileError(f"token file {path}: cannot read: {e.strerror or e}") from e
    if not stat.S_ISREG(st.st_mode):
        raise TokenFileError(f"token file {path}: not a regular file")
    if enforce_mode and st.st_mode & (stat.S_IROTH | stat.S_IWOTH):
        raise TokenFileError(
            f"token file {path}: mode {stat.S_IMODE(st.st_mode):04o} lets every user on this node read "
            f"or change the tokens; refusing it (fix: chmod 600 {path})"
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise TokenFileError(f"token file {path}: not UTF-8 text") from e
    tokens: dict[str, Role] = {}
    for lineno, line in enumerate(text.splitlines(), start=1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) > 2:
            raise TokenFileError(f"token file {path}, line {lineno}: expected 'TOKEN [read|admin]'")
        token = parts[0]
        role_name = parts[1].lower() if len(parts) == 2 else "admin"
        if role_name not in ("read", "admin"):
            raise TokenFileError(
                f"token file {path}, line {lineno}: unknown role {parts[1]!r} (use 'read' or 'admin')"
            )
        if len(token) < MIN_TOKEN_CHARS:
            raise TokenFileError(
                f"token file {path}, line {lineno}: token shorter than {MIN_TOKEN_CHARS} characters "
                f"(generate one with: python3 -c 'import secrets; print(secrets.token_hex(32))')"
            )
        if not token.isascii() or not token.isprintable():
            raise TokenFileError(f"token file {path}, line {lineno}: token must be printable ASCII")
        tokens[token] = Role.ADMIN if role_name == "admin" else Role.READ
    return tokens


def read_client_token(path: Path) -> str:
    """The first token in ``path``, for clients (a CLI, a peer agent) that present one token."""
    tokens = parse_token_file(path, enforce_mode=False)
    if not tokens:
        raise TokenFileError(f"token file {path}: holds no token")
    return next(iter(tokens))


class TokenStore:
    """The server's current tokens; ``reload()`` re-reads the file (SIGHUP), thread-safe.

    With ``path=None`` there are no tokens: every token-gated request is refused, which is what a
    unix-only agent with ``unix_requires_token = false`` wants.
    """

    def __init__(self, path: Path | None) -> None:
        self._path = path
        self._lock = threading.Lock()
        self._tokens: tuple[tuple[bytes, Role], ...] = ()
        if path is not None:
            self._install(parse_token_file(path))

    @property
    def path(self) -> Path | None:
        return self._path

    def __len__(self) -> int:
        return len(self._tokens)

    def reload(self) -> int:
        """Re-read the file; returns the number of tokens now loaded.

        A bad file raises TokenFileError and the previous tokens stay in force: a typo during a
        rotation must not lock every client (and the peer agents) out.
        """
        if self._path is None:
            return 0
        self._install(parse_token_file(self._path))
        return len(self._tokens)

    def _install(self, tokens: dict[str, Role]) -> None:
        encoded = tuple((t.encode("ascii"), r) for t, r in tokens.items())
        with self._lock:
            self._tokens = encoded

    def check(self, presented: str) -> Role | None:
        """The role of ``presented``, or None when it is not a known token."""
        try:
            candidate = presented.encode("ascii")
        except UnicodeEncodeError:
            return None
        with self._lock:
            tokens = self._tokens
        found: Role | None = None
        for token, role in tokens:
            # No break: every comparison runs, whatever matched.
            if hmac.compare_digest(candidate, token):
                found = role
        return found


def bearer_token(header: str | None) -> str | None:
    """The token from an ``Authorization: Bearer <token>`` header value; None when absent."""
    if header is None:
        return None
    scheme, _, value = header.strip().partition(" ")
    if scheme.lower() != "bearer":
        return ""
    return value.strip()
