"""Where the dashboard's data comes from: a small protocol, and its implementation over the agents'
control API.

The dashboard never talks to an agent itself: it asks a :class:`DataSource` for one
:class:`AgentSnapshot` per agent, from a worker thread, and sends actions through it. Tests drive the
app with a deterministic fake source; users get :class:`ApiDataSource` over one or more
:class:`~agent.api.client.ApiClient`.

Every method may block (it is called from a worker thread, never from the UI loop). Failures of an
action are :class:`~agent.api.client.ApiClientError` (``status`` 0: no answer; 401/403: the token
lacks the right; 501: the agent does not offer it), so the UI can explain them in one line.
"""

from __future__ import annotations

import ssl
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

from trainguard.agent.api.client import ApiClient, ApiClientError

EVENTS_PER_POLL = 500
TIMEOUT_S = 3.0  # per call: a dashboard that says "no answer" soon beats one that waits 10 s


@dataclass
class AgentSnapshot:
    """What one agent said in one poll; ``error`` set (and ``status`` None) when it did not answer."""

    agent: str  # how the user named it: a socket path or host:port
    status: dict[str, Any] | None = None
    events: list[dict[str, Any]] = field(default_factory=list)  # new since the previous poll
    checkpoints: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None

    @property
    def up(self) -> bool:
        return self.error is None and self.status is not None

    @property
    def node(self) -> str:
        if self.status and self.status.get("node"):
            return str(self.status["node"])
        return self.agent


class DataSource(Protocol):
    """The dashboard's only door to the outside world."""

    def agents(self) -> Sequence[str]:
        """The agents' names, in display order."""
        ...

    def poll(self) -> list[AgentSnapshot]:
        """One snapshot per agent; never raises for an unreachable agent (its snapshot says why)."""
        ...

    def checkpoint_now(self, agent: str, job: str) -> dict[str, Any]:
        """Ask the agent that runs ``job`` for a checkpoint now."""
        ...

    def drain(self, agent: str, job: str, *, rank: int | None = None, node: str | None = None) -> dict[str, Any]:
        """Move work off a rank (or every rank of a node) of ``job``."""
        ...


class ApiDataSource:
    """:class:`DataSource` over the control API of one or more agents.

    Keeps an event cursor per agent so each poll fetches only new events; a cursor ahead of the
    agent's log (a fresh state directory behind the same address) starts over from the beginning.
    """

    def __init__(self, clients: Sequence[ApiClient]) -> None:
        if not clients:
            raise ValueError("ApiDataSource needs at least one agent")
        self._clients: dict[str, ApiClient] = {}
        for c in clients:
            name, n = c.where, 1
            while name in self._clients:  # the same address twice (e.g. with two tokens)
                n += 1
                name = f"{c.where} #{n}"
            self._clients[name] = c
        self._cursor = {name: 0 for name in self._clients}
        self._pool: ThreadPoolExecutor | None = None

    def agents(self) -> Sequence[str]:
        return list(self._clients)

    def _client(self, agent: str) -> ApiClient:
        try:
            return self._clients[agent]
        except KeyError:
            raise ApiClientError(0, f"unknown agent {agent!r}") from None

    def _poll_one(self, where: str, client: ApiClient) -> AgentSnapshot:
        try:
            status = client.status()
            batch = client.events(since=self._cursor[where], limit=EVENTS_PER_POLL)
            events = list(batch.get("events", []))
            nxt = int(batch.get("next", self._cursor[where]))
            if not events and nxt < self._cursor[where]:
                self._cursor[where] = 0  # the agent's log restarted: read it again from the start
            else:
                self._cursor[where] = nxt
            try:
                checkpoints = client.checkpoints()
            except ApiClientError as exc:
                if exc.status == 0:
                    raise
                checkpoints = []  # an agent without a checkpoint catalogue still shows everything else
        except ApiClientError as exc:
            return AgentSnapshot(where, error=str(exc))
        return AgentSnapshot(where, status=status, events=events,
                             checkpoints=checkpoints if isinstance(checkpoints, list) else [])

    def poll(self) -> list[AgentSnapshot]:
        # In parallel: one agent that does not answer must not hold up the others' updates.
        if len(self._clients) == 1:
            return [self._poll_one(where, client) for where, client in self._clients.items()]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=min(16, len(self._clients)), thread_name_prefix="tg-poll")
        futures = [self._pool.submit(self._poll_one, where, client) for where, client in self._clients.items()]
        return [f.result() for f in futures]

    def checkpoint_now(self, agent: str, job: str) -> dict[str, Any]:
        return self._client(agent).checkpoint_now(job)

    def drain(self, agent: str, job: str, *, rank: int | None = None, node: str | None = None) -> dict[str, Any]:
        return self._client(agent).drain(job, rank=rank, node=node)


def clients_from_args(state_dir: str | None, agents: str | Sequence[str] | None,
                      token_file: str | None, tls: ssl.SSLContext | None = None) -> list[ApiClient]:
    """Clients for ``trainguard top``: the local agent (``--state-dir``), or each ``--agent HOST:PORT``
    (several as a comma-separated list), all with the same token file and TLS context."""
    from trainguard.agent.paths import AgentPaths

    if not agents:
        return [ApiClient.local(AgentPaths.for_state_dir(state_dir).control_socket, timeout=TIMEOUT_S)]
    names = [agents] if isinstance(agents, str) else list(agents)
    targets = [t.strip() for name in names for t in name.split(",") if t.strip()]
    if not token_file:
        raise ValueError("--agent needs --token-file")
    clients = []
    for target in targets:
        host, _, port = target.rpartition(":")
        if not port.isdigit():
            raise ValueError(f"--agent {target!r}: want HOST:PORT")
        clients.append(ApiClient.remote(host or "127.0.0.1", int(port), token_file, timeout=TIMEOUT_S, tls=tls))
    return clients
