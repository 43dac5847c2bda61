"""The agent's control API: HTTP/1.1 + JSON on a unix socket (local CLI/TUI) and TCP (peers).

* ``handler``: the ``ApiHandler`` protocol the daemon implements, ``ApiError``, ``Blob``.
* ``routes``: the route table (method, path, role -> handler method).
* ``server``: ``ApiServer`` (listeners, lifecycle, counters); ``request``: one HTTP request
  (auth, limits, dispatch); ``config``: ``ApiConfig``.
* ``auth``: the token file and ``TokenStore``; ``client``: ``ApiClient``.
"""

from trainguard.agent.api.auth import Role, TokenFileError, TokenStore
from trainguard.agent.api.client import ApiClient, ApiClientError
from trainguard.agent.api.config import ApiConfig
from trainguard.agent.api.handler import ApiError, ApiHandler, Blob, BlobReader
from trainguard.agent.api.server import ApiServer, ApiServerError, ApiStats

__all__ = [
    "ApiClient",
    "ApiClientError",
    "ApiConfig",
    "ApiError",
    "ApiHandler",
    "ApiServer",
    "ApiServerError",
    "ApiStats",
    "Blob",
    "BlobReader",
    "Role",
    "TokenFileError",
    "TokenStore",
]
