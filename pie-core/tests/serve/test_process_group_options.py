"""`pie serve --process-group` and its options: what it refuses before anything loads."""

from __future__ import annotations

import importlib.util

import pytest
from pie.cli import app
from typer.testing import CliRunner


@pytest.mark.parametrize(
    ("args", "status", "message"),
    [  # options that do not go together are a usage error (2); an engine that cannot do it, a failure (1)
        (["--coordinator", "127.0.0.1:8476"], 2, "--process-group needs --engine"),
        (["--process-group", "--engine", "cpu", "--ray", "local"], 2, "--process-group needs --engine"),
        (["--process-group", "--engine", "cpu"], 1, "engine 'cpu' runs in one process: it has no pie_join_process_group"),
    ],
)
def test_a_process_group_needs_an_engine_that_can_join_one(args: list[str], status: int, message: str) -> None:
    if "--ray" in args and importlib.util.find_spec("ray") is None:
        pytest.skip("--ray is checked for its library first")
    result = CliRunner().invoke(app, ["serve", *args])
    assert result.exit_code == status and message in result.output, result.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--num-processes", "0"], "the number of processes must be at least 1, not 0"),
        (["--num-processes", "2", "--process-id", "2"], "process id 2 is outside 0..1"),
    ],
)
def test_the_engine_refuses_a_group_it_cannot_be(args: list[str], message: str) -> None:
    pytest.importorskip("pie_engine_xla", reason="the XLA engine joins process groups")
    result = CliRunner().invoke(app, ["serve", "--engine", "xla", *args])
    assert result.exit_code == 1 and message in result.output, result.output
