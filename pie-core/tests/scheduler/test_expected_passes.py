"""Passes announced by Scheduler.expect (an inferlet worker's next pass) join the next step when they come in time."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from pie.runtime.model_runner import ModelRunner
from pie.scheduler import BatchScheduler, Scheduler, driver


def test_an_expected_pass_that_comes_soon_joins_the_step(
    make_runner: Callable[..., ModelRunner], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(driver, "REMOTE_SETTLE_S", 60.0)  # the wait ends when the pass comes, not by the clock
    scheduler = Scheduler(BatchScheduler(make_runner(64)))

    async def scenario() -> None:
        first, second = scheduler.new_sequence(), scheduler.new_sequence()
        loop = asyncio.get_running_loop()
        scheduler.expect()
        late: list[asyncio.Future[object]] = []

        def send() -> None:  # as a worker's forward message would, a few loop turns and a millisecond later
            late.append(asyncio.ensure_future(scheduler.forward(second, [4, 5, 6])))
            scheduler.arrived()

        loop.call_later(0.02, send)
        await scheduler.forward(first, [1, 2, 3])
        await late[0]

    asyncio.run(scenario())
    assert scheduler.core.stats.steps == 1 and scheduler.core.stats.largest_batch == 2


def test_an_expected_pass_that_does_not_come_delays_one_step_only(make_runner: Callable[..., ModelRunner]) -> None:
    scheduler = Scheduler(BatchScheduler(make_runner(64)))

    async def scenario() -> None:
        seq = scheduler.new_sequence()
        scheduler.expect()  # never comes
        await scheduler.forward(seq, [1, 2, 3])
        assert scheduler._expected == 0  # given up on: the next steps do not wait for it
        await scheduler.forward(seq, [4])

    asyncio.run(scenario())
    assert scheduler.core.stats.steps == 2
