"""The generated configuration reference: every key of every section is explained, and
docs/configuration.md is what the code generates now."""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path
from typing import Any

import pytest

from trainguard.agent.config import AgentConfig, config_from_dict
from trainguard.agent.config_reference import (
    REGENERATE,
    field_docs,
    keys,
    render_markdown,
    sections,
    toml_value,
)

REPO = Path(__file__).resolve().parents[2]


@dataclasses.dataclass
class _Section:
    documented: int = 1
    """Explained."""
    bare: int = 2


@dataclasses.dataclass
class _Config:
    section: _Section = dataclasses.field(default_factory=_Section)


def test_configuration_md_is_up_to_date() -> None:
    current = (REPO / "docs" / "configuration.md").read_text()
    assert current == render_markdown(), f"docs/configuration.md is stale: regenerate it with `{REGENERATE}`"


def test_every_section_and_key_is_in_the_reference() -> None:
    text = render_markdown()
    named = {name for name, _ in sections()}
    assert {f.name for f in dataclasses.fields(AgentConfig)} <= named
    listed = {(k.section, k.name) for k in keys()}
    for section, cls in sections():
        assert f"\n## [{section}]\n" in text
        for f in dataclasses.fields(cls):
            if f"{section}.{f.name}" not in named:
                assert (section, f.name) in listed, f"[{section}] {f.name} missing from the reference"
                assert f"| `{f.name}` |" in text


def test_the_listed_defaults_load_as_the_default_config() -> None:
    """The defaults the reference prints, written back as TOML, load and give the configuration
    that no file at all gives."""
    table: dict[str, Any] = {}
    for key in keys():
        if key.default.startswith("`"):
            node = table
            for part in key.section.split("."):
                node = node.setdefault(part, {})
            node[key.name] = tomllib.loads(f"v = {key.default.strip('`')}")["v"]
    loaded = config_from_dict(table)
    default = AgentConfig()
    loaded.agent.node = default.agent.node  # the one default computed on the host
    assert loaded == default


def test_a_field_without_a_docstring_is_refused() -> None:
    assert field_docs(_Section) == {"documented": "Explained."}
    with pytest.raises(ValueError, match="bare.*no docstring"):
        list(keys(_Config))
    assert toml_value([]) == "[]" and toml_value(True) == "true" and toml_value('a"b') == '"a\\"b"'
