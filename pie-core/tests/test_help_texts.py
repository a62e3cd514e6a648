"""Help texts reach the user as written: the rich help renderer reads ``[word]`` as markup and drops it,
so a bracket in a command's or option's help must be escaped (``\\[``) to be shown. Every option has one.
(The benchmark scripts' ``--help``: test_benchmarks.py.)"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
from typer.main import get_command
from typer.testing import CliRunner

from pie.cli import app

BRACKETED = re.compile(r"\[[^\]\s]+\]")


def _commands(command: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    """Every command under ``command`` (typer's own click commands), by its path of names."""
    yield path, command
    for name, sub in sorted(getattr(command, "commands", {}).items()):
        yield from _commands(sub, (*path, name))


COMMANDS = dict(_commands(get_command(app)))


def _bracketed(command: Any) -> set[str]:
    texts = [command.help or "", *(getattr(p, "help", None) or "" for p in command.params)]
    return {token for text in texts for token in BRACKETED.findall(text.replace("\\[", "["))}


def test_some_help_text_has_brackets_to_check() -> None:
    assert "[plot]" in set().union(*map(_bracketed, COMMANDS.values()))


@pytest.mark.parametrize("path", sorted(COMMANDS), ids=lambda p: " ".join(p) or "pie")
def test_brackets_in_help_texts_are_shown(path: tuple[str, ...]) -> None:
    result = CliRunner().invoke(app, [*path, "--help"])
    assert result.exit_code == 0, result.output
    for token in _bracketed(COMMANDS[path]):
        assert token in result.output, f"`pie {' '.join(path)} --help` dropped {token}:\n{result.output}"


@pytest.mark.parametrize("path", sorted(COMMANDS), ids=lambda p: " ".join(p) or "pie")
def test_every_option_has_a_help_text(path: tuple[str, ...]) -> None:
    bare = [p.opts[0] for p in COMMANDS[path].params if p.param_type_name == "option" and not p.help]
    assert not bare, f"`pie {' '.join(path)} --help` shows no text for {', '.join(bare)}"


def test_inferlet_timeout_help_names_the_default() -> None:
    from pie.inferlet.host import DEFAULT_TIMEOUT_S

    (option,) = (p for p in COMMANDS[("run",)].params if p.name == "inferlet_timeout")
    assert f"else {DEFAULT_TIMEOUT_S:g})" in option.help
