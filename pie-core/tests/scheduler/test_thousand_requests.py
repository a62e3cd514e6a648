"""1,000 randomly sized requests against a page pool a quarter of their demand: nothing lost."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import numpy as np
import pytest
from pie.runtime.model_runner import ModelRunner
from pie.scheduler import BatchScheduler, HostPagePool, RequestTooLarge, Scheduler, SchedulerConfig, generate

PAGE_SIZE = 4


def test_thousand_requests_all_complete_exactly(
    make_runner: Callable[..., ModelRunner], greedy_alone: Callable[..., list[int]]
) -> None:
    rng = np.random.default_rng(0)
    vocab = make_runner(pages=4).config.vocab_size
    requests = [(rng.integers(3, vocab, rng.integers(1, 25)).tolist(), int(rng.integers(1, 17))) for _ in range(1000)]
    demand = sum(-(-(len(prompt) + n - 1) // PAGE_SIZE) for prompt, n in requests)
    pool_pages = demand // 4

    alone = make_runner(pages=16, page_size=PAGE_SIZE)
    expected = [greedy_alone(alone, prompt, n) for prompt, n in requests]

    runner = make_runner(pages=pool_pages, page_size=PAGE_SIZE)
    # A host pool too small for every victim: some preemptions swap, the rest recompute.
    host = HostPagePool.for_runner(runner, num_pages=demand // 256)
    scheduler = Scheduler(
        BatchScheduler(runner, host, SchedulerConfig(max_batch_tokens=2048, max_batch_sequences=1024, prefill_chunk=16))
    )
    # Three requests that can never fit, submitted among the others.
    huge = [([5] * (pool_pages * PAGE_SIZE), 8) for _ in range(3)]
    submitted = requests[:500] + huge + requests[500:]

    async def serve() -> list[list[int] | BaseException]:
        return await asyncio.gather(
            *(generate(scheduler, prompt, max_tokens=n) for prompt, n in submitted), return_exceptions=True
        )

    results = asyncio.run(serve())
    failures = results[500:503]
    got = results[:500] + results[503:]

    for failure in failures:
        assert isinstance(failure, RequestTooLarge)
        assert f"whole pool has {pool_pages} pages" in str(failure)
        assert f"needs {failure.pages} KV pages" in str(failure)
    assert got == expected

    stats = scheduler.core.stats
    assert stats.preemptions > 0
    assert stats.swap_outs > 0 and stats.swap_ins == stats.swap_outs
    assert stats.pages_swapped_out >= stats.swap_outs and stats.pages_swapped_in == stats.pages_swapped_out
    assert stats.recomputes > 0 and stats.recomputed_tokens > 0
    assert stats.preemptions == stats.swap_outs + stats.recomputes
    assert stats.too_large == 3
    # Chunked prefill and batching happened.
    assert stats.largest_batch > 100
    assert stats.steps < sum(n for _, n in requests) // 10
    # Nothing leaked, on the device or in the host pool.
    assert runner.pages.free_count == runner.pages.num_pages
    assert host.free_count == host.num_pages
    assert scheduler.core.sequences() == []


def test_every_request_larger_than_pool_fails_alone(make_runner: Callable[..., ModelRunner]) -> None:
    runner = make_runner(pages=4, page_size=PAGE_SIZE)
    scheduler = Scheduler(BatchScheduler(runner))
    with pytest.raises(RequestTooLarge, match=r"needs 5 KV pages of 4 tokens, but the whole pool has 4 pages"):
        asyncio.run(generate(scheduler, [3] * 17, max_tokens=2))
    assert runner.pages.free_count == 4
