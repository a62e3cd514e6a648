"""The asyncio face of the batch scheduler: awaitable passes and one task that fires the steps.

Many coroutines (inferlets, requests) await passes; the driver task runs one
batched step as soon as the previous one returned and the woken coroutines
have had their turn to queue their next pass (adaptive firing: no timer, no
fixed batch size).
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable
from collections.abc import Sequence as Seq

from pie.runtime.model_runner import ModelRunner
from pie.scheduler.core import BatchScheduler, Pass, PassResult, SchedulerConfig, Sequence
from pie.scheduler.offload import HostPagePool

SETTLE_ROUNDS = 8
"""Most event-loop turns the driver waits, before a step, for woken coroutines to queue more work."""
REMOTE_SETTLE_S = 0.010
"""Longest the driver waits, before a step, for passes announced by :meth:`Scheduler.expect` (callers in other
processes, answered by the last step, whose next passes cannot arrive within the event loop's turns); those
still missing then are not waited for again."""


class Scheduler:
    """Awaitable forward passes over a :class:`BatchScheduler`, batched across every caller."""

    def __init__(self, core: BatchScheduler, on_settled: Callable[[], None] | None = None):
        """``on_settled`` runs each time the coroutines a step woke have had their turn, before the next step
        or before the driver goes idle: a server hands on each step's tokens from there, once per step."""
        self.core = core
        self.on_settled = on_settled
        self._loop: asyncio.AbstractEventLoop | None = None
        self._expected = 0
        self._arrived: asyncio.Event | None = None
        self._driver: asyncio.Task[None] | None = None

    @classmethod
    def create(cls, runner: ModelRunner, *, host_pages: int = 0, config: SchedulerConfig | None = None) -> Scheduler:
        """A scheduler over ``runner``; ``host_pages`` > 0 adds a host page pool for swapping."""
        host = HostPagePool.for_runner(runner, host_pages) if host_pages > 0 else None
        return cls(BatchScheduler(runner, host, config))

    @property
    def runner(self) -> ModelRunner:
        return self.core.runner

    def new_sequence(self, priority: int = 0, cache_salt: str | None = None) -> Sequence:
        return self.core.new_sequence(priority, cache_salt)

    async def forward(
        self, seq: Sequence, tokens: Seq[int], *, logits: bool = True, all_logits: bool = False, top: int = 0
    ) -> PassResult:
        """Append ``tokens`` to ``seq``'s KV cache in a batched step; returns the next-token logits
        (``[len(tokens), vocab]`` with ``all_logits``; None when ``logits`` is False), or with ``top``
        maybe the most likely tokens instead (see ``BatchScheduler.submit``)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[PassResult] = loop.create_future()

        def done(result: PassResult, error: BaseException | None) -> None:
            if future.done():
                return
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)

        pending: Pass = self.core.submit(seq, tokens, done, logits=logits, all_logits=all_logits, top=top)
        self._ensure_driver(loop)
        try:
            return await future
        except asyncio.CancelledError:
            self.core.cancel(seq, pending)
            raise

    def expect(self, passes: int = 1) -> None:
        """``passes`` more passes are on their way from callers the driver cannot see run (an inferlet's worker
        process just given its pass's result): the next step waits up to ``REMOTE_SETTLE_S`` for them, so that
        they join it, as an in-process caller's next pass does."""
        self._expected += passes

    def arrived(self, passes: int = 1) -> None:
        """What :meth:`expect` announced has come (or will not: its caller ended)."""
        self._expected = max(self._expected - passes, 0)
        if not self._expected and self._arrived is not None:
            self._arrived.set()

    def _ensure_driver(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._loop is not loop or self._driver is None or self._driver.done():
            self._loop = loop
            # Made in a context of its own: it serves every caller, not the one whose pass started it (an
            # inferlet's context would have it held to that inferlet's deadline and ended with it).
            self._driver = contextvars.Context().run(loop.create_task, self._drive(), name="pie-scheduler")

    async def _drive(self) -> None:
        """Step while there is work; then end (the next pass starts another driver), so an idle scheduler
        holds no task that its event loop would have to cancel."""
        core = self.core
        while True:
            await self._settle()
            if self.on_settled is not None:
                self.on_settled()
            if not core.has_work():
                return
            try:
                core.step()
            except Exception as exc:
                core.fail_all(exc)

    async def _settle(self) -> None:
        """Let coroutines woken by the last step queue their next passes before the next step fires, and wait
        (a little) for the passes other processes were announced to send."""
        await self._settle_rounds()
        if self._expected:
            self._arrived = asyncio.Event()
            try:
                await asyncio.wait_for(self._arrived.wait(), REMOTE_SETTLE_S)
            except TimeoutError:
                self._expected = 0  # late ones: the next steps do not wait for them again
            finally:
                self._arrived = None
            await self._settle_rounds()

    async def _settle_rounds(self) -> None:
        for _ in range(SETTLE_ROUNDS):
            before = self.core.submissions
            await asyncio.sleep(0)
            if self.core.submissions == before:
                return
