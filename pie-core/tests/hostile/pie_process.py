"""Hostile inputs: run the real `pie` command in a child process and hold it to the reliability rules.

Every case here runs `pie` as a user would (a separate process, its own environment) and checks,
through :func:`assert_user_error` or :func:`assert_ok`: an exit code of 1 to 127 (never a signal),
no Python traceback, a message naming the problem, a bounded time, and (where the input claims
sizes) bounded peak memory.
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

PIE = str(Path(sys.executable).with_name("pie"))
"""This environment's console script (what a user runs)."""


@dataclass
class PieResult:
    args: tuple[str, ...]
    returncode: int
    """Negative: killed by that signal (as subprocess reports it)."""
    stdout: str
    stderr: str
    seconds: float
    peak_rss_mb: float
    timed_out: bool

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    def __str__(self) -> str:
        return (
            f"pie {' '.join(self.args)} -> {self.returncode} in {self.seconds:.1f} s, {self.peak_rss_mb:.0f} MB"
            f"{' (TIMED OUT)' if self.timed_out else ''}\n--- stdout\n{self.stdout}\n--- stderr\n{self.stderr}"
        )


def run_pie(
    *args: str,
    env: Mapping[str, str] | None = None,
    timeout: float = 120.0,
    stdout: str = "captured",
    interrupt_after: str | None = None,
) -> PieResult:
    """Run `pie ARGS...` to its end or ``timeout`` (then killed); returns its exit, output, time and peak RSS.

    ``env`` adds to (and overrides) this process's environment; a value of "" removes the variable.
    ``stdout`` is ``"captured"``, ``"full"`` (/dev/full: every write fails with ENOSPC) or ``"closed"``.
    With ``interrupt_after``, one SIGINT (a Ctrl-C) is sent once that text is on its stderr.
    """
    environment = dict(os.environ)
    for key, value in (env or {}).items():
        if value == "":
            environment.pop(key, None)
        else:
            environment[key] = value
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        start = time.monotonic()
        pid = _spawn(args, environment, out.fileno(), err.fileno(), stdout)
        timed_out = False
        while True:
            finished, status, usage = os.wait4(pid, os.WNOHANG)
            if finished:
                break
            if interrupt_after is not None and interrupt_after.encode() in os.pread(err.fileno(), 1 << 20, 0):
                os.kill(pid, signal.SIGINT)
                interrupt_after = None
            if time.monotonic() - start > timeout:
                timed_out = True
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:  # the child has not made its own session yet
                    os.kill(pid, signal.SIGKILL)
                _, status, usage = os.wait4(pid, 0)
                break
            time.sleep(0.02)
        seconds = time.monotonic() - start
        out.seek(0)
        err.seek(0)
        return PieResult(
            tuple(args),
            os.waitstatus_to_exitcode(status),
            out.read().decode("utf-8", "replace"),
            err.read().decode("utf-8", "replace"),
            seconds,
            usage.ru_maxrss / 1024,
            timed_out,
        )


def _spawn(args: tuple[str, ...], environment: dict[str, str], out: int, err: int, stdout: str) -> int:
    """Start `pie` in a session of its own (so a timeout kills its children too), without forking this
    process: it runs threads (JAX's, BLAS's), and a fork of a threaded process can deadlock before exec."""
    to_stdout = {
        "captured": (os.POSIX_SPAWN_DUP2, out, 1),
        "full": (os.POSIX_SPAWN_OPEN, 1, "/dev/full", os.O_WRONLY, 0),
        "closed": (os.POSIX_SPAWN_CLOSE, 1),
    }[stdout]
    return os.posix_spawn(
        PIE,
        [PIE, *args],
        environment,
        file_actions=[(os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0), to_stdout, (os.POSIX_SPAWN_DUP2, err, 2)],
        setsid=True,
        setsigdef=(signal.SIGINT,),  # a Ctrl-C acts even where this process was started with it ignored (`cmd &`)
    )


def assert_user_error(
    result: PieResult, *needles: str, max_seconds: float | None = None, max_rss_mb: float | None = None
) -> None:
    """A clear error: exit 1..127, no traceback, every needle (case-insensitive) in the output, within bounds."""
    assert not result.timed_out, f"did not finish in time: {result}"
    assert 1 <= result.returncode <= 127, f"expected an error exit (1..127), got {result.returncode}: {result}"
    _no_traceback(result)
    lowered = result.output.lower()
    for needle in needles:
        assert needle.lower() in lowered, f"the message does not name {needle!r}: {result}"
    _within(result, max_seconds, max_rss_mb)


def assert_ok(result: PieResult, *needles: str, max_seconds: float | None = None) -> None:
    """Success: exit 0, no traceback, every needle (case-insensitive) in the output."""
    assert not result.timed_out, f"did not finish in time: {result}"
    assert result.returncode == 0, f"expected exit 0: {result}"
    _no_traceback(result)
    lowered = result.output.lower()
    for needle in needles:
        assert needle.lower() in lowered, f"the output does not say {needle!r}: {result}"
    _within(result, max_seconds, None)


def _no_traceback(result: PieResult) -> None:
    assert "Traceback (most recent call last)" not in result.output, f"printed a traceback: {result}"


def _within(result: PieResult, max_seconds: float | None, max_rss_mb: float | None) -> None:
    if max_seconds is not None:
        assert result.seconds <= max_seconds, f"took {result.seconds:.1f} s (bound {max_seconds} s): {result}"
    if max_rss_mb is not None:
        assert result.peak_rss_mb <= max_rss_mb, f"peak RSS {result.peak_rss_mb:.0f} MB (bound {max_rss_mb}): {result}"
