"""An inferlet's own tasks (``asyncio.create_task`` in its code): held to its deadline, and ended with it.

While an inferlet with a deadline runs, the event loop's task factory passes every task its code creates through
the watchdog, with the time the run has left: a task's context is copied from its creator's, so the run's
:class:`InferletTasks` is found in it. When ``main`` ends, its tasks still running are ended with it
(:func:`end_tasks`): cancelled, and closed where they wait if they do not end within a grace period.

Its async generators are ended with it too (:func:`end_generators`): one left suspended was closed only at the
event loop's shutdown, after the run, where cleanup that awaited for ever held ``pie run`` for ever.
"""

from __future__ import annotations

import asyncio
import contextvars
import sys
import time
import weakref
from collections.abc import AsyncGenerator, Awaitable, Callable, Collection, Coroutine, Iterator
from contextlib import contextmanager
from typing import Any

from pie.inferlet.watchdog import Watchdog

CANCEL_GRACE_S = 1.0
"""How long a task of an inferlet past its time (or past its end) has to end once cancelled before it is closed."""

_RUN: contextvars.ContextVar[InferletTasks | None] = contextvars.ContextVar("pie_inferlet_tasks", default=None)
_FACTORIES: dict[asyncio.AbstractEventLoop, tuple[Any, int]] = {}
"""Per event loop: the task factory installed before ours, and how many runs hold ours."""
_GENERATOR_HOOKS: dict[asyncio.AbstractEventLoop, Any] = {}
"""Per event loop: the async generator hooks (``sys.get_asyncgen_hooks``) in place before ours."""


class InferletTasks:
    """The tasks one inferlet run has started, each watched to the run's deadline."""

    def __init__(self, watchdog: Watchdog, deadline: float):
        self.watchdog = watchdog
        self.deadline = deadline
        self.started: set[asyncio.Task[Any]] = set()
        self.generators: weakref.WeakSet[AsyncGenerator[Any, Any]] = weakref.WeakSet()
        """The async generators its code began iterating."""
        self._main_pending = False

    def start_main(self, program: Awaitable[Any]) -> asyncio.Task[Any]:
        """The task of the inferlet's ``main`` (already watched): its context carries this run, so that what its code
        starts is held too."""
        context = contextvars.copy_context()
        context.run(_RUN.set, self)
        self._main_pending = True  # the factory passes the next task it makes (this one) as it is
        return context.run(asyncio.ensure_future, program)

    def _make(self, loop: asyncio.AbstractEventLoop, coroutine: Coroutine[Any, Any, Any], **options: Any) -> Any:
        if self._main_pending:
            self._main_pending = False
            return _plain(loop, coroutine, **options)
        remaining = max(self.deadline - time.monotonic(), 0.0)
        task = _plain(loop, _awaiting(self.watchdog.watch(coroutine, remaining)), **options)
        self.started.add(task)
        task.add_done_callback(self._ended)
        return task

    def _ended(self, task: asyncio.Task[Any]) -> None:
        self.started.discard(task)
        if not task.cancelled():
            task.exception()  # seen: a task of the inferlet's fails as its own code says, not as the host's


@contextmanager
def held_tasks(watchdog: Watchdog, timeout_s: float) -> Iterator[InferletTasks]:
    """A run's tasks, held while the block runs (the factory stays installed while any run of the loop is in one)."""
    loop = asyncio.get_running_loop()
    previous, holders = _FACTORIES.get(loop, (loop.get_task_factory(), 0))
    if not holders:
        loop.set_task_factory(_factory)  # type: ignore[arg-type]  # the options are the keywords of the Python it runs on
        hooks = _GENERATOR_HOOKS[loop] = sys.get_asyncgen_hooks()  # this thread's: the loop's while it runs
        sys.set_asyncgen_hooks(firstiter=_noting_generators(hooks.firstiter), finalizer=hooks.finalizer)
    _FACTORIES[loop] = (previous, holders + 1)
    try:
        yield InferletTasks(watchdog, time.monotonic() + timeout_s)
    finally:
        previous, holders = _FACTORIES.pop(loop)
        if holders > 1:
            _FACTORIES[loop] = (previous, holders - 1)
        else:
            loop.set_task_factory(previous)
            hooks = _GENERATOR_HOOKS.pop(loop)
            sys.set_asyncgen_hooks(firstiter=hooks.firstiter, finalizer=hooks.finalizer)


async def end_tasks(tasks: Collection[asyncio.Task[Any]]) -> bool:
    """Cancel ``tasks``; those not ended ``CANCEL_GRACE_S`` later (cleanup that awaits for ever, a loop catching its
    cancellation) are closed where they wait. Whether every one ended of its own accord."""
    pending = [task for task in tasks if not task.done()]
    for task in pending:
        task.cancel()
    ended = True
    if pending:
        _, stuck = await asyncio.wait(pending, timeout=CANCEL_GRACE_S)
        ended = not stuck
        for task in stuck:
            try:
                task.get_coro().close()  # GeneratorExit where it waits; code that awaits even then is left closed
            except RuntimeError:
                pass
            task.cancel()  # the closed task ends at its next step, here, not at the event loop's shutdown
        if stuck:
            await asyncio.wait(stuck, timeout=CANCEL_GRACE_S)
    for task in pending:
        if task.done() and not task.cancelled():
            task.exception()  # seen: what it raised on the way out is not the run's
    return ended


async def end_generators(run: InferletTasks) -> None:
    """Close the run's async generators still suspended (their ``finally`` blocks run now), as the event loop does at
    its shutdown: the cleanup is the run's code, held to ``CANCEL_GRACE_S`` and ended as a task's is. What a cleanup
    raises goes to the event loop's exception handler, as at the loop's shutdown."""
    loop = asyncio.get_running_loop()
    closing = {
        _plain(loop, _awaiting(run.watchdog.watch(generator.aclose(), CANCEL_GRACE_S))): generator  # type: ignore[arg-type]
        for generator in list(run.generators)
        if generator.ag_frame is not None and not generator.ag_running  # begun, not finished, not being iterated
    }
    if not closing:
        return
    closed, _ = await asyncio.wait(closing, timeout=CANCEL_GRACE_S)
    for task in closed:
        if not task.cancelled() and task.exception() is not None:
            loop.call_exception_handler({
                "message": f"an error occurred during closing of asynchronous generator {closing[task]!r}",
                "exception": task.exception(),
                "asyncgen": closing[task],
            })
    await end_tasks(closing.keys() - closed)


def _noting_generators(then: Callable[[AsyncGenerator[Any, Any]], Any] | None) -> Callable[..., None]:
    """A ``firstiter`` hook: an async generator begun in a run's code is noted as the run's, then ``then`` (the
    event loop's hook, which closes it at the loop's shutdown) is called."""

    def first_iteration(generator: AsyncGenerator[Any, Any]) -> None:
        run = _RUN.get()
        if run is not None:
            run.generators.add(generator)
        if then is not None:
            then(generator)

    return first_iteration


def _factory(loop: asyncio.AbstractEventLoop, coroutine: Coroutine[Any, Any, Any], **options: Any) -> Any:
    run = _RUN.get()
    if run is None:
        return _plain(loop, coroutine, **options)
    return run._make(loop, coroutine, **options)


def _plain(loop: asyncio.AbstractEventLoop, coroutine: Coroutine[Any, Any, Any], **options: Any) -> Any:
    previous = _FACTORIES[loop][0] if loop in _FACTORIES else None
    if previous is not None:
        return previous(loop, coroutine, **options)
    return asyncio.Task(coroutine, loop=loop, **options)


async def _awaiting(awaitable: Awaitable[Any]) -> Any:
    return await awaitable
