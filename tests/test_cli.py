"""`kalos --help` and its commands' help: plain text, every command, every option described."""

from __future__ import annotations

import argparse

import pytest

from kalos.cli import build_parser


def _help(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit):
        build_parser().parse_args([*argv, "--help"])
    return capsys.readouterr().out


def test_top_level_help_names_every_command_in_plain_text(
    capsys: pytest.CaptureFixture[str],
) -> None:
    text = _help([], capsys)
    assert "``" not in text
    for command in ("serve", "status", "demo", "bench"):
        assert command in text


@pytest.mark.parametrize("command", ["serve", "status"])
def test_every_option_has_a_description(command: str) -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for action in sub.choices[command]._actions:
        assert action.help, f"kalos {command} {action.option_strings} has no help"


def test_serve_help_shows_the_metric_and_its_default(capsys: pytest.CaptureFixture[str]) -> None:
    text = " ".join(_help(["serve"], capsys).split())
    assert "--metric {ip,cosine,l2}" in text
    assert "(default: ip)" in text
    assert "(default: 2.0)" in " ".join(_help(["status"], capsys).split())
