"""A cancelled ``Scheduler.forward`` leaves its sequence as it was, whenever the cancel lands."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import numpy as np
import pytest
from pie.runtime.model_runner import ModelRunner, SequenceWork
from pie.scheduler import BatchScheduler, Scheduler


def test_a_cancel_that_lands_after_the_pass_completed_rolls_it_back(
    make_runner: Callable[..., ModelRunner], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The step delivered the pass's logits, and the awaiting task was cancelled before it resumed (a deadline or a
    client's cancel in the same turn of the event loop). The cancel found no pass left to withdraw, so the tokens
    stayed in the sequence while its caller, told the pass was cancelled, sent them again (an inferlet's context
    then held them twice)."""
    core = BatchScheduler(make_runner(pages=16))
    scheduler = Scheduler(core)
    seq = scheduler.new_sequence()

    async def scenario() -> np.ndarray | None:
        await scheduler.forward(seq, [3, 4, 5])
        task = asyncio.ensure_future(scheduler.forward(seq, [6, 7]))
        deliver = core._flush_deliveries

        def deliver_then_cancel() -> None:
            deliver()
            task.cancel()
            monkeypatch.undo()

        monkeypatch.setattr(core, "_flush_deliveries", deliver_then_cancel)
        with pytest.raises(asyncio.CancelledError):
            await task
        assert seq.history == [3, 4, 5] and seq.kv_length == 3
        return await scheduler.forward(seq, [6, 7])

    logits = asyncio.run(scenario())
    reference = make_runner(pages=16)
    pages = reference.new_sequence()
    expected = [reference.step([SequenceWork(pages, chunk)])[0] for chunk in ([3, 4, 5], [6, 7])][1]
    np.testing.assert_allclose(logits, expected, rtol=1e-5, atol=1e-5)
