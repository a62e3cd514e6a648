"""The context API an inferlet uses: fill, next-token logits, step, generate, score, fork, drop."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import numpy as np
import pytest
from pie.generation import SamplingParams
from pie.inferlet import ContextError, InferletHost, Session, log_softmax
from pie.runtime.model_runner import ModelRunner

HostFactory = Callable[..., InferletHost]


def run_in_session(host: InferletHost, body: Callable[[Session], Coroutine[Any, Any, Any]]) -> Any:
    async def main(ctx: Session, args: list[str]) -> Any:
        return await body(ctx)

    result = asyncio.run(host.run(main))
    assert result.ok, result.details or result.error
    return result.value


def test_fill_is_lazy_and_next_logits_match_a_plain_forward_pass(
    make_host: HostFactory, reference: ModelRunner, helpers: Any
) -> None:
    host = make_host()

    async def body(ctx: Session) -> Any:
        c = ctx.context("Pie serves").fill(" language models")
        steps_before = host.scheduler.core.stats.steps
        lazy = host.scheduler.core.stats.steps == steps_before and c.kv_pages() == []
        logits = await c.next_logits()
        again = await c.next_logits()  # kept: no second forward pass
        return lazy, c.tokens, logits, again is logits, host.scheduler.core.stats.steps

    lazy, tokens, logits, cached, steps = run_in_session(host, body)
    assert lazy and cached and steps == 1
    assert tokens == host.tokenizer.encode("Pie serves") + host.tokenizer.encode(
        " language models", add_special_tokens=False
    )
    np.testing.assert_allclose(logits, helpers.all_logits(reference, tokens)[-1], rtol=1e-5, atol=1e-5)


def test_step_applies_custom_logit_processors(make_host: HostFactory, reference: ModelRunner, helpers: Any) -> None:
    host = make_host()
    prompt = host.tokenizer.encode("The quick brown fox")
    expected = helpers.all_logits(reference, prompt)[-1]
    top, second = np.argsort(-expected)[:2]

    def ban_the_favourite(logits: np.ndarray, tokens: Any) -> np.ndarray:
        assert list(tokens) == prompt  # the processor sees the context
        logits = logits.copy()
        logits[top] = -np.inf
        return logits

    async def body(ctx: Session) -> Any:
        c = ctx.context(tokens=prompt)
        return await c.step(processors=[ban_the_favourite]), c.tokens

    token, tokens = run_in_session(host, body)
    assert token == second and tokens == prompt + [int(second)]


def test_generate_stops_at_a_stop_string_without_showing_it(make_host: HostFactory) -> None:
    host = make_host()

    async def body(ctx: Session) -> Any:
        free = ctx.context("Héllo wörld")
        text = await free.generate(12, stop_token_ids=())
        stop = text[3:5]
        bounded = ctx.context("Héllo wörld")
        return text, stop, await bounded.generate(12, stop=[stop], stop_token_ids=())

    text, stop, bounded = run_in_session(host, body)
    assert stop and bounded == text[: text.index(stop)]


def test_logprobs_score_a_continuation(make_host: HostFactory, reference: ModelRunner, helpers: Any) -> None:
    host = make_host()
    prompt = host.tokenizer.encode("A paged key-value cache")
    continuation = host.tokenizer.encode(" keeps the state", add_special_tokens=False)

    async def body(ctx: Session) -> Any:
        c = ctx.context(tokens=prompt)
        scores = await c.logprobs(continuation)
        return scores, await c.next_logits()

    scores, after = run_in_session(host, body)
    rows = helpers.all_logits(reference, prompt + continuation)
    expected = [log_softmax(rows[len(prompt) - 1 + j])[t] for j, t in enumerate(continuation)]
    np.testing.assert_allclose(scores, expected, atol=1e-4)
    np.testing.assert_allclose(after, rows[-1], rtol=1e-5, atol=1e-5)


def test_next_distribution_is_a_filtered_probability_vector(make_host: HostFactory) -> None:
    host = make_host()

    async def body(ctx: Session) -> Any:
        c = ctx.context("Tokenizers split text")
        return await c.next_distribution(SamplingParams(temperature=0.7, top_k=5)), await c.next_logits()

    probs, logits = run_in_session(host, body)
    assert probs.sum() == pytest.approx(1.0) and np.count_nonzero(probs) == 5
    assert set(np.flatnonzero(probs)) == set(np.argsort(-logits)[:5])


def test_fork_copies_pending_tokens_and_shares_pages(
    make_host: HostFactory, reference: ModelRunner, helpers: Any
) -> None:
    host = make_host()
    prompt = host.tokenizer.encode("The quick brown fox jumps over")

    async def body(ctx: Session) -> Any:
        parent = ctx.context(tokens=prompt)
        await parent.flush()
        parent.fill(" the")
        child = parent.fork()
        shared = [ctx.page_refcount(p) for p in parent.kv_pages()]
        a, b = await asyncio.gather(parent.next_logits(), child.next_logits())
        return shared, child.tokens == parent.tokens, a, b, parent.tokens

    shared, same_tokens, a, b, tokens = run_in_session(host, body)
    assert shared and all(count == 2 for count in shared) and same_tokens
    expected = helpers.all_logits(reference, tokens)[-1]
    np.testing.assert_allclose(a, expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(b, expected, rtol=1e-5, atol=1e-5)


def test_a_pass_past_the_models_context_is_refused_in_process_too(make_host: HostFactory) -> None:
    """In-process (pie run) a context went on past max_position_embeddings, to positions the model has no
    embedding for; served runs were refused. The scheduler now refuses such a pass for every caller."""
    host = make_host()
    context_length = host.scheduler.runner.config.max_position_embeddings

    async def body(ctx: Session) -> tuple[list[str], int]:
        refused = []
        long = ctx.context(tokens=[5] * (context_length + 1))
        try:
            await long.flush()
        except ContextError as exc:
            refused.append(str(exc))
        full = ctx.context(tokens=[5] * context_length)
        await full.flush()
        try:
            await full.logprobs([6])
        except ContextError as exc:
            refused.append(str(exc))
        return refused, len(full.tokens)

    refused, kept = run_in_session(host, body)
    over = f"past the model's context of {context_length}"
    assert refused == [f"the pass would take its context to {context_length + 1} tokens, {over}"] * 2
    assert kept == context_length


def test_misuse_is_refused_clearly(make_host: HostFactory) -> None:
    host = make_host()

    async def body(ctx: Session) -> list[str]:
        errors = []
        empty = ctx.context()
        try:
            await empty.next_logits()
        except ContextError as exc:
            errors.append(str(exc))
        busy = ctx.context("Pie serves")
        first = asyncio.ensure_future(busy.generate_tokens(4))
        await asyncio.sleep(0)
        try:
            await busy.next_logits()
        except ContextError as exc:
            errors.append(str(exc))
        await first
        busy.drop()
        try:
            busy.fill("more")
        except ContextError as exc:
            errors.append(str(exc))
        return errors

    errors = run_in_session(host, body)
    assert errors == [
        "the context is empty: fill it before asking for the next token",
        "another operation on this context is still running; await it first",
        "the context was dropped",
    ]


def test_token_ids_outside_the_vocabulary_or_not_integers_are_refused(make_host: HostFactory) -> None:
    host = make_host()
    vocab = host.scheduler.runner.config.vocab_size

    async def body(ctx: Session) -> tuple[list[str], list[int]]:
        c = ctx.context("Pie serves")
        errors = []
        for attempt in (
            lambda: c.fill(tokens=[5, -1]),
            lambda: c.fill(tokens=[vocab]),
            lambda: c.fill(tokens=[1.5]),
            lambda: ctx.context(tokens=["7"]),
        ):
            try:
                attempt()
            except (TypeError, ValueError) as exc:
                errors.append(str(exc))
        try:
            await c.logprobs([3, -2])
        except ValueError as exc:
            errors.append(str(exc))
        for later in (lambda: c.generate(-5), lambda: c.generate_tokens(2.5),
                      # a wrong type once failed deep inside, in words about something else
                      lambda: c.generate(2, sampling="greedy"), lambda: c.step("greedy"), lambda: c.generate(2, stop=5),
                      lambda: c.generate(2, processors=[lambda logits, tokens: logits[:10]])):
            try:
                await later()
            except (TypeError, ValueError) as exc:
                errors.append(str(exc))
        for call in (lambda: ctx.detokenize([10**9]), lambda: ctx.detokenize([-3]), lambda: ctx.page_refcount(-1),
                     lambda: ctx.context(priority="high")):
            try:
                call()
            except (TypeError, ValueError) as exc:
                errors.append(str(exc))
        c.fill(tokens=np.array([vocab - 1, 0]))  # numpy integers are ids too
        return errors, c.tokens

    errors, tokens = run_in_session(host, body)
    assert errors == [
        f"token id -1 is outside the model's vocabulary (0 to {vocab - 1})",
        f"token id {vocab} is outside the model's vocabulary (0 to {vocab - 1})",
        "token ids are integers, got 1.5",
        "token ids are integers, got '7'",
        f"token id -2 is outside the model's vocabulary (0 to {vocab - 1})",
        "max_tokens must be at least 0, not -5",
        "max_tokens is a whole number, got 2.5",
        "sampling takes a SamplingParams (or None: greedy), not str 'greedy'",
        "step takes a Sampler, a SamplingParams or None (greedy), not str 'greedy'",  # it named SamplingParams alone
        "stop takes a string or a list of strings, not 5",
        f"a logit processor returned logits of shape (10,), not ({vocab},)",
        f"token id {10**9} is outside the model's vocabulary (0 to {vocab - 1})",
        f"token id -3 is outside the model's vocabulary (0 to {vocab - 1})",
        f"page -1 is outside the KV cache's {host.scheduler.runner.pages.num_pages} pages",
        "priority is a whole number (higher goes first), not 'high'",
    ]
    assert tokens == host.tokenizer.encode("Pie serves") + [vocab - 1, 0]  # nothing refused was added


def test_text_that_utf8_cannot_encode_is_refused(make_host: HostFactory) -> None:
    host = make_host()

    async def body(ctx: Session) -> list[str]:
        errors = []
        for attempt in (lambda: ctx.context("ok \udcff"), lambda: ctx.context("fine").fill("\ud800")):
            try:
                attempt()
            except ValueError as exc:
                errors.append(str(exc))
        return errors

    assert run_in_session(host, body) == [
        "the text holds '\\udcff' at index 3, which UTF-8 cannot encode",
        "the text holds '\\ud800' at index 0, which UTF-8 cannot encode",
    ]


def test_contexts_left_open_are_dropped_when_the_inferlet_ends(make_host: HostFactory) -> None:
    host = make_host()
    sessions: list[Session] = []

    async def main(ctx: Session, args: list[str]) -> int:
        sessions.append(ctx)
        for prompt in ("one two three four five", "six seven"):
            await ctx.context(prompt).flush()
        return ctx.open_contexts

    result = asyncio.run(host.run(main))
    assert result.value == 2 and result.dropped_contexts == 2
    runner = host.scheduler.runner
    assert runner.pages.free_count == runner.pages.num_pages
    with pytest.raises(ContextError, match="has ended"):
        sessions[0].context("late")
