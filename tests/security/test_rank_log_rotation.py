"""Rank logs stay bounded: a rank that prints far more than ``launcher.log_max_bytes`` leaves at
most ``launcher.log_keep`` rotated files beside its live log, and its newest output is kept."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from trainguard.agent.config import ConfigError, config_from_dict
from trainguard.agent.lifecycle.jobs import JobSpec
from trainguard.agent.lifecycle.launcher import Launcher
from trainguard.agent.lifecycle.ranklogs import RankLogRotator, rotate
from trainguard.agent.lifecycle.ranks import LaunchContext

CHATTY = """\
import sys, time
for i in range(400):
    print(f"line {i:04d} " + "x" * 90, flush=True)
    if i % 20 == 0:
        time.sleep(0.05)
print("the end", flush=True)
"""


@pytest.mark.parametrize("mode", ["cold", "warm"])
def test_a_chatty_rank_leaves_a_bounded_log(tmp_path: Path, mode: str) -> None:
    script = tmp_path / "chatty.py"
    script.write_text(CHATTY)
    launcher = Launcher(mode=mode, log_max_bytes=4096, log_keep=2)  # type: ignore[arg-type]
    launcher.logs.interval_s = 0.02
    ctx = LaunchContext(telemetry_socket="", plan_path="", log_dir=str(tmp_path / "jobs" / "chatty"))
    ranks = launcher.start(JobSpec("chatty", 1, command=[sys.executable, str(script)]), ctx, 1)
    try:
        assert ranks[0].popen.wait(timeout=120) == 0
    finally:
        launcher.stop(ranks, 2.0)
        launcher.close_job("chatty")  # the last check runs here
    logs = sorted(p.name for p in (tmp_path / "jobs" / "chatty").glob("rank0.log*") if p.suffix != ".exit")
    assert set(logs) <= {"rank0.log", "rank0.log.1", "rank0.log.2"} and "rank0.log.1" in logs, logs
    assert launcher.logs.rotations >= 3, launcher.logs.rotations
    kept = sum((tmp_path / "jobs" / "chatty" / name).stat().st_size for name in logs)
    assert kept < 400 * 100, kept  # the rank printed ~40 KB
    newest = "".join((tmp_path / "jobs" / "chatty" / n).read_text() for n in ("rank0.log.1", "rank0.log")
                     if (tmp_path / "jobs" / "chatty" / n).exists())
    assert "the end" in newest


def test_rotate_shifts_and_drops_the_oldest(tmp_path: Path) -> None:
    log = tmp_path / "rank0.log"
    for gen in range(5):
        log.write_text(f"gen {gen}\n")
        rotate(str(log), keep=3)
    assert log.read_text() == ""
    assert [(tmp_path / f"rank0.log.{i}").read_text() for i in (1, 2, 3)] == ["gen 4\n", "gen 3\n", "gen 2\n"]
    assert not (tmp_path / "rank0.log.4").exists()


def test_a_link_planted_for_the_copy_is_replaced_not_followed(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    log = tmp_path / "rank0.log"
    log.write_text("y" * 5000)
    (tmp_path / "rank0.log.1.tmp").symlink_to(victim)
    rotator = RankLogRotator(4096, 2)
    rotator.watch("j", str(log))
    rotator.check()
    assert victim.read_text() == "precious\n" and (tmp_path / "rank0.log.1").read_text() == "y" * 5000


@pytest.mark.parametrize(("table", "key"), [({"log_max_bytes": 100}, "launcher.log_max_bytes"),
                                            ({"log_keep": 0}, "launcher.log_keep")])
def test_bad_log_bounds_name_their_key(table: dict[str, int], key: str) -> None:
    with pytest.raises(ConfigError) as got:
        config_from_dict({"launcher": table})
    assert got.value.key == key
