"""Policies of the batch scheduler, driven step by step."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pytest
from pie.runtime.model_runner import ModelRunner, SequenceWork
from pie.scheduler import BatchScheduler, HostPagePool, RequestTooLarge, SchedulerConfig, Sequence, SequenceDropped

Factory = Callable[..., ModelRunner]


@dataclass
class Outcome:
    results: list[np.ndarray | None] = field(default_factory=list)
    errors: list[BaseException] = field(default_factory=list)

    def __call__(self, result: np.ndarray | None, error: BaseException | None) -> None:
        if error is not None:
            self.errors.append(error)
        else:
            self.results.append(result)


def submit(core: BatchScheduler, seq: Sequence, tokens: list[int], **options: bool) -> Outcome:
    outcome = Outcome()
    core.submit(seq, tokens, outcome, **options)
    return outcome


def alone_logits(runner: ModelRunner, chunks: list[list[int]]) -> list[np.ndarray]:
    """Logits after each chunk, fed to a fresh sequence one chunk per forward pass."""
    seq = runner.new_sequence()
    out = [runner.step([SequenceWork(seq, chunk)])[0] for chunk in chunks]
    seq.free()
    return out


def test_ready_passes_of_all_sequences_share_one_forward_pass(make_runner: Factory) -> None:
    runner = make_runner(pages=32)
    core = BatchScheduler(runner)
    prompts = [[5, 6, 7], [8] * 9, [11]]
    outcomes = [submit(core, core.new_sequence(), prompt) for prompt in prompts]
    assert core.step()
    assert core.stats.steps == 1 and core.stats.largest_batch == 3
    reference = make_runner(pages=32)
    for prompt, outcome in zip(prompts, outcomes, strict=True):
        (logits,) = outcome.results
        np.testing.assert_allclose(logits, alone_logits(reference, [prompt])[0], rtol=1e-5, atol=1e-5)
    assert not core.step()


@pytest.mark.parametrize("bad", [-1, "vocab", 2**31])
def test_a_token_outside_the_vocabulary_is_refused_at_submit_and_the_batch_goes_on(
    make_runner: Factory, bad: int | str
) -> None:
    """Queued, it failed the whole batch it joined (every other sequence's pass), at the embedding or at int32."""
    runner = make_runner(pages=32)
    vocab = runner.config.vocab_size
    token = vocab if bad == "vocab" else bad
    core = BatchScheduler(runner)
    good = submit(core, core.new_sequence(), [5, 6, 7])
    with pytest.raises(ValueError, match=f"token id {token} is outside the vocabulary \\(0 to {vocab - 1}\\)"):
        submit(core, core.new_sequence(), [5, token])
    while core.step():
        pass
    assert len(good.results) == 1 and not good.errors


def test_chunked_prefill_does_not_stall_a_decoding_sequence(make_runner: Factory) -> None:
    runner = make_runner(pages=64)
    core = BatchScheduler(runner, config=SchedulerConfig(max_batch_tokens=9, prefill_chunk=8))
    decoder = core.new_sequence()
    first = submit(core, decoder, [3, 4])
    core.step()
    (logits,) = first.results
    long_prompt = list(range(10, 74))
    prefill = submit(core, core.new_sequence(), long_prompt)
    decoded = [int(np.argmax(logits))]
    steps = 0
    while not prefill.results:
        step_result = submit(core, decoder, [decoded[-1]])
        core.step()
        steps += 1
        (logits,) = step_result.results  # the decode finished in this very step
        decoded.append(int(np.argmax(logits)))
    assert steps == len(long_prompt) // 8
    reference = make_runner(pages=64)
    np.testing.assert_allclose(prefill.results[0], alone_logits(reference, [long_prompt])[0], rtol=1e-5, atol=1e-5)
    expected = alone_logits(reference, [[3, 4]] + [[t] for t in decoded[:-1]])
    assert decoded == [int(np.argmax(row)) for row in expected]


@pytest.mark.parametrize("short_prefill_tokens,steps_to_the_short_answer", [(4, 1), (0, 5)])
def test_a_short_prompt_waits_a_step_for_a_long_prefill_not_all_of_it(
    make_runner: Factory, short_prefill_tokens: int, steps_to_the_short_answer: int
) -> None:
    """Without short prefills (0), the long prompt that came first takes every step's whole budget until it is done,
    and the short prompt's first token waits for all of it (24 s behind 8,000 tokens in a served test)."""
    runner = make_runner(pages=64)
    config = SchedulerConfig(max_batch_tokens=16, prefill_chunk=16, short_prefill_tokens=short_prefill_tokens)
    core = BatchScheduler(runner, config=config)
    long_prompt = list(range(10, 74))  # 64 tokens: four whole chunks
    long = submit(core, core.new_sequence(), long_prompt)
    short = submit(core, core.new_sequence(), [5, 6, 7])
    steps = 0
    while not short.results:
        core.step()
        steps += 1
    assert steps == steps_to_the_short_answer
    while not long.results:
        core.step()
    reference = make_runner(pages=64)
    np.testing.assert_allclose(short.results[0], alone_logits(reference, [[5, 6, 7]])[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(long.results[0], alone_logits(reference, [long_prompt])[0], rtol=1e-5, atol=1e-5)


def test_a_burst_of_long_prompts_keeps_whole_chunks_first_come_first_served(make_runner: Factory) -> None:
    runner = make_runner(pages=64)
    core = BatchScheduler(runner, config=SchedulerConfig(max_batch_tokens=16, prefill_chunk=16, short_prefill_tokens=4))
    outcomes = [submit(core, core.new_sequence(), list(range(10 + i, 42 + i))) for i in range(3)]  # 32 tokens each
    core.step()
    core.step()
    assert [len(outcome.results) for outcome in outcomes] == [1, 0, 0], "the first prompt's two chunks came first"


def test_higher_priority_preempts_to_the_host_pool_and_the_victim_resumes_exactly(make_runner: Factory) -> None:
    runner = make_runner(pages=6)
    host = HostPagePool.for_runner(runner, num_pages=8)
    core = BatchScheduler(runner, host)
    low = core.new_sequence(priority=0)
    submit(core, low, list(range(3, 19)))  # 16 tokens: 4 of the 6 pages
    core.step()
    kv_before = runner.pages.handle[:, low.device.pages].copy()
    urgent_seq = core.new_sequence(priority=5)
    urgent = submit(core, urgent_seq, list(range(30, 42)))  # 3 pages
    low_next = submit(core, low, [50])
    core.step()
    assert len(urgent.results) == 1 and not low_next.results
    assert low.residence == "host" and core.stats.swap_outs == 1
    np.testing.assert_array_equal(host.handle[:, low.host.pages], kv_before)
    core.drop(urgent_seq)
    core.step()
    assert low_next.results
    assert core.stats.swap_ins == 1 and low.residence == "device"
    np.testing.assert_array_equal(runner.pages.handle[:, low.device.pages[:4]], kv_before)
    expected = alone_logits(make_runner(pages=16), [list(range(3, 19)), [50]])[1]
    np.testing.assert_allclose(low_next.results[0], expected, rtol=1e-5, atol=1e-5)
    core.drop(low)
    assert runner.pages.free_count == 6 and host.free_count == 8


def test_a_swap_whose_page_copy_fails_leaves_both_pools_as_they_were(
    make_runner: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pages of the pool copied into were taken before the copy; an engine error in it left them held by no
    one, for good."""
    runner = make_runner(pages=4)
    host = HostPagePool.for_runner(runner, num_pages=4)
    device_pages = runner.new_sequence()
    device_pages.append(8, runner.pages.copy)

    def broken(*args: object) -> None:
        raise RuntimeError("page hook failed")

    with monkeypatch.context() as patch:
        patch.setattr(runner.pages, "read", broken)
        with pytest.raises(RuntimeError, match="page hook failed"):
            host.store(runner.pages, device_pages)
    assert host.free_count == 4 and runner.pages.free_count == 2
    host_pages = host.store(runner.pages, device_pages)
    assert host_pages is not None
    device_pages.free()
    with monkeypatch.context() as patch:
        patch.setattr(runner.pages, "write", broken)
        with pytest.raises(RuntimeError, match="page hook failed"):
            host.load(runner.pages, host_pages)
    assert runner.pages.free_count == 4 and host.free_count == 2 and host_pages.length == 8


def test_a_swap_out_that_fails_recomputes_its_victim_and_no_pass_fails(
    make_runner: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The copy's error left the step: every queued pass of every sequence failed with it."""
    runner = make_runner(pages=6)
    core = BatchScheduler(runner, HostPagePool.for_runner(runner, num_pages=8))
    low = core.new_sequence(priority=0)
    submit(core, low, list(range(3, 19)))  # 4 of the 6 pages
    core.step()
    bystander = core.new_sequence(priority=3)
    bystander_out = submit(core, bystander, [70, 71])
    urgent = submit(core, core.new_sequence(priority=5), list(range(30, 38)))  # 2 pages: one more than is free
    low_next = submit(core, low, [50])

    def broken(*args: object) -> None:
        raise RuntimeError("page hook failed")

    with monkeypatch.context() as patch:
        patch.setattr(runner.pages, "read", broken)
        core.step()
    assert urgent.results and bystander_out.results and not urgent.errors and not bystander_out.errors
    assert core.stats.swap_failures == 1 and core.stats.recomputes == 1 and core.stats.swap_outs == 0
    while not low_next.results:
        core.step()
    assert not low_next.errors
    expected = alone_logits(make_runner(pages=16), [list(range(3, 19)), [50]])[1]
    np.testing.assert_allclose(low_next.results[0], expected, rtol=1e-5, atol=1e-5)


def test_a_swap_in_that_fails_recomputes_the_sequence_and_the_batch_goes_on(
    make_runner: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The copy's error failed the pass of every sequence in the batch the swapped sequence had joined."""
    runner = make_runner(pages=6)
    host = HostPagePool.for_runner(runner, num_pages=8)
    core = BatchScheduler(runner, host)
    low = core.new_sequence(priority=0)
    submit(core, low, list(range(3, 19)))
    core.step()
    urgent_seq = core.new_sequence(priority=5)
    submit(core, urgent_seq, list(range(30, 42)))
    core.step()
    assert low.residence == "host"
    core.drop(urgent_seq)
    low_next = submit(core, low, [50])
    other = submit(core, core.new_sequence(), [80, 81])
    real_write = runner.pages.write

    def fails_once(*args: object) -> None:
        monkeypatch.setattr(runner.pages, "write", real_write)
        raise RuntimeError("page hook failed")

    monkeypatch.setattr(runner.pages, "write", fails_once)
    while not (low_next.results or low_next.errors):
        core.step()
    assert other.results and not other.errors and not low_next.errors
    assert core.stats.swap_failures == 1 and core.stats.swap_ins == 0 and host.free_count == 8
    expected = alone_logits(make_runner(pages=16), [list(range(3, 19)), [50]])[1]
    np.testing.assert_allclose(low_next.results[0], expected, rtol=1e-5, atol=1e-5)


def test_recompute_when_there_is_no_host_pool(make_runner: Factory) -> None:
    runner = make_runner(pages=5)
    core = BatchScheduler(runner)
    low = core.new_sequence()
    submit(core, low, list(range(3, 15)))  # 3 pages
    core.step()
    high = core.new_sequence(priority=1)
    high_out = submit(core, high, list(range(20, 32)))  # 3 pages: low must go
    core.step()
    assert high_out.results and low.residence == "none" and core.stats.recomputes == 1
    core.drop(high)
    resumed = submit(core, low, [60])
    while not resumed.results:
        core.step()
    # high took the 2 free pages and evicted 1 of low's 3 cached ones, its last: the first 2 are found again
    assert core.stats.replay_cached_tokens == 8 and core.stats.recomputed_tokens == 4
    expected = alone_logits(make_runner(pages=16), [list(range(3, 15)), [60]])[1]
    np.testing.assert_allclose(resumed.results[0], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_a_sequence_without_kv_waits_while_its_pass_cannot_fit_beside_the_better_ranked_ones(
    make_runner: Factory, greedy_alone: Callable[[ModelRunner, list[int], int], list[int]], prefix_caching: bool
) -> None:
    """Eight generations that each need most of the pool: a new or recomputing sequence took the part of its pass
    the free pages held, and lost it to the next better-ranked one that grew, to compute it again: 38 preemptions
    (and 680 recomputed tokens for 480 tokens of work without prefix caching), where one at a time needs none."""
    runner = make_runner(pages=16)
    core = BatchScheduler(runner, config=SchedulerConfig(prefix_caching=prefix_caching))
    prompts = [[(7 * i + k) % 300 + 5 for k in range(40)] for i in range(8)]  # 10 pages, 15 with 20 more tokens
    generated: list[list[int]] = [[] for _ in prompts]

    def start(index: int) -> None:
        seq = core.new_sequence()

        def sampled(logits: np.ndarray | None, error: BaseException | None) -> None:
            assert error is None and logits is not None
            generated[index].append(int(np.argmax(logits)))
            if len(generated[index]) < 20:
                core.submit(seq, generated[index][-1:], sampled)
            else:
                core.drop(seq)

        core.submit(seq, prompts[index], sampled)

    for index in range(len(prompts)):
        start(index)
    for _ in range(10_000):
        if not core.step():
            break
    reference = make_runner(pages=16)
    assert generated == [greedy_alone(reference, prompt, 20) for prompt in prompts]
    assert core.stats.preemptions == 0 and core.stats.recomputed_tokens == 0
    assert runner.pages.used_count == 0


def test_nothing_is_preempted_for_a_chunk_that_would_not_fit_even_then(make_runner: Factory) -> None:
    """A sequence below was preempted, and its pages were still too few for the chunk: its work was lost for
    nothing, to be recomputed."""
    runner = make_runner(pages=12)
    core = BatchScheduler(runner)
    first, starting, last = core.new_sequence(), core.new_sequence(), core.new_sequence()
    submit(core, first, list(range(3, 33)))  # 30 tokens: 8 pages
    submit(core, last, list(range(40, 50)))  # 10 tokens: 3 pages
    assert core.step() and runner.pages.free_count == 1
    first_next, last_next = submit(core, first, [60]), submit(core, last, [61])
    prompt = list(range(70, 94))  # 6 pages: 1 free, and 3 more if the last one were preempted
    starting_prompt = submit(core, starting, prompt)
    assert core.step()
    assert core.stats.preemptions == 0 and last.residence == "device"
    assert first_next.results and last_next.results and not starting_prompt.results
    core.drop(first)
    core.drop(last)
    assert core.step()
    np.testing.assert_allclose(starting_prompt.results[0], alone_logits(make_runner(pages=12), [prompt])[0],
                               rtol=1e-5, atol=1e-5)


def test_a_sequence_whose_pages_stay_held_by_another_is_never_preempted(make_runner: Factory) -> None:
    """Preempting it frees no page, and it came back the next step to be preempted again: under KV pressure with
    a shared prompt, a thousand such preemptions in 700 steps of a served test, where a hundred did the work."""
    runner = make_runner(pages=3)
    core = BatchScheduler(runner)
    parent = core.new_sequence(priority=1)
    submit(core, parent, list(range(3, 11)))  # 2 full pages
    urgent = core.new_sequence(priority=2)
    submit(core, urgent, [20, 21])  # the third page, half full
    core.step()
    child = core.fork(parent, priority=0)  # idle, every page shared with its parent
    grows = submit(core, parent, [40])  # needs a fourth page: none is free, and the child's are its parent's too
    submit(core, urgent, [22])
    core.step()
    assert core.stats.preemptions == 0 and child.residence == "device" and not grows.results
    core.drop(urgent)
    core.step()
    assert grows.results, "it goes on once a page is free"
    expected = alone_logits(make_runner(pages=8), [list(range(3, 11)), [40]])[1]
    np.testing.assert_allclose(grows.results[0], expected, rtol=1e-5, atol=1e-5)
    resumed = submit(core, child, [50])
    while not resumed.results:
        core.step()
    assert core.stats.recomputed_tokens == 0, "the child kept its KV"


def test_a_pass_that_can_never_fit_fails_and_the_others_go_on(make_runner: Factory) -> None:
    runner = make_runner(pages=8)
    core = BatchScheduler(runner)
    grower = core.new_sequence()
    submit(core, grower, [3] * 20)
    core.step()
    too_big = submit(core, grower, [4] * 13)  # 33 tokens > 8 pages x 4
    fine = submit(core, core.new_sequence(), [5, 6])
    core.step()
    (error,) = too_big.errors
    assert isinstance(error, RequestTooLarge)
    assert "a sequence of 33 tokens needs 9 KV pages of 4 tokens, but the whole pool has 8 pages" in str(error)
    assert len(fine.results) == 1
    assert len(grower.history) == 20 and grower.device.length == 20  # unchanged by the failed pass


def test_a_failing_forward_pass_rolls_back_and_the_next_step_works(
    make_runner: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = make_runner(pages=8)
    core = BatchScheduler(runner)
    seq = core.new_sequence()
    submit(core, seq, [3, 4, 5])
    core.step()
    free = runner.pages.free_count
    original = runner.forward

    def broken(batch: object) -> np.ndarray:
        raise RuntimeError("device lost")

    monkeypatch.setattr(runner, "forward", broken)
    failed = submit(core, seq, [6, 7, 8, 9, 10])
    core.step()
    assert [str(e) for e in failed.errors] == ["device lost"]
    assert seq.device.length == 3 and seq.history == [3, 4, 5] and runner.pages.free_count == free
    monkeypatch.setattr(runner, "forward", original)
    again = submit(core, seq, [6])
    core.step()
    expected = alone_logits(make_runner(pages=8), [[3, 4, 5], [6]])[1]
    np.testing.assert_allclose(again.results[0], expected, rtol=1e-5, atol=1e-5)


def test_a_step_whose_batch_fails_to_prepare_rolls_back_that_batch_only(
    make_runner: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A copy-on-write copy raised while the batch was prepared, before the forward pass: the driver then failed
    every queued pass of every sequence, and the replayed sequence in the batch kept slots never computed."""
    runner = make_runner(pages=8)
    core = BatchScheduler(runner, config=SchedulerConfig(prefix_caching=False, max_batch_sequences=3))
    replayed = core.new_sequence()
    submit(core, replayed, [3, 4, 5, 6, 7, 8])
    core.step()
    urgent = core.new_sequence(priority=1)
    submit(core, urgent, list(range(20, 48)))  # 7 pages: the idle one is preempted, to be recomputed
    core.step()
    core.drop(urgent)
    parent = core.new_sequence()
    submit(core, parent, [9, 9, 9, 9, 9, 9])
    core.step()
    child = core.fork(parent)
    waiting = core.new_sequence(priority=-1)
    in_batch = [submit(core, seq, [40]) for seq in (replayed, parent, child)]
    left_out = submit(core, waiting, [50])

    def broken(source: int, destination: int) -> None:
        raise RuntimeError("copy_pages failed")

    with monkeypatch.context() as patch:
        patch.setattr(runner.pages, "copy", broken)
        assert core.step()
    assert [[str(e) for e in outcome.errors] for outcome in in_batch] == [["copy_pages failed"]] * 3
    assert replayed.kv_length == 0 and replayed.history == [3, 4, 5, 6, 7, 8]
    assert parent.kv_length == child.kv_length == 6 and parent.device.pages == child.device.pages
    assert not left_out.errors
    again = submit(core, replayed, [40])
    while core.step():
        pass
    assert left_out.results
    expected = alone_logits(make_runner(pages=8), [[3, 4, 5, 6, 7, 8], [40]])[1]
    np.testing.assert_allclose(again.results[0], expected, rtol=1e-5, atol=1e-5)
    for seq in (replayed, parent, child, waiting):
        core.drop(seq)
    assert runner.pages.free_count == 8


def test_fork_shares_prefix_pages_and_copies_on_write(make_runner: Factory) -> None:
    runner = make_runner(pages=16)
    core = BatchScheduler(runner)
    parent = core.new_sequence()
    prompt = list(range(3, 13))  # 10 tokens: 2 full pages and a partial one
    submit(core, parent, prompt)
    core.step()
    child = core.fork(parent)
    assert child.device.pages == parent.device.pages
    assert [runner.pages.refcount(p) for p in parent.device.pages] == [2, 2, 2]
    a = submit(core, parent, [40])
    b = submit(core, child, [41])
    core.step()
    assert parent.device.pages[:2] == child.device.pages[:2]
    assert parent.device.pages[2] != child.device.pages[2]  # the shared partial page was copied
    assert [runner.pages.refcount(p) for p in child.device.pages] == [2, 2, 1]
    reference = make_runner(pages=16)
    np.testing.assert_allclose(a.results[0], alone_logits(reference, [prompt, [40]])[1], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(b.results[0], alone_logits(reference, [prompt, [41]])[1], rtol=1e-5, atol=1e-5)
    core.drop(parent)
    core.drop(child)
    assert runner.pages.free_count == 16


@pytest.mark.parametrize("host_pages", [0, 8])
def test_forks_sharing_a_partly_filled_last_page_decode_in_a_full_pool(make_runner: Factory, host_pages: int) -> None:
    """Each fork's first token needs a copy of the shared last page and no page is free. Preempting the other
    fork is what helps: the page is then its alone, written in place. It was never preempted, as if it freed
    nothing, and the step failed every pass with 'no pass can be scheduled' (a served n=2 on a full pool)."""
    runner = make_runner(pages=3)
    host = HostPagePool.for_runner(runner, num_pages=host_pages) if host_pages else None
    core = BatchScheduler(runner, host)
    parent = core.new_sequence()
    prompt = list(range(3, 13))  # 10 tokens: all 3 pages, the last half full
    submit(core, parent, prompt)
    core.step()
    child = core.fork(parent)
    first, second = submit(core, parent, [40]), submit(core, child, [41])
    for _ in range(10):
        if not core.step():
            break
    assert not first.errors and not second.errors and core.stats.preemptions >= 1
    reference = make_runner(pages=16)
    np.testing.assert_allclose(first.results[0], alone_logits(reference, [prompt, [40]])[1], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(second.results[0], alone_logits(reference, [prompt, [41]])[1], rtol=1e-5, atol=1e-5)


def test_a_published_page_kept_in_part_is_written_in_place_when_no_page_is_free(make_runner: Factory) -> None:
    """After a truncate into a published page, the next token would copy it (to keep it cached); in a full pool
    there is no page for the copy, and nothing to preempt: the page is unpublished and written in place."""
    runner = make_runner(pages=3)
    core = BatchScheduler(runner, config=SchedulerConfig(prefill_chunk=12))
    seq = core.new_sequence()
    submit(core, seq, list(range(3, 15)))  # 12 tokens: 3 full pages, all published
    core.step()
    core.truncate(seq, 10)
    after = submit(core, seq, [40])
    core.step()
    assert not after.errors and runner.pages.free_count == 0
    expected = alone_logits(make_runner(pages=16), [list(range(3, 13)), [40]])[1]
    np.testing.assert_allclose(after.results[0], expected, rtol=1e-5, atol=1e-5)


def test_cancel_rolls_back_a_half_done_pass(make_runner: Factory) -> None:
    runner = make_runner(pages=8)
    core = BatchScheduler(runner, config=SchedulerConfig(prefill_chunk=4))
    seq = core.new_sequence()
    outcome = Outcome()
    pending = core.submit(seq, list(range(3, 13)), outcome)
    core.step()
    assert seq.device.length == 4
    core.cancel(seq, pending)
    assert seq.device.length == 0 and seq.history == [] and not core.has_work()
    assert runner.pages.free_count == 8 and not outcome.results and not outcome.errors


def test_a_late_cancel_keeps_a_completed_pass_that_a_queued_pass_builds_on(make_runner: Factory) -> None:
    """The pass after it was sent on its tokens: cutting them out ran that pass on a context without them."""
    core = BatchScheduler(make_runner(pages=16))
    seq = core.new_sequence()
    submit(core, seq, [3, 4, 5])
    core.step()
    completed = core.submit(seq, [6, 7], Outcome())
    core.step()
    submit(core, seq, [8])
    core.cancel(seq, completed)
    core.step()
    assert seq.history == [3, 4, 5, 6, 7, 8]


def test_drop_fails_queued_passes_and_returns_host_pages(make_runner: Factory) -> None:
    runner = make_runner(pages=4)
    host = HostPagePool.for_runner(runner, num_pages=4)
    core = BatchScheduler(runner, host)
    idle = core.new_sequence()
    submit(core, idle, list(range(3, 15)))  # 3 pages
    core.step()
    busy = submit(core, core.new_sequence(), list(range(20, 32)))  # needs 3: the idle one is swapped out
    core.step()
    assert busy.results and idle.residence == "host" and host.free_count == 1
    waiting = submit(core, idle, [7])
    core.drop(idle)
    assert isinstance(waiting.errors[0], SequenceDropped)
    assert host.free_count == 4


def test_all_logits_returns_a_row_per_token(make_runner: Factory) -> None:
    runner = make_runner(pages=16)
    core = BatchScheduler(runner, config=SchedulerConfig(prefill_chunk=3))
    seq = core.new_sequence()
    outcome = submit(core, seq, [3, 4, 5, 6, 7, 8, 9], all_logits=True)
    while core.step():
        pass
    (rows,) = outcome.results
    expected = alone_logits(make_runner(pages=16), [[t] for t in [3, 4, 5, 6, 7, 8, 9]])
    np.testing.assert_allclose(rows, np.stack(expected), rtol=1e-5, atol=1e-5)
