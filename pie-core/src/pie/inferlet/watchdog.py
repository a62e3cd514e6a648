"""Stopping an inferlet whose code runs past its deadline without ever awaiting.

An asyncio task gives the event loop back only at an ``await``: an inferlet stuck in
a pure-Python loop (``while True: pass``) holds the loop, and with it the batch
scheduler and every other inferlet, and ``asyncio.wait_for`` cannot fire. So each
inferlet's coroutine runs through :class:`Watchdog.watch`, which notes when one of
its steps (the code between two awaits) is running. A watchdog thread that finds a
step still running past the inferlet's deadline raises :class:`InferletStalled` in
the event loop's thread through CPython's asynchronous exceptions
(``PyThreadState_SetAsyncExc``), which land at the next bytecode boundary: inside
the stuck loop. The exception derives from BaseException so that ``except
Exception`` in the inferlet does not swallow it, and it is raised again every
:data:`REPEAT_S` for as long as the step goes on. A blocking call into C (a
``time.sleep(1e9)``) is not interrupted until it returns.
"""

from __future__ import annotations

import ctypes
import signal
import threading
import time
from collections.abc import Coroutine, Generator, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

POLL_S = 0.02
"""How often the watchdog thread looks at the running steps."""
REPEAT_S = 0.1
"""How long after raising the watchdog raises again in a step that swallowed the exception."""


class InferletStalled(BaseException):
    """Raised inside an inferlet whose code ran past its deadline without awaiting."""


class UserInterrupt(KeyboardInterrupt):
    """The user's Ctrl-C, raised where an inferlet's code was running (see :func:`interrupts_stop_inferlets`): told
    apart from a KeyboardInterrupt the inferlet raises itself, which is its failure."""


@contextmanager
def interrupts_stop_inferlets(watchdog: Watchdog) -> Iterator[None]:
    """While the block runs, a SIGINT that lands while an inferlet's code runs raises :class:`UserInterrupt` there at
    once; at any other time the handler before this one acts (``asyncio.run``'s: cancel the main task). That one
    alone waits for the inferlet's next await, which code that never awaits does not reach.

    Only in the main thread (the one signals reach), and only where SIGINT has a Python handler (not ignored)."""
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or not callable(previous):
        yield
        return

    def interrupt(signum: int, frame: FrameType | None) -> None:
        if watchdog.running_here():
            raise UserInterrupt
        previous(signum, frame)

    signal.signal(signal.SIGINT, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _raise_in_thread(thread_id: int, exception: type[BaseException]) -> None:
    """Make ``thread_id`` raise ``exception`` at its next bytecode boundary (in place of one pending there)."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), ctypes.py_object(exception))


class _Discarded(BaseException):
    """What takes the place of a raise still pending as a step ends, to land at once and be dropped."""


def _land() -> None:
    """A Python call: its start is where CPython delivers a raise pending in this thread."""


def _discard_pending_raise() -> None:
    """Drop an InferletStalled still pending in this thread. Cancelling it (``PyThreadState_SetAsyncExc`` with NULL)
    leaves CPython 3.11's eval breaker signalled for good, and every call made under ``sys.settrace`` after that (a
    debugger, coverage) spins at its first line for ever; so another exception replaces it, to land here and be
    caught."""
    try:
        _raise_in_thread(threading.get_ident(), _Discarded)
        _land()
    except _Discarded:
        pass


class _Step:
    """Whether one inferlet's code is running now, in which thread, and until when it may."""

    def __init__(self, deadline: float):
        self.deadline = deadline
        self.lock = threading.Lock()
        self.thread_id: int | None = None
        self.raised_at: float | None = None

    def enter(self) -> None:
        with self.lock:
            self.thread_id = threading.get_ident()

    def leave(self) -> None:
        """In the step's own thread, as it ends."""
        with self.lock:
            self.thread_id = None
            if self.raised_at is not None:
                # A raise still pending when the step ended must not land in the event loop's code.
                _discard_pending_raise()
                self.raised_at = None

    def stop_if_overdue(self, now: float) -> None:
        with self.lock:
            if self.thread_id is None or now < self.deadline:
                return
            if self.raised_at is not None and now - self.raised_at < REPEAT_S:
                return
            self.raised_at = now
            _raise_in_thread(self.thread_id, InferletStalled)


class _Watched:
    """Awaitable running ``coroutine`` step by step, each step inside ``step.enter()``/``leave()``."""

    def __init__(self, coroutine: Coroutine[Any, Any, Any], step: _Step, steps: set[_Step]):
        self.coroutine = coroutine
        self.step = step
        self.steps = steps

    def __await__(self) -> Generator[Any, Any, Any]:
        coroutine, step = self.coroutine, self.step
        value: Any = None
        thrown: BaseException | None = None
        try:
            while True:
                step.enter()
                try:
                    if thrown is not None:
                        error, thrown = thrown, None
                        yielded = coroutine.throw(error)
                    else:
                        yielded = coroutine.send(value)
                except StopIteration as done:
                    return done.value
                finally:
                    step.leave()
                try:
                    value = yield yielded
                except BaseException as error:  # cancellation or close, passed on to the inferlet
                    thrown, value = error, None
        finally:
            self.steps.discard(step)
            coroutine.close()


class Watchdog:
    """One thread watching every running inferlet's steps, alive while there are any."""

    def __init__(self) -> None:
        self._steps: set[_Step] = set()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def watch(self, coroutine: Coroutine[Any, Any, Any], timeout_s: float) -> _Watched:
        """``coroutine`` as an awaitable whose steps are stopped once ``timeout_s`` from now has passed."""
        return _Watched(coroutine, self._step(timeout_s), self._steps)

    @contextmanager
    def running(self, timeout_s: float) -> Iterator[None]:
        """Plain code in this thread (an inferlet's import) as one step, stopped once ``timeout_s`` has passed."""
        step = self._step(timeout_s)
        step.enter()
        try:
            yield
        finally:
            step.leave()
            self._steps.discard(step)

    def running_here(self) -> bool:
        """Whether an inferlet's code (a step, or its import) is running in this thread now. Safe in a signal handler:
        it takes no lock."""
        here = threading.get_ident()
        return any(step.thread_id == here for step in tuple(self._steps))

    def _step(self, timeout_s: float) -> _Step:
        step = _Step(time.monotonic() + timeout_s)
        with self._lock:
            self._steps.add(step)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="pie-inferlet-watchdog", daemon=True)
                self._thread.start()
        return step

    def _run(self) -> None:
        while True:
            time.sleep(POLL_S)
            with self._lock:
                if not self._steps:
                    self._thread = None
                    return
                steps = list(self._steps)
            now = time.monotonic()
            for step in steps:
                step.stop_if_overdue(now)
