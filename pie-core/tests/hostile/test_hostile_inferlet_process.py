"""Inferlets that meddle with the process `pie run --inferlet` shares with them: its standard streams, its event loop,
forking it, its own code. Each ends in a message naming what it did, exit 1, never a traceback of pie's."""

from __future__ import annotations

from pathlib import Path

import pytest

from pie_process import PieResult, assert_ok, assert_user_error, run_pie
from pie.testing.models import make_gguf_model


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_gguf_model(tmp_path_factory.mktemp("model") / "tiny.gguf", "F32"))


def run_inferlet(model: str, tmp_path: Path, source: str, env: dict[str, str], timeout: float = 120.0) -> PieResult:
    inferlet = tmp_path / "meddles.py"
    inferlet.write_text(source)
    return run_pie("run", "--model", model, "--inferlet", str(inferlet), "--inferlet-timeout", "30", env=env,
                   timeout=timeout)


@pytest.mark.parametrize("where", ["main", "import", "callback"])
def test_an_inferlet_may_not_fork(model: str, tmp_path: Path, pie_env: dict[str, str], where: str) -> None:
    """The child went on as a second pie: it printed a second result (or, forked at import, ran the whole inferlet
    again)."""
    fork = "pid = os.fork()\nprint('forked', os.getpid(), flush=True)\n"
    source = {
        "main": f"import os\n\nasync def main(ctx, args):\n    {fork.replace(chr(10), chr(10) + '    ')}"
                "return f'result of {os.getpid()}'\n",
        "import": f"import os\n{fork}\nasync def main(ctx, args):\n    return f'result of {{os.getpid()}}'\n",
        "callback": "import asyncio, os\n\ndef fork_into(done):\n    try:\n        done.set_result(os.fork())\n"
                    "    except OSError as exc:\n        done.set_exception(exc)\n\nasync def main(ctx, args):\n"
                    "    loop = asyncio.get_running_loop()\n    done = loop.create_future()\n"
                    "    loop.call_soon(fork_into, done)\n    return await done\n",
    }[where]
    result = run_inferlet(model, tmp_path, source, pie_env)
    assert_user_error(result, "PermissionError: [Errno 1] an inferlet may not fork pie's process",
                      "start a program with subprocess")
    assert result.stdout == "", f"nothing forked, nothing printed: {result}"


def test_an_inferlet_may_still_start_a_program(model: str, tmp_path: Path, pie_env: dict[str, str]) -> None:
    source = "import subprocess, sys\n\nasync def main(ctx, args):\n" \
             "    return subprocess.run([sys.executable, '-c', 'print(6 * 7)'], capture_output=True, text=True).stdout\n"
    result = run_inferlet(model, tmp_path, source, pie_env)
    assert_ok(result)
    assert result.stdout == "42\n\n", result
