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
