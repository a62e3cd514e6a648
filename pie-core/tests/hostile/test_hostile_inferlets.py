"""Hostile inferlets and inferlet command lines: each ends in a message naming the problem, never a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from pie_process import PieResult, assert_user_error, run_pie
from pie.testing.models import make_gguf_model

VOCAB = 400
"""The tiny test model's vocabulary (see pie.testing.models)."""


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_gguf_model(tmp_path_factory.mktemp("model") / "tiny.gguf", "F32"))


def run_inferlet(model: str, tmp_path: Path, source: str, *args: str, env: dict[str, str]) -> PieResult:
    inferlet = tmp_path / "hostile.py"
    inferlet.write_text(source)
    return run_pie("run", "--model", model, "--inferlet", str(inferlet), *args, env=env)


@pytest.mark.parametrize("token", [-1, VOCAB, 10**30])
def test_a_token_id_outside_the_vocabulary(model: str, tmp_path: Path, pie_env: dict[str, str], token: int) -> None:
    source = f"async def main(ctx, args):\n    c = ctx.context('hi')\n    c.fill(tokens=[{token}])\n    return await c.generate(3)\n"
    result = run_inferlet(model, tmp_path, source, env=pie_env)
    assert_user_error(result, f"token id {token} is outside the model's vocabulary (0 to {VOCAB - 1})")
    assert f"hostile.py:3 in main: c.fill(tokens=[{token}])" in result.stderr  # where, in the user's file
    assert result.stdout == ""


def test_text_that_utf8_cannot_encode(model: str, tmp_path: Path, pie_env: dict[str, str]) -> None:
    source = "async def main(ctx, args):\n    return await ctx.context('a \\ud800 b').generate(3)\n"
    assert_user_error(run_inferlet(model, tmp_path, source, env=pie_env), "'\\ud800' at index 2", "UTF-8")


def test_an_argument_that_is_not_utf8(model: str, tmp_path: Path, pie_env: dict[str, str]) -> None:
    source = "async def main(ctx, args):\n    return args\n"
    result = run_inferlet(model, tmp_path, source, "--", "fine", "\udcff", env=pie_env)
    assert_user_error(result, "inferlet argument 2 is not valid UTF-8")


def test_an_inferlet_that_raises_shows_its_line_not_a_traceback(
    model: str, tmp_path: Path, pie_env: dict[str, str]
) -> None:
    source = "async def main(ctx, args):\n    table = {}\n    return table['missing']\n"
    result = run_inferlet(model, tmp_path, source, env=pie_env)
    assert_user_error(result, "inferlet 'hostile' raised KeyError: 'missing'", "hostile.py:3 in main: return table")
    debug = run_inferlet(model, tmp_path, source, "--inferlet-timeout", "30", env={**pie_env, "PIE_DEBUG": "1"})
    assert debug.returncode == 1 and "Traceback (most recent call last)" in debug.stderr


def test_an_inferlet_raising_its_own_base_exception(model: str, tmp_path: Path, pie_env: dict[str, str]) -> None:
    source = "class Escape(BaseException):\n    pass\n\nasync def main(ctx, args):\n    raise Escape('out')\n"
    assert_user_error(run_inferlet(model, tmp_path, source, env=pie_env), "raised Escape: out", "hostile.py:5 in main")


@pytest.mark.parametrize("where", ["main", "import", "task"])
def test_ctrl_c_stops_an_inferlet_that_never_awaits(
    model: str, tmp_path: Path, pie_env: dict[str, str], where: str
) -> None:
    """The first Ctrl-C only asked the event loop to cancel, which the loop could not do while the inferlet's code held
    it: nothing happened until a second. And a Ctrl-C at import was told as the inferlet's failure (exit 2)."""
    spin = "import sys\nprint('spinning', file=sys.stderr, flush=True)\nwhile True:\n    pass\n"
    source = {
        "main": f"async def main(ctx, args):\n    {spin.replace(chr(10), chr(10) + '    ')}",
        "import": f"{spin}async def main(ctx, args):\n    return 1\n",
        "task": "import asyncio\n\nasync def spin():\n"
        f"    {spin.replace(chr(10), chr(10) + '    ')}\n"
        "async def main(ctx, args):\n    await asyncio.create_task(spin())\n",
    }[where]
    inferlet = tmp_path / "spins.py"
    inferlet.write_text(source)
    result = run_pie("run", "--model", model, "--inferlet", str(inferlet), "--inferlet-timeout", "300",
                     env=pie_env, timeout=60, interrupt_after="spinning")
    assert not result.timed_out and result.returncode == 130, result
    assert "Traceback" not in result.stderr and "raised" not in result.stderr, result


@pytest.mark.parametrize(
    ("flags", "variable", "needle"),
    [
        (["--inferlet-timeout", "-1"], None, "--inferlet-timeout must be a finite number of seconds above 0, not -1"),
        (["--inferlet-timeout", "nan"], None, "--inferlet-timeout must be a finite number of seconds above 0, not nan"),
        ([], "nan", "PIE_INFERLET_TIMEOUT must be a finite number of seconds above 0, not nan"),
        ([], "-1", "PIE_INFERLET_TIMEOUT must be a finite number of seconds above 0, not -1"),
    ],
)
def test_a_timeout_that_is_not_a_positive_number(
    model: str, tmp_path: Path, pie_env: dict[str, str], flags: list[str], variable: str | None, needle: str
) -> None:
    env = pie_env if variable is None else {**pie_env, "PIE_INFERLET_TIMEOUT": variable}
    source = "async def main(ctx, args):\n    return 'ran'\n"
    result = run_inferlet(model, tmp_path, source, *flags, env=env)
    assert_user_error(result, needle)
    assert "ran" not in result.stdout
