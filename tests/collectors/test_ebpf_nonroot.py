"""Without privileges the eBPF collector says why in one line and raises CollectorUnavailable
(the agent then exports trainguard_collector_up{collector="ebpf"} 0 and runs on): no traceback."""

from __future__ import annotations

import os

import pytest

from trainguard.agent.collectors.base import CollectorUnavailable
from trainguard.agent.collectors.ebpf import EbpfCollector

NOBODY = 65534


def _start_as_nobody() -> tuple[int, str, str]:
    """Fork (the venv's interpreter may sit where uid 65534 cannot exec it), drop to nobody in the
    child, run start(); returns (exit code, what it wrote to stdout, what it wrote to stderr)."""
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never returns into pytest
        code = 3
        try:
            os.dup2(err_w, 2)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            c = EbpfCollector(lambda k, f: None)
            try:
                c.start()
            except CollectorUnavailable as exc:
                os.write(out_w, f"DOWN {exc}\n{c.down_reason}".encode())
                code = 0
            else:
                os.write(out_w, b"UP")
                c.stop()
                code = 1
        except BaseException as exc:  # noqa: BLE001 - report anything else to the parent as a failure
            os.write(err_w, f"Traceback-like failure: {exc!r}".encode())
            code = 2
        finally:
            os._exit(code)
    os.close(out_w)
    os.close(err_w)
    out = b""
    while chunk := os.read(out_r, 4096):
        out += chunk
    err = b""
    while chunk := os.read(err_r, 4096):
        err += chunk
    _, status = os.waitpid(pid, 0)
    os.close(out_r)
    os.close(err_r)
    return os.waitstatus_to_exitcode(status), out.decode(), err.decode()


def test_start_without_privileges_is_a_one_line_reason() -> None:
    if os.geteuid() != 0:
        c = EbpfCollector(lambda k, f: None)
        with pytest.raises(CollectorUnavailable, match="root") as info:
            c.start()
        assert "\n" not in str(info.value)
        return
    code, out, err = _start_as_nobody()
    assert code == 0, (code, out, err)
    first, second = out.split("\n", 1)
    assert first.startswith("DOWN eBPF off: needs root or CAP_BPF+CAP_PERFMON")
    assert "65534" in first
    assert second == first[len("DOWN "):]  # down_reason kept for the agent's status
    assert "Traceback" not in err
