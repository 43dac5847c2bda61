"""The README's configuration reference is a valid config, and names every section the agent has."""

from __future__ import annotations

import dataclasses
import re
import tomllib
from pathlib import Path

from trainguard.agent.config import AgentConfig, config_from_dict

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_config_block_loads_and_covers_every_section() -> None:
    text = README.read_text()
    assert text.lstrip().startswith("# trainguard")
    assert "make demo" in text.split("\n## ")[0] and "make test" in text.split("\n## ")[0]
    blocks = re.findall(r"```toml\n(.*?)```", text, re.S)
    assert blocks, "no TOML block in the README"
    table = tomllib.loads(blocks[0])
    config_from_dict(table)
    sections = {f.name for f in dataclasses.fields(AgentConfig)}
    assert sections <= set(table), f"README lacks sections {sorted(sections - set(table))}"


def test_readme_own_script_section_names_real_api_and_flags() -> None:
    """Every name the 'Your own training script' section uses exists with that spelling."""
    import trainguard
    from trainguard.cli import build_parser
    from trainguard.run import RunPlan, Step

    text = README.read_text()
    section = text.split("## Your own training script", 1)[1].split("\n## ", 1)[0]
    run = trainguard.init(environ={})
    for name in set(re.findall(r"\brun\.(\w+)", section)):
        assert hasattr(run, name), f"run.{name}"
    for name in set(re.findall(r"\bs\.(\w+)", section)):
        assert hasattr(Step, name), f"s.{name}"
    for name in set(re.findall(r"\bplan\.(\w+)", section)):
        assert hasattr(RunPlan(), name), f"plan.{name}"
    args = build_parser().parse_args(["run", "--nproc", "2", "--nodes", "1", "--job", "j", "--max-restarts", "1",
                                      "--hang-timeout", "5", "--detach", "--no-agent", "--", "python", "x.py"])
    assert args.cmd[-2:] == ["python", "x.py"]
    run_help = build_parser()._subparsers._group_actions[0].choices["run"].format_help()  # type: ignore[union-attr]
    used = set(re.findall(r"(--[a-z][a-z-]+)", section)) - {"--steps"}  # --steps is the example script's own
    assert used and all(flag in run_help for flag in used), sorted(f for f in used if f not in run_help)
