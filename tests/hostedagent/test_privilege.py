"""What an agent without root says it runs without: one line per feature it wanted, none for one
it was told not to use or runs with; and which hosted agents' state dirs a new one prunes."""

from __future__ import annotations

import os
from pathlib import Path

from trainguard.agent.privilege import features_off
from trainguard.launch.hosted_agent import prune_old

DENIED = "eBPF off: needs root or CAP_BPF+CAP_PERFMON (running as uid 1000 without them)"


def test_a_user_agent_names_each_feature_once() -> None:
    got = features_off(euid=1000, ebpf_wanted=True, collectors={"ebpf": (False, DENIED)}, cgroups_mode="auto",
                       cgroups_reason="not available: cannot make the trainguard cgroups: Permission denied")
    assert [f for f, _ in got] == ["ebpf", "cgroups", "systemd_units", "other_users"]
    assert got[0][1].startswith("eBPF off: needs root or CAP_BPF+CAP_PERFMON") and got[0][1].count("eBPF off") == 1
    assert got[1][1].startswith("cgroups off: cannot make the trainguard cgroups: Permission denied")
    assert all("\n" not in message for _, message in got)


def test_root_with_everything_up_or_switched_off_says_nothing() -> None:
    assert features_off(euid=0, ebpf_wanted=True, collectors={"ebpf": (True, None)}, cgroups_mode="auto",
                        cgroups_reason="cgroup v2") == []
    assert features_off(euid=0, ebpf_wanted=False, collectors={"ebpf": (False, "disabled in config")},
                        cgroups_mode="off", cgroups_reason="off in config (launcher.cgroups)") == []


def test_only_the_newest_finished_state_dirs_are_kept(tmp_path: Path) -> None:
    """Each command's state dir stays for its event log; older ones go, never a running agent's."""
    for i in range(5):
        d = tmp_path / f"job.{i}"
        (d / "run").mkdir(parents=True)
        os.utime(d, (1000 + i, 1000 + i))
    (tmp_path / "job.0" / "run" / "agent.pid").write_text("1\n")  # its agent runs: kept
    (tmp_path / "link").symlink_to(tmp_path / "job.4")
    removed = prune_old(str(tmp_path), keep=2)
    assert sorted(os.path.basename(p) for p in removed) == ["job.1", "job.2"]
    assert sorted(os.listdir(tmp_path)) == ["job.0", "job.3", "job.4", "link"]
