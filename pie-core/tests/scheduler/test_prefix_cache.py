"""Automatic prefix caching in the batch scheduler: reuse, eviction, and results identical to no cache."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from pie.runtime.model_runner import ModelRunner
from pie.scheduler import BatchScheduler, HostPagePool, SchedulerConfig, Sequence

Factory = Callable[..., ModelRunner]
SYSTEM = [3 + (i * 7) % 90 for i in range(23)]
"""A shared 'system prompt' of 23 tokens: five full pages of 4 and three tokens more."""


def run_to_end(core: BatchScheduler) -> None:
    for _ in range(10_000):
        if not core.step():
            return
    raise AssertionError("the scheduler never went idle")


def greedy(core: BatchScheduler, prompt: list[int], count: int, cache_salt: str | None = None) -> tuple[Sequence, list[int]]:
    """``count`` greedy tokens after ``prompt`` through the scheduler (the sequence is left live)."""
    seq = core.new_sequence(cache_salt=cache_salt)
    out: list[int] = []
    rows: list[np.ndarray] = []
    core.submit(seq, prompt, lambda logits, error: rows.append(logits))
    while True:
        run_to_end(core)
        out.append(int(np.argmax(rows[-1])))
        if len(out) == count:
            return seq, out
        core.submit(seq, [out[-1]], lambda logits, error: rows.append(logits))


def test_a_second_request_with_the_same_prefix_reuses_its_pages_and_gets_the_same_tokens(
    make_runner: Factory, greedy_alone: Callable[..., list[int]]
) -> None:
    runner = make_runner(pages=64)
    core = BatchScheduler(runner)
    first, first_tokens = greedy(core, SYSTEM + [40, 41], 6)
    assert core.stats.prefix_cached_tokens == 0
    second, second_tokens = greedy(core, SYSTEM + [50], 6)
    assert core.stats.prefix_cached_tokens == 20, "the five full pages of the shared prefix come from the cache"
    assert first.device.pages[:5] == second.device.pages[:5]
    assert all(runner.pages.refcount(page) == 2 for page in first.device.pages[:5])
    assert first_tokens == greedy_alone(make_runner(pages=64), SYSTEM + [40, 41], 6)
    assert second_tokens == greedy_alone(make_runner(pages=64), SYSTEM + [50], 6)


def test_a_salted_prompt_is_found_only_under_its_own_salt(make_runner: Factory) -> None:
    """vLLM's cache_salt: one tenant cannot tell from cached-token counts what another's prompts begin with."""
    core = BatchScheduler(make_runner(pages=64))
    greedy(core, SYSTEM + [40], 2, cache_salt="tenant-a")
    cached = []
    for salt in (None, "tenant-b", "tenant-a", None):
        before = core.stats.prefix_cached_tokens
        seq, _ = greedy(core, SYSTEM + [50], 2, cache_salt=salt)
        cached.append(core.stats.prefix_cached_tokens - before)
        forked = core.fork(seq)
        assert forked.cache_root == seq.cache_root
    assert cached == [0, 0, 20, 20], "the unsalted one of the end found the first unsalted one's pages"


def test_the_cache_on_and_off_give_identical_greedy_tokens(make_runner: Factory) -> None:
    prompts = [SYSTEM + [40 + i] * (i + 1) for i in range(5)] + [SYSTEM]
    outputs = {}
    for caching in (True, False):
        core = BatchScheduler(make_runner(pages=64), config=SchedulerConfig(prefix_caching=caching))
        outputs[caching] = []
        for prompt in prompts:
            seq, tokens = greedy(core, prompt, 8)
            core.drop(seq)
            outputs[caching].append(tokens)
        assert (core.stats.prefix_cached_tokens > 0) == caching
    assert outputs[True] == outputs[False]


def test_a_prompt_that_is_exactly_cached_still_computes_its_last_token(make_runner: Factory) -> None:
    core = BatchScheduler(make_runner(pages=32))
    prompt = SYSTEM[:20]  # five full pages
    seq, expected = greedy(core, prompt, 3)
    core.drop(seq)
    again, tokens = greedy(core, prompt, 3)
    assert core.stats.prefix_cached_tokens == 16, "four pages reused; the fifth holds the token whose logits are needed"
    assert tokens == expected


def test_a_prompt_that_waits_for_pages_is_queried_once(make_runner: Factory) -> None:
    """It was looked up each step it waited, and each lookup counted its tokens as queried again."""
    core = BatchScheduler(make_runner(pages=10), config=SchedulerConfig(max_batch_tokens=8, prefill_chunk=8))
    first, tokens = greedy(core, list(range(10, 48)), 1)  # 38 tokens: every page of the pool
    waiting = core.new_sequence()
    core.submit(waiting, list(range(100, 120)), lambda logits, error: None)  # 20 tokens: waits for pages
    for token in (tokens[-1], 7):  # two decodes fill the last page
        core.submit(first, [token], lambda logits, error: None)
        core.step()
    assert not waiting.history, "it waited"
    core.drop(first)
    run_to_end(core)
    assert waiting.history and core.stats.prefix_queried_tokens == 38 + 20


def test_released_prefixes_are_evicted_when_the_pool_needs_their_pages(make_runner: Factory) -> None:
    runner = make_runner(pages=12)
    core = BatchScheduler(runner)
    for start in range(0, 60, 10):  # six distinct 21-token prompts: 6 pages each, more than the pool holds in all
        seq, _ = greedy(core, [3 + (start + i) % 90 for i in range(21)], 2)
        core.drop(seq)
    allocator = runner.pages
    assert allocator.used_count == 0 and allocator.free_count == 12
    assert 0 < allocator.cached_count <= 12
    seq, _ = greedy(core, [3 + (50 + i) % 90 for i in range(21)], 2)
    assert core.stats.prefix_cached_tokens == 20, "the latest prompt's pages were the last to be evicted"


def test_a_recompute_preempted_sequence_restarts_from_its_cached_pages(
    make_runner: Factory, greedy_alone: Callable[..., list[int]]
) -> None:
    runner = make_runner(pages=10)
    core = BatchScheduler(runner, host=None)
    idle, idle_tokens = greedy(core, SYSTEM[:17], 2)  # 5 pages, left idle
    busy_prompt = [60 + i for i in range(21)]  # 6 pages: the idle one must go
    busy, busy_tokens = greedy(core, busy_prompt, 2)
    assert core.stats.recomputes == 1 and idle.residence == "none"
    more: list[np.ndarray] = []
    core.drop(busy)
    core.submit(idle, [idle_tokens[-1]], lambda logits, error: more.append(logits))
    run_to_end(core)
    assert core.stats.replay_cached_tokens > 0
    expected = greedy_alone(make_runner(pages=10), SYSTEM[:17], 3)
    assert idle_tokens + [int(np.argmax(more[-1]))] == expected
    assert busy_tokens == greedy_alone(make_runner(pages=10), busy_prompt, 2)


def test_a_failed_pass_that_started_from_the_cache_gives_its_pages_back(make_runner: Factory) -> None:
    runner = make_runner(pages=32)
    core = BatchScheduler(runner)
    seq, _ = greedy(core, SYSTEM, 1)
    core.drop(seq)
    cached = runner.pages.cached_count
    errors: list[BaseException | None] = []
    broken = core.new_sequence()
    core.submit(broken, SYSTEM + [44], lambda logits, error: errors.append(error))

    def fail(batch: object) -> np.ndarray:
        raise RuntimeError("kernel exploded")

    original, runner.forward = runner.forward, fail
    try:
        core.step()
    finally:
        runner.forward = original
    assert isinstance(errors[0], RuntimeError) and broken.history == [] and broken.kv_length == 0
    assert runner.pages.used_count == 0 and runner.pages.cached_count == cached


@pytest.mark.parametrize("host_pages", [0, 8])
def test_many_requests_sharing_a_prefix_under_pressure_all_match_running_alone(
    make_runner: Factory, greedy_alone: Callable[..., list[int]], host_pages: int
) -> None:
    runner = make_runner(pages=20)
    host = HostPagePool.for_runner(runner, host_pages) if host_pages else None
    core = BatchScheduler(runner, host)
    prompts = [SYSTEM + [30 + i] for i in range(8)]
    seqs = [core.new_sequence() for _ in prompts]
    outputs: list[list[int]] = [[] for _ in prompts]

    def on_logits(index: int) -> Callable[[np.ndarray | None, BaseException | None], None]:
        def done(logits: np.ndarray | None, error: BaseException | None) -> None:
            assert error is None, error
            outputs[index].append(int(np.argmax(logits)))
            if len(outputs[index]) < 6:
                core.submit(seqs[index], [outputs[index][-1]], done)

        return done

    for index, prompt in enumerate(prompts):
        core.submit(seqs[index], prompt, on_logits(index))
    run_to_end(core)
    reference = make_runner(pages=20)
    assert outputs == [greedy_alone(reference, prompt, 6) for prompt in prompts]
    assert core.stats.prefix_cached_tokens > 0
