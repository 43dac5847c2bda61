"""Every command of `trainguard` explains itself: an example epilog per command, help on every
option and a metavar on every option that takes a value."""

from __future__ import annotations

import argparse

import pytest

from trainguard.cli import build_parser


def _commands() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


@pytest.mark.parametrize("name", sorted(_commands()))
def test_every_option_has_help_and_a_metavar_and_every_command_an_example(name: str) -> None:
    parser = _commands()[name]
    assert parser.epilog and "trainguard " in parser.epilog, f"{name}: no example epilog"
    bare = [a.option_strings or [a.dest] for a in parser._actions
            if not isinstance(a, argparse._HelpAction) and not a.help]
    assert not bare, f"{name}: options without help: {bare}"
    nameless = [a.option_strings for a in parser._actions if a.option_strings and a.nargs != 0 and not a.metavar]
    assert not nameless, f"{name}: options taking a value without a metavar: {nameless}"


def test_the_help_of_every_command_prints_its_examples(capsys: pytest.CaptureFixture[str]) -> None:
    for name, parser in _commands().items():
        with pytest.raises(SystemExit) as done:
            build_parser().parse_args([name, "--help"])
        assert done.value.code == 0
        example = next(ln.strip() for ln in (parser.epilog or "").splitlines() if "trainguard " in ln)
        assert example in capsys.readouterr().out, name
