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


@pytest.mark.parametrize("closing", ["sys.stdout.close()", "os.close(1)"])
def test_an_inferlet_that_closes_standard_output(model: str, tmp_path: Path, pie_env: dict[str, str],
                                                 closing: str) -> None:
    """Printing its result was an internal error (exit 70: ValueError or OSError from the closed output)."""
    source = f"import os, sys\n\nasync def main(ctx, args):\n    {closing}\n    return 'done'\n"
    result = run_inferlet(model, tmp_path, source, pie_env)
    assert_user_error(result, "pie: inferlet 'meddles' closed standard output, where pie prints its result")
    assert result.returncode == 1, result


def test_an_inferlet_that_emits_after_closing_standard_output(model: str, tmp_path: Path,
                                                              pie_env: dict[str, str]) -> None:
    source = "import sys\n\nasync def main(ctx, args):\n    ctx.emit('first')\n    sys.stdout.close()\n" \
             "    ctx.emit('second')\n"
    result = run_inferlet(model, tmp_path, source, pie_env)
    assert_user_error(result, "raised StdoutClosed: the inferlet closed standard output", "meddles.py:6 in main")
    assert result.returncode == 1 and result.stdout == "first\n", result


@pytest.mark.parametrize("replacement", ["None", "42", "io.StringIO()"])
def test_an_inferlet_that_replaces_sys_stdout_still_has_its_result_printed(
    model: str, tmp_path: Path, pie_env: dict[str, str], replacement: str
) -> None:
    """None lost the result silently (exit 0, nothing printed), 42 was an internal error."""
    source = f"import io, sys\n\nasync def main(ctx, args):\n    ctx.emit('emitted')\n    sys.stdout = {replacement}\n" \
             "    ctx.emit('also emitted')\n    return 'the result'\n"
    result = run_inferlet(model, tmp_path, source, pie_env)
    assert_ok(result)
    assert result.stdout == "emitted\nalso emitted\nthe result\n", result


@pytest.mark.parametrize("meddling", ["sys.stderr = 42", "sys.stderr = io.StringIO()", "sys.stderr.close()",
                                      "os.close(2)"])
def test_an_inferlet_that_replaces_or_closes_standard_error_still_has_its_failure_said(
    model: str, tmp_path: Path, pie_env: dict[str, str], meddling: str
) -> None:
    """pie's message went into the replacement, nowhere, or became Python's 'lost sys.stderr' dump (exit 120)."""
    source = f"import io, os, sys\n\nasync def main(ctx, args):\n    {meddling}\n    raise ValueError('boom')\n"
    result = run_inferlet(model, tmp_path, source, pie_env)
    assert_user_error(result, "pie: inferlet 'meddles' raised ValueError: boom", "meddles.py:5 in main")
    assert result.returncode == 1 and "lost sys.stderr" not in result.stderr, result


@pytest.mark.parametrize("awaits", [False, True])
def test_an_inferlet_that_stops_its_event_loop(model: str, tmp_path: Path, pie_env: dict[str, str],
                                               awaits: bool) -> None:
    """asyncio's RuntimeError ('Event loop stopped before Future completed.') was an internal error."""
    wait = "    await asyncio.sleep(0.01)\n" if awaits else ""
    source = f"import asyncio\n\nasync def main(ctx, args):\n    asyncio.get_running_loop().stop()\n{wait}" \
             "    return 'done'\n"
    result = run_inferlet(model, tmp_path, source, pie_env)
    assert_user_error(result, "pie: inferlet 'meddles' stopped the event loop it runs on before it ended")
    assert result.returncode == 1 and result.stdout == "", result


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


def test_an_exception_in_a_callback_of_the_inferlets_is_said_in_a_line(
    model: str, tmp_path: Path, pie_env: dict[str, str]
) -> None:
    """asyncio's handler printed the callback's traceback."""
    source = "import asyncio\n\nasync def main(ctx, args):\n    asyncio.get_running_loop().call_soon(lambda: 1 / 0)\n" \
             "    await asyncio.sleep(0.01)\n    return 'done'\n"
    result = run_inferlet(model, tmp_path, source, pie_env)
    assert_ok(result, "pie: while inferlet 'meddles' ran: Exception in callback",
              "ZeroDivisionError: division by zero", "meddles.py:4 in <lambda>")
    assert result.stdout == "done\n", result


def test_an_async_generator_left_suspended_is_closed_with_the_run(model: str, tmp_path: Path,
                                                                  pie_env: dict[str, str]) -> None:
    """Its cleanup ran at the event loop's shutdown, after the run and past its deadline: one that awaited for ever
    held `pie run` for ever. One whose cleanup raised printed asyncio's traceback."""
    source = (
        "import asyncio\n\nasync def waits():\n    try:\n        yield 1\n    finally:\n"
        "        await asyncio.Event().wait()\n\nasync def fails():\n    try:\n        yield 2\n    finally:\n"
        "        raise ValueError('cleanup failed')\n\nasync def main(ctx, args):\n"
        "    global kept\n    kept = [waits(), fails()]\n"
        "    return [await generator.__anext__() for generator in kept]\n"
    )
    result = run_inferlet(model, tmp_path, source, pie_env, timeout=60)
    assert_ok(result, "an error occurred during closing of asynchronous generator",
              "ValueError: cleanup failed", "meddles.py:13 in fails")
    assert result.stdout == "[\n  1,\n  2\n]\n", result


def test_an_inferlet_that_replaced_pies_code_is_told_it_did(model: str, tmp_path: Path,
                                                            pie_env: dict[str, str]) -> None:
    """pie failing in code the inferlet had replaced was an internal error (exit 70, a report file)."""
    source = "from pie.inferlet import session\n\nasync def main(ctx, args):\n" \
             "    def close(self):\n        raise RuntimeError('replaced')\n" \
             "    session.Session.close = close\n    return 'done'\n"
    result = run_inferlet(model, tmp_path, source, pie_env)
    assert_user_error(result, "pie: inferlet 'meddles' changed pie's own code (pie.inferlet.session.Session.close), "
                              "and pie failed after it: RuntimeError: replaced")
    assert result.returncode == 1 and "internal error" not in result.stderr, result


STUBBORN = ("import asyncio, sys\n\nasync def main(ctx, args):\n    print('waiting', file=sys.stderr, flush=True)\n"
            "    while True:\n        try:\n            await asyncio.sleep(100)\n        except BaseException:\n"
            "            pass\n")
"""An inferlet that will not stop: it swallows its cancellation and even the GeneratorExit that closes it."""


def test_ctrl_c_ends_an_inferlet_that_swallows_its_cancellation(model: str, tmp_path: Path,
                                                                pie_env: dict[str, str]) -> None:
    """The Ctrl-C cancelled the host, and asyncio.run's shutdown then waited for ever on the inferlet's task."""
    inferlet = tmp_path / "stubborn.py"
    inferlet.write_text(STUBBORN)
    result = run_pie("run", "--model", model, "--inferlet", str(inferlet), "--inferlet-timeout", "300", env=pie_env,
                     timeout=60, interrupt_after="waiting")
    assert not result.timed_out and result.returncode == 130, result
    assert "Traceback" not in result.stderr, result


def test_an_inferlet_that_will_not_close_past_its_timeout_is_said_in_words(model: str, tmp_path: Path,
                                                                           pie_env: dict[str, str]) -> None:
    """Closing it raised 'coroutine ignored GeneratorExit', which Python printed with a traceback in pie's code."""
    inferlet = tmp_path / "stubborn.py"
    inferlet.write_text(STUBBORN)
    result = run_pie("run", "--model", model, "--inferlet", str(inferlet), "--inferlet-timeout", "1", env=pie_env)
    assert_user_error(result, "pie: inferlet 'stubborn' did not finish within 1 s and was stopped",
                      "pie: while inferlet 'stubborn' ran: Exception ignored in: <coroutine object main",
                      "RuntimeError: coroutine ignored GeneratorExit")
    assert result.returncode == 1, result


@pytest.mark.parametrize("daemon", [True, False])
def test_pie_ends_past_the_threads_an_inferlet_leaves_running(model: str, tmp_path: Path, pie_env: dict[str, str],
                                                              daemon: bool) -> None:
    """A daemon thread printing while the interpreter shut down could hold stdout's lock, which Python ended with a
    fatal error and SIGABRT (exit 134 in about one run of five with these 16 threads); nothing said why pie ended
    past a thread that is no daemon."""
    source = "import threading\n\ndef chatter():\n    while True:\n        print('chatter ' * 20)\n\n" \
             f"async def main(ctx, args):\n    for _ in range(16):\n        threading.Thread(target=chatter, daemon={daemon}).start()\n" \
             "    return 'the result'\n"
    result = run_inferlet(model, tmp_path, source, {**pie_env, "PYTHONUNBUFFERED": ""})
    assert_ok(result, "pie: inferlet 'meddles' left threads running when it ended (Thread-1 (chatter), Thread-2 "
                      "(chatter), Thread-3 (chatter) and 13 more); pie ends without them")
    assert "the result\n" in result.stdout and "Fatal Python error" not in result.stderr, result
