"""An inferlet's code may not fork pie's process: ``os.fork`` and ``os.forkpty`` raise PermissionError in it.

Refused rather than let the child go on, because the child is a copy of pie's process: its event loop, its
scheduler and the work in flight, without pie's threads (a fork copies only the calling thread: the watchdog and
the grammar's mask thread stay behind). A child that came back to pie went on as a second pie: under ``pie run`` it
printed a second result, and its event loop shares the parent's epoll set, whose events it can take. Served, the
sandbox refuses new processes to a worker (seccomp): refusing here too keeps an inferlet's behaviour the same under
``pie run``. Starting a program needs no fork of pie: ``subprocess`` starts its child without ``os.fork`` (under
``pie run``; a served worker may start none). ``multiprocessing``'s default (``fork``) context is refused with it.

The refusal holds where the inferlet's code runs (its import, its ``main`` and the tasks and callbacks it starts,
which copy its context), not in other threads: an application that runs inferlets beside its own code still forks,
and so does a thread the inferlet starts (a thread does not take its starter's context), whose child ends when the
thread's function returns.
"""

from __future__ import annotations

import contextvars
import errno
import functools
import os
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

T = TypeVar("T")

REFUSAL = (
    "an inferlet may not fork pie's process (the child would go on as a second pie, sharing the event loop's "
    "descriptors, without pie's threads); start a program with subprocess"
)

_IN_INFERLET: contextvars.ContextVar[bool] = contextvars.ContextVar("pie_inferlet_code", default=False)
_guarded = False


@contextmanager
def forks_refused() -> Iterator[None]:
    """Run the block as an inferlet's code: ``os.fork`` and ``os.forkpty`` refuse in it and in what it starts."""
    _guard_forks()
    token = _IN_INFERLET.set(True)
    try:
        yield
    finally:
        try:
            _IN_INFERLET.reset(token)
        except ValueError:  # ended from another context (a coroutine closed from outside): nothing to undo there
            pass


async def without_forks(run: Awaitable[T]) -> T:
    """Await ``run`` (an inferlet's ``main``) as an inferlet's code (see :func:`forks_refused`)."""
    with forks_refused():
        return await run


def _guard_forks() -> None:
    """Put the guard in front of ``os.fork`` and ``os.forkpty``, once: outside an inferlet's code it forks."""
    global _guarded
    if _guarded:
        return
    for name in ("fork", "forkpty"):
        fork = getattr(os, name, None)
        if fork is not None:
            setattr(os, name, _refusing_in_inferlets(fork))
    _guarded = True


def _refusing_in_inferlets(fork: Callable[[], T]) -> Callable[[], T]:
    @functools.wraps(fork)
    def guarded() -> T:
        if _IN_INFERLET.get():
            raise PermissionError(errno.EPERM, REFUSAL)
        return fork()

    return guarded
