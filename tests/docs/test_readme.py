"""The README and docs/ say what the code does: the first commands, the API names and flags they
use, a configuration example that loads, links that resolve, and no file outside the repository."""

from __future__ import annotations

import argparse
import re
import subprocess
import tomllib
from pathlib import Path

import trainguard
from trainguard.agent.config import config_from_dict
from trainguard.cli import build_parser
from trainguard.run.plan import RunPlan
from trainguard.run.step import Step

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
PYTHON_API = REPO / "docs" / "python-api.md"
MAX_README_WORDS = 1500
ADOPT = "## Three ways to adopt it"


def _markdown_files() -> list[Path]:
    return [README, *sorted((REPO / "docs").glob("*.md")), REPO / "bench" / "README.md",
            *sorted((REPO / "bench" / "results").glob("*.md"))]


def test_readme_opens_with_the_two_commands_and_stays_short() -> None:
    text = README.read_text()
    assert text.lstrip().startswith("# trainguard")
    first_block = re.search(r"```sh\n(.*?)```", text, re.S)
    assert first_block is not None
    commands = [line.split("#")[0].strip() for line in first_block.group(1).splitlines()]
    assert commands[:2] == ["make demo", "make test"], commands
    assert "\n## " not in text[:first_block.start()], "the two commands come before the first section"
    words = len(text.split())
    assert words <= MAX_README_WORDS, f"README.md has {words} words (at most {MAX_README_WORDS}): move depth into docs/"


def test_readme_config_example_loads() -> None:
    blocks = re.findall(r"```toml\n(.*?)```", README.read_text(), re.S)
    assert blocks, "no TOML example in the README"
    for block in blocks:
        config_from_dict(tomllib.loads(block))


def test_adoption_names_real_api_and_flags() -> None:
    """Every name the README's adoption section and docs/python-api.md use exists with that spelling."""
    section = README.read_text().split(ADOPT, 1)[1].split("\n## ", 1)[0]
    text = section + PYTHON_API.read_text()
    run = trainguard.init(environ={})
    for name in set(re.findall(r"(?<![.\w])run\.(\w+)", text)):  # not a module path (trainguard.run.x)
        assert hasattr(run, name), f"run.{name}"
    for name in set(re.findall(r"\bs\.(\w+)", text)):
        assert hasattr(Step, name), f"s.{name}"
    for name in set(re.findall(r"\bplan\.(\w+)", text)):
        assert hasattr(RunPlan(), name), f"plan.{name}"
    plan_table = PYTHON_API.read_text().split("## The plan", 1)[1].split("\n## ", 1)[0]
    fields = re.findall(r"`(\w+)`", " ".join(re.findall(r"^\| ([^|]+)\|", plan_table, re.M)))
    assert fields and all(hasattr(RunPlan(), name) for name in fields), fields
    args = build_parser().parse_args(["run", "--nproc", "2", "--nodes", "1", "--job", "j", "--max-restarts", "1",
                                      "--hang-timeout", "5", "--detach", "--no-agent", "--", "python", "x.py"])
    assert args.cmd[-2:] == ["python", "x.py"]
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    run_help = commands.choices["run"].format_help()
    used = set(re.findall(r"(--[a-z][a-z-]+)", section)) - {"--steps", "--lr"}  # the example scripts' own
    assert used and all(flag in run_help for flag in used), sorted(f for f in used if f not in run_help)


def test_relative_links_resolve() -> None:
    broken = []
    for path in _markdown_files():
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text()):
            if "://" not in target and not (path.parent / target).exists():
                broken.append(f"{path.relative_to(REPO)} -> {target}")
    assert not broken, broken


def test_no_reference_to_files_outside_the_repository() -> None:
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    names = ("SPEC" + ".md", "FACTS" + ".md")  # split so this file does not match itself
    found = [f for f in tracked if (REPO / f).is_file() and f.endswith((".py", ".md", ".sh", ".toml", ".yml"))
             and any(n in (REPO / f).read_text(errors="replace") for n in names)]
    assert not found, found
