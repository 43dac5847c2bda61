"""The agent's control API: HTTP/1.1 + JSON on a unix socket (local CLI/TUI) and TCP (peers).

* ``handler``: the ``ApiHandler`` protocol the daemon implements, ``ApiError``, ``Blob``.
* ``routes``: the route table (method, path, role -> handler method).
* ``server``: ``ApiServer`` (listeners, lifecycle, counters); ``request``: one HTTP request
  (auth, limits, dispatch); ``config``: ``ApiConfig``.
* ``auth``: the token file and ``TokenStore``; ``client``: ``ApiClient``.

Import from the submodules: the package imports nothing, so a client (the CLI) loads no server.
"""
