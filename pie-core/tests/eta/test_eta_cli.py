"""`eta_command`, the function behind `pie eta "EXPR" --target T`, and import cost."""

from __future__ import annotations

import subprocess
import sys

import pytest
import typer
from pie.eta import TARGETS, stdlib
from pie.eta.cli import eta_command
from typer.testing import CliRunner

app = typer.Typer()
app.command()(eta_command)


@pytest.mark.parametrize("target", TARGETS)
def test_prints_the_rendered_source(target: str) -> None:
    result = CliRunner().invoke(app, ["in x: f32; out y = silu(x) * 2", "--target", target])
    assert result.exit_code == 0, result.output
    assert "eta_" in result.output and ("exp" in result.output)


def test_default_target_is_cuda_and_stdlib_names_work() -> None:
    result = CliRunner().invoke(app, ["softmax"])
    assert result.exit_code == 0
    assert result.output == stdlib.get("softmax").render("cuda").source


def test_source_that_is_not_utf8_is_named_so() -> None:
    """Bytes that are not UTF-8 (what a shell passes for $'\\xff') were an "unexpected character '\\udcff'"."""
    result = CliRunner().invoke(app, ["in x: f32; out y = x \udcff"])
    assert result.exit_code == 1
    assert result.output == "pie: the eta source is not valid UTF-8 (character 22 is not)\n"


def test_errors_show_the_column_and_exit_nonzero() -> None:
    result = CliRunner().invoke(app, ["in x: f32; out y = x +* 2"])
    assert result.exit_code == 1
    assert result.output.startswith("pie: line 1, column 23") and "^" in result.output


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("in x: f32; out y = x * " + "1" * 5000, "line 1, column 24: integer literal out of range"),
        ("in x: f32; out y = x + 3.4028e38 + 3.4028235e38", None),  # near f32's largest: renders
        ("in x: f32; param self: f32; out y = x * self", None),
    ],
)
def test_hostile_literals_and_names_are_answers_not_crashes(source: str, message: str | None) -> None:
    result = CliRunner().invoke(app, [source, "--target", "wgsl"])
    assert not isinstance(result.exception, (ValueError, OverflowError)), result.exception
    if message is None:
        assert result.exit_code == 0 and "fn eta_" in result.output
    else:
        assert result.exit_code == 1 and result.output.startswith(f"pie: {message}\n")
        assert len(result.output) < 300  # the excerpt is a window of the 5000-digit line


def test_a_name_that_is_no_stdlib_epilogue_lists_those_there_are() -> None:
    result = CliRunner().invoke(app, ["softmaxx"])
    assert result.exit_code == 2, result.output  # a usage error, as an unknown --target
    assert "pie: no stdlib epilogue is named 'softmaxx' (the stdlib: bias_add, " in result.output


def test_unknown_target() -> None:
    result = CliRunner().invoke(app, ["softmax", "--target", "ptx"])
    assert result.exit_code == 2 and "unknown target 'ptx'" in result.output


def test_importing_eta_does_not_import_jax_or_gpu_stacks() -> None:
    code = (
        "import sys, pie.eta, pie.eta.cli, pie.eta.stdlib; pie.eta.stdlib.get('softmax').render('wgsl');"
        "heavy = {'jax', 'wgpu', 'pyopencl', 'cuda', 'hip'} & set(sys.modules); assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
