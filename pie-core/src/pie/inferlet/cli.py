"""`pie run --inferlet FILE.py -- args`: load a model, run one inferlet, print what it returns."""

from __future__ import annotations

import asyncio
import json
import math
import os
import sys
import threading
import traceback
from pathlib import Path
from typing import Any, NoReturn

from pie.cli_errors import USAGE_ERROR_EXIT
from pie.inferlet import DEFAULT_TIMEOUT_S, InferletHost, InferletLoadError, InferletMain, InferletResult, load_inferlet
from pie.inferlet.host import named, run_in_new_loop, where_in
from pie.inferlet.patches import PieCode
from pie.inferlet.streams import StandardStreams, StdoutClosed
from pie.inferlet.watchdog import Watchdog, interrupts_stop_inferlets
from pie.weights import Dtype

TIMEOUT_ENV = "PIE_INFERLET_TIMEOUT"
"""Seconds an inferlet may run under `pie run` (default: DEFAULT_TIMEOUT_S)."""


def run_inferlet_file(
    path: str,
    args: list[str],
    model: str | None,
    engine: str | None,
    *,
    timeout_s: float | None = None,
    kv_tokens: int | None = None,
    kv_dtype: str = "float32",
    show_traceback: bool = False,
    dtype: Dtype = "auto",
) -> int:
    """Run the inferlet in ``path``; returns the process exit code: 0 ok, 1 failed (its file cannot be run, or it
    raised), 2 a ``timeout_s`` (``--inferlet-timeout``) that is no number of seconds (:mod:`pie.cli_errors`).

    ``kv_tokens`` sizes the KV cache (None: the runtime's default), ``kv_dtype`` its pages' element type,
    ``dtype`` is ``--dtype``. When the inferlet raises, the line of its own file where it happened is printed,
    its whole traceback only with ``show_traceback``. What it does to the process it runs in (its streams, its event
    loop, pie's own code) is told as its doing (examples/README.md, the trust model); where it leaves threads
    running, the process ends here, with the exit code (see :func:`_exit_past`).
    """
    try:
        timeout = _timeout(timeout_s)
    except ValueError as exc:  # --inferlet-timeout's value is a usage error; its variable's, a setting's
        print(f"pie: {exc}", file=sys.stderr)
        return 1 if timeout_s is None else USAGE_ERROR_EXIT
    with StandardStreams() as streams:  # taken before the import: the inferlet's code starts there
        pie_code = PieCode()
        threads = _Threads()
        watchdog = Watchdog()
        try:
            with interrupts_stop_inferlets(watchdog), watchdog.running(timeout):  # its import is its code too
                main = load_inferlet(path)
        except (ValueError, InferletLoadError) as exc:
            streams.restore()
            print(f"pie: {exc}", file=sys.stderr)
            return 1
        streams.restore()
        threads.note_import()
        name = Path(path).stem
        try:
            return _load_and_run(main, name, args, streams, pie_code, threads, model, engine, timeout_s=timeout,
                                 kv_tokens=kv_tokens, kv_dtype=kv_dtype, show_traceback=show_traceback, dtype=dtype)
        except Exception as exc:
            changed = pie_code.changed()
            if not changed:
                raise  # pie's own failure
            streams.restore()
            print(f"pie: inferlet {name!r} changed pie's own code ({_listed(changed)}), and pie failed after it: "
                  f"{named(exc)}", file=sys.stderr)
            return 1


def _load_and_run(
    main: InferletMain,
    name: str,
    args: list[str],
    streams: StandardStreams,
    pie_code: PieCode,
    threads: _Threads,
    model: str | None,
    engine: str | None,
    *,
    timeout_s: float,
    kv_tokens: int | None,
    kv_dtype: str,
    show_traceback: bool,
    dtype: Dtype,
) -> int:
    """Load the model and run the loaded inferlet ``main`` (see :func:`run_inferlet_file`)."""
    from pie.runtime.llm import LLM

    try:
        llm = LLM.load(model, engine, max_cached_tokens=kv_tokens, kv_dtype=kv_dtype, dtype=dtype)
        host = InferletHost.from_llm(  # its host page pool is the CPU engine's
            llm, timeout_s=timeout_s, on_emit=lambda value: streams.print_value(format_value(value))
        )
    except (OSError, ValueError, RuntimeError) as exc:
        print(f"pie: {exc}", file=sys.stderr)
        return 1
    pie_code.note()  # what loading the model imported
    threads.note_run()
    stray = _StrayErrors(name, main, streams, show_traceback)
    ignored, sys.unraisablehook = sys.unraisablehook, stray.unraisable
    try:
        result = run_in_new_loop(_run(host, main, args, name, stray), name)
    finally:
        sys.unraisablehook = ignored
    streams.restore()
    code = _report(result, name, streams, show_traceback)
    if left := threads.left():
        _exit_past(left, name, code)
    return code


def _report(result: InferletResult, name: str, streams: StandardStreams, show_traceback: bool) -> int:
    """Print the run's value, or say why it failed; the exit status."""
    if not result.ok:
        if show_traceback and result.details:
            print(result.details, file=sys.stderr, end="")
        print(f"pie: {result.error}", file=sys.stderr)
        if result.where and not show_traceback:
            print(f"  at {result.where}", file=sys.stderr)
        return 1
    if result.value is None:
        return 0
    try:
        streams.print_value(format_value(result.value))
    except StdoutClosed:
        print(f"pie: inferlet {name!r} closed standard output, where pie prints its result", file=sys.stderr)
        return 1
    return 0


def _exit_past(threads: list[threading.Thread], name: str, code: int) -> NoReturn:
    """End the process now, with ``code``, past the threads the inferlet left running. Python would wait at exit for
    one that is no daemon (for ever, for one that never ends), and a daemon thread writing to stdout as the interpreter
    shuts down can hold the stream's lock, which Python ends in a fatal error (SIGABRT). Nor can they be stopped: an
    exception raised in a thread in the middle of a write leaves the stream's buffer corrupt."""
    print(f"pie: inferlet {name!r} left threads running when it ended ({_listed([t.name for t in threads])}); pie ends "
          "without them", file=sys.stderr)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or full output: what it held is lost either way
            pass
    os._exit(code)


async def _run(
    host: InferletHost, main: InferletMain, args: list[str], name: str, stray: _StrayErrors
) -> InferletResult:
    asyncio.get_running_loop().set_exception_handler(stray.in_loop)
    with interrupts_stop_inferlets(host.watchdog):  # inside the loop: asyncio.run's own handler is the one before
        return await host.run(main, args, name=name)


class _Threads:
    """Which threads are the inferlet's: those it started at its import or during its run (not the model's loading),
    but pie's own (named ``pie-...``)."""

    def __init__(self) -> None:
        self._before = set(threading.enumerate())
        self._at_import: set[threading.Thread] = set()
        self._before_run: set[threading.Thread] = set()

    def note_import(self) -> None:
        self._at_import = set(threading.enumerate()) - self._before

    def note_run(self) -> None:
        self._before_run = set(threading.enumerate())

    def left(self) -> list[threading.Thread]:
        """The inferlet's threads still running."""
        return [thread for thread in threading.enumerate()
                if (thread in self._at_import or thread not in self._before_run) and not thread.name.startswith("pie-")]


class _StrayErrors:
    """What no one can be handed: an exception in a callback of the inferlet's or in an async generator's cleanup
    (the event loop's exception handler), one Python ignores (``sys.unraisablehook``: a coroutine of the inferlet's
    that would not close, say). Each is said in a line, as an inferlet's own failure is, with where in its file, the
    traceback only with ``show_traceback``. The run goes on, as asyncio and Python let it."""

    def __init__(self, name: str, main: InferletMain, streams: StandardStreams, show_traceback: bool):
        self.name = name
        self.main = main
        self.streams = streams
        self.show_traceback = show_traceback

    def in_loop(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        error = context.get("exception")
        self._tell(str(context.get("message") or "an error in the event loop"),
                   error if isinstance(error, BaseException) else None)

    def unraisable(self, unraisable: Any) -> None:
        try:
            what = f"{unraisable.err_msg or 'Exception ignored in'}: {unraisable.object!r}"
        except Exception:  # noqa: BLE001 - the object's repr is the inferlet's code
            what = unraisable.err_msg or "Exception ignored"
        self._tell(what, unraisable.exc_value)

    def _tell(self, message: str, error: BaseException | None) -> None:
        lines = [f"pie: while inferlet {self.name!r} ran: {message}"]
        if error is not None:
            lines[0] += f": {named(error)}"
            if self.show_traceback:
                lines[:0] = traceback.format_exception(error)
            elif where := where_in(self.main, error):
                lines.append(f"  at {where}")
        self.streams.say("".join(line if line.endswith("\n") else line + "\n" for line in lines))


def _listed(names: list[str], shown: int = 3) -> str:
    """The first ``shown`` names, and how many more."""
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def _timeout(given: float | None) -> float:
    """Seconds from ``--inferlet-timeout``, else from PIE_INFERLET_TIMEOUT, else DEFAULT_TIMEOUT_S: a finite number > 0."""
    if given is not None:
        value, source = given, "--inferlet-timeout"
    else:
        text = os.environ.get(TIMEOUT_ENV)
        if text is None:
            return DEFAULT_TIMEOUT_S
        source = TIMEOUT_ENV
        try:
            value = float(text)
        except ValueError:
            raise ValueError(f"{TIMEOUT_ENV} must be a number of seconds, not {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{source} must be a finite number of seconds above 0, not {value:g}")
    return value


def format_value(value: Any) -> str:
    """Text as it is; anything else as indented JSON when it can be, else its repr."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, indent=2, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError):
        pass
    try:
        return repr(value)
    except Exception as failure:  # noqa: BLE001 - the inferlet's own object: its repr is its code
        return f"<a {type(value).__name__} that cannot be shown: its repr raised {type(failure).__name__}>"
