"""Config validation: every bad case is one line naming its key, exit code 2."""

from __future__ import annotations

import subprocess
import sys

import pytest

from trainguard.agent.config import ConfigError, apply_state_dir, config_from_dict, load_config

BAD_CASES = [
    ({"agent": {"intervl_s": 1}}, "agent.intervl_s"),
    ({"agent": {"interval_s": "fast"}}, "agent.interval_s"),
    ({"agent": {"interval_s": 0}}, "agent.interval_s"),
    ({"agent": {"on_stop": "explode"}}, "agent.on_stop"),
    ({"agent": {"node": ""}}, "agent.node"),
    ({"api": {"tcp": "localhost"}}, "api.tcp"),
    ({"api": {"tcp": "127.0.0.1:7000"}}, "api.token_file"),
    ({"metrics": {"addr": "127.0.0.1:99999"}}, "metrics.addr"),
    ({"eventlog": {"max_bytes": 10}}, "eventlog.max_bytes"),
    ({"eventlog": {"keep": True}}, "eventlog.keep"),
    ({"telemetry": {"ring": 2}}, "telemetry.ring"),
    ({"collectors": {"ebpf": "yes"}}, "collectors.ebpf"),
    ({"launcher": {"stop_grace_s": -1}}, "launcher.stop_grace_s"),
    ({"nonsense": {}}, "nonsense"),
    ({"agent": 3}, "agent"),
]


@pytest.mark.parametrize(("table", "key"), BAD_CASES)
def test_bad_values_name_their_key(table: dict, key: str) -> None:
    with pytest.raises(ConfigError) as info:
        config_from_dict(table)
    assert info.value.key == key
    assert str(info.value).startswith(f"{key}: ")


def test_defaults_need_no_file(tmp_path) -> None:
    cfg = load_config(str(tmp_path / "absent.toml"))
    assert cfg.agent.interval_s == 1.0
    assert cfg.metrics.addr.endswith(":9478")
    apply_state_dir(cfg, str(tmp_path))
    assert cfg.agent.run_dir == str(tmp_path / "run")


def test_good_file_is_typed(tmp_path) -> None:
    path = tmp_path / "agent.toml"
    path.write_text('[agent]\ninterval_s = 2\nnode = "n1"\n[api]\ntcp = "127.0.0.1:0"\ntoken_file = "/x"\nallow_plaintext = true\n')
    cfg = load_config(str(path), must_exist=True)
    assert cfg.agent.interval_s == 2.0 and isinstance(cfg.agent.interval_s, float)
    assert cfg.agent.node == "n1"


def test_check_config_cli_exit_codes(tmp_path) -> None:
    good = tmp_path / "good.toml"
    good.write_text("[agent]\ninterval_s = 0.5\n")
    bad = tmp_path / "bad.toml"
    bad.write_text("[agent]\ninterval_s = -3\n")
    broken = tmp_path / "broken.toml"
    broken.write_text("[agent\n")
    run = [sys.executable, "-m", "trainguard", "agent", "--check-config"]
    ok = subprocess.run(run + [str(good)], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    res = subprocess.run(run + [str(bad)], capture_output=True, text=True)
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "agent.interval_s" in lines[0]
    res = subprocess.run(run + [str(broken)], capture_output=True, text=True)
    assert res.returncode == 2 and "not valid TOML" in res.stderr and "Traceback" not in res.stderr
    res = subprocess.run(run + [str(tmp_path / "missing.toml")], capture_output=True, text=True)
    assert res.returncode == 2 and "no such file" in res.stderr
