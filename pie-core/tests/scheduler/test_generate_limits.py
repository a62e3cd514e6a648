"""``generate`` refuses a request that could never complete before any pass of it runs."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from pie.runtime.model_runner import ModelRunner
from pie.scheduler import BatchScheduler, PastContext, Scheduler, generate

PROMPT = list(range(3, 253))
"""250 tokens of the tiny model's context of 256."""


@pytest.mark.parametrize("max_tokens", [8, 20])
def test_a_request_past_the_context_is_refused_before_any_pass_runs(
    make_runner: Callable[..., ModelRunner], max_tokens: int
) -> None:
    """It ran, streamed tokens, then failed partway with PastContext (the scheduler's refusal of the pass that
    crossed the context), and the tokens streamed were lost with it."""
    runner = make_runner(pages=300)  # room for 1,200 tokens: the context is the only limit
    scheduler = Scheduler(BatchScheduler(runner))
    streamed: list[int] = []
    longest = len(PROMPT) + max_tokens - 1
    message = (
        f"the prompt \\(250 tokens\\) and max_tokens \\({max_tokens}\\) would take the sequence to {longest} tokens, "
        "past the model's context of 256"
    )
    with pytest.raises(PastContext, match=message):
        asyncio.run(generate(scheduler, PROMPT, max_tokens=max_tokens, on_token=streamed.append))
    assert streamed == [] and scheduler.core.stats.steps == 0
    assert runner.pages.free_count == runner.pages.num_pages and scheduler.core.sequences() == []


def test_a_request_that_ends_at_the_context_runs(
    make_runner: Callable[..., ModelRunner], greedy_alone: Callable[..., list[int]]
) -> None:
    """The last token is sampled, never fed back: it needs no position, so 250 + 7 tokens fit a context of 256."""
    runner = make_runner(pages=300)
    tokens = asyncio.run(generate(Scheduler(BatchScheduler(runner)), PROMPT, max_tokens=7))
    assert tokens == greedy_alone(make_runner(pages=300), PROMPT, 7)
