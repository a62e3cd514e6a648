"""How every `pie` command reports what a user got wrong: one red line on stderr, and an exit status.

The statuses, the same for every command:

- 1: the work failed: a file (missing, unreadable, or its contents), the model, an engine, memory, an
  inferlet that raised;
- 2: the command line is wrong in itself, as seen before any file is looked at: an option's value out of its
  range or malformed, options that do not go together, an argument missing or extra (click's own usage
  errors exit 2 as well);
- 70: an internal error (a bug in pie), 130 and 143: interrupted (SIGINT, SIGTERM).
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import typer

USAGE_ERROR_EXIT = 2
TERMINATED_EXIT = 143
"""128 + SIGTERM."""


class Terminated(KeyboardInterrupt):
    """A SIGTERM, raised where the main thread is, as a Ctrl-C raises KeyboardInterrupt (see :func:`sigterm_interrupts`)."""


@contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """Within: a SIGTERM (``timeout``, a service manager, ``kill``) raises :class:`Terminated`, so a command that keeps
    its work on a Ctrl-C keeps it then too, instead of dying where it stands. The handler before is put back after."""

    def terminate(signum: int, frame: Any) -> None:
        raise Terminated

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def fail(message: object) -> typer.Exit:
    """Print ``pie: MESSAGE`` and return the Exit (status 1) to raise (``raise fail(...) from exc``)."""
    typer.secho(f"pie: {message}", err=True, fg=typer.colors.RED)
    return typer.Exit(1)


def usage(message: object) -> typer.Exit:
    """As :func:`fail`, for a command line that is wrong in itself: status 2."""
    typer.secho(f"pie: {message}", err=True, fg=typer.colors.RED)
    return typer.Exit(USAGE_ERROR_EXIT)


def utf8_argument(text: str, what: str) -> str:
    """``text`` from the command line; Python keeps bytes that are not UTF-8 as lone surrogates, refused here
    (a ValueError naming ``what``)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{what} is not valid UTF-8 (character {exc.start + 1} is not)") from None
    return text


def path_argument(text: str, what: str, wanted: str) -> str:
    """``text``, the path ``what`` from the command line; a usage error asking for ``wanted`` when it is empty or
    blank (``"$FILE"`` of an unset variable): a Path takes "" for the current folder, and it was used as that."""
    if not text.strip():
        raise usage(f"{what} is empty: give {wanted}")
    return text
