"""The configuration reference (docs/configuration.md) generated from the config dataclasses.

Each section of :class:`~agent.config.AgentConfig` is a dataclass whose fields carry a docstring
right below them; this module reads those docstrings from the source (Python keeps none at run
time) with the fields' types and defaults, so the reference cannot drift from what the agent
accepts. A field without a docstring is refused: every key a user can set is explained.

Regenerate the reference with ``python -m trainguard.agent.config_reference > docs/configuration.md``.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import sys
import textwrap
import types
import typing
from collections.abc import Iterator, Sequence
from typing import Any, Literal

from trainguard.agent.config import AgentConfig

REGENERATE = "python -m trainguard.agent.config_reference > docs/configuration.md"

_DYNAMIC_DEFAULTS = {("agent", "node"): "the host's name"}
"""Defaults computed at load time, described instead of printed (the generator's host is not yours).
A default of None prints as "unset": TOML cannot write it, and the key's docstring says what unset means."""


@dataclasses.dataclass(frozen=True)
class Key:
    section: str
    name: str
    type: str
    default: str
    doc: str


def field_docs(cls: type) -> dict[str, str]:
    """The docstring below each field of ``cls``'s class body, by field name."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0]
    assert isinstance(body, ast.ClassDef)
    docs: dict[str, str] = {}
    for node, following in zip(body.body, body.body[1:], strict=False):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)):
            docs[node.target.id] = inspect.cleandoc(following.value.value)
    return docs


def type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " \\| ".join(f'`"{a}"`' if isinstance(a, str) else f"`{a}`" for a in typing.get_args(tp))
    if origin in (types.UnionType, typing.Union):
        return " or ".join(type_name(a) for a in typing.get_args(tp) if a is not type(None)) + " (optional)"
    if origin is list:
        (item,) = typing.get_args(tp)
        return f"list of {type_name(item)}"
    return {str: "string", int: "integer", float: "number", bool: "boolean"}.get(tp, getattr(tp, "__name__", str(tp)))


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return repr(value)


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    raise ValueError(f"field {f.name} has no default: every configuration key must have one")


def keys(cls: type = AgentConfig, prefix: str = "") -> Iterator[Key]:
    """Every key of every section, nested tables after their section's own keys."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls) if prefix else {}
    nested = []
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            nested.append((f"{prefix}.{f.name}" if prefix else f.name, tp))
            continue
        doc = docs.get(f.name)
        if not doc:
            raise ValueError(f"{cls.__name__}.{f.name} ([{prefix}]) has no docstring: say what the key does")
        value = _default(f)
        shown = _DYNAMIC_DEFAULTS.get((prefix, f.name)) or ("unset" if value is None else None)
        default = shown if shown is not None else f"`{toml_value(value)}`"
        yield Key(prefix, f.name, type_name(tp), default, doc)
    for section, tp in nested:
        yield from keys(tp, section)


def sections(cls: type = AgentConfig, prefix: str = "") -> Iterator[tuple[str, type]]:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            name = f"{prefix}.{f.name}" if prefix else f.name
            yield name, tp
            yield from sections(tp, name)


def _cell(text: str) -> str:
    """One table cell: one line, reST literals as markdown code, ``<`` and ``>`` outside code
    escaped (a browser would take ``<hash>`` for a tag and show nothing)."""
    parts = " ".join(text.split()).replace("``", "`").replace("|", "\\|").split("`")
    for i in range(0, len(parts), 2):
        parts[i] = parts[i].replace("<", "&lt;").replace(">", "&gt;")
    return "`".join(parts)


def render_markdown() -> str:
    every = list(keys())
    out = [
        "# Configuration reference",
        "",
        "<!-- Generated from the config dataclasses by "
        f"`{REGENERATE}`; do not edit by hand. -->",
        "",
        "The agent reads TOML from `/etc/trainguard/agent.toml` or `--config FILE`. Every key has a",
        "default, so no file is needed. A bad key or value stops the agent with one line naming it",
        "(`agent.interval_s: must be > 0`) and exit code 2; `trainguard agent --check-config FILE`",
        "checks a file without starting. SIGHUP reloads the file; a bad file on reload is logged and",
        "the old configuration stays.",
        "",
        "Sections: " + ", ".join(f"[`[{name}]`](#{name.replace('.', '')})" for name, _ in sections()) + ".",
        "",
    ]
    for name, cls in sections():
        out += [f"## [{name}]", ""]
        if cls.__doc__ and not cls.__doc__.startswith(cls.__name__ + "("):
            out += [" ".join(inspect.cleandoc(cls.__doc__).split("\n\n")[0].split()), ""]
        out += ["| key | type | default | meaning |", "|---|---|---|---|"]
        for key in every:
            if key.section == name:
                out.append(f"| `{key.name}` | {key.type} | {_cell(key.default)} | {_cell(key.doc)} |")
        out.append("")
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    del argv
    sys.stdout.write(render_markdown())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
