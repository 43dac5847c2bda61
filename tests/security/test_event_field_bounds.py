"""User-supplied text in events is cut to a bound, so requests from outside cannot grow the audit
trail line by line until it rotates the record of what happened away."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

from tests.conftest import in_process_agent_config
from trainguard.agent.daemon import Agent
from trainguard.agent.eventlog import LOG_NAME, MAX_FIELD_CHARS, EventLog


def test_emit_cuts_long_strings_but_keeps_the_agents_own_stacks(tmp_path: Path) -> None:
    log = EventLog(str(tmp_path), "n1", fsync=False)
    stack = "frame\n" * 1000  # 6,000 chars of the agent's own py-spy output
    log.emit("api_auth_failed", "x" * 100_000, remote="unix", path="/" + "a" * 65_000,
             nested={"k" * 2000: ["v" * 2000] * 1000}, stacks={"0": stack})
    log.close()
    lines = (tmp_path / LOG_NAME).read_bytes().splitlines()
    assert len(lines) == 1
    assert len(lines[0]) < 200_000  # 65 KB path + 2 MB nested list would be ~2.2 MB uncut
    body = json.loads(lines[0])
    path = body["fields"]["path"]
    assert path.startswith("/aaa") and len(path) < MAX_FIELD_CHARS + 40 and "more chars cut" in path
    (key, items), = body["fields"]["nested"].items()
    assert len(key) < MAX_FIELD_CHARS + 40 and len(items) == 257 and len(items[0]) < MAX_FIELD_CHARS + 40
    assert body["fields"]["stacks"]["0"] == stack
    assert len(body["message"]) < 2100


def test_auth_failures_with_huge_paths_do_not_rotate_the_audit_trail(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("s3cret-admin-token admin\n")
    os.chmod(tokens, 0o600)
    cfg = in_process_agent_config(tmp_path / "agent")
    cfg.api.token_file = str(tokens)
    cfg.api.unix_requires_token = True
    cfg.eventlog.max_bytes = 256 * 1024
    agent = Agent(cfg)
    agent.start()
    try:
        first_seq = agent.events.last_seq
        for _ in range(20):  # 20 x 60 KB paths: 1.2 MB uncut, over four rotations of the live file
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(10)
                s.connect(agent.paths.control_socket)
                s.sendall(f"GET /{'p' * 60_000} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer wrong\r\n\r\n".encode())
                assert s.recv(64).startswith(b"HTTP/1.")  # refused, not dropped on the floor
        failures = [e for e in agent.events.since(first_seq, 10_000) if e["kind"] == "api_auth_failed"]
        assert failures
        assert all(len(e["fields"]["path"]) < MAX_FIELD_CHARS + 40 for e in failures)
        # Nothing rotated: the agent_started event is still in the live file.
        assert not os.path.exists(os.path.join(agent.paths.events_dir, f"{LOG_NAME}.1"))
        live = Path(agent.paths.events_dir, LOG_NAME).read_text()
        assert '"kind":"agent_started"' in live
    finally:
        agent.shutdown()
