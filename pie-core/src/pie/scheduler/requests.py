"""Plain completion requests (prompt ids in, token ids out) served by the batch scheduler."""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq

from pie.generation import Sampler, SamplingParams
from pie.scheduler.core import PastContext, RequestTooLarge
from pie.scheduler.driver import Scheduler


async def generate(
    scheduler: Scheduler,
    prompt_ids: Seq[int],
    *,
    max_tokens: int,
    sampling: SamplingParams | None = None,
    stop_token_ids: Seq[int] = (),
    priority: int = 0,
    on_token: Callable[[int], None] | None = None,
) -> list[int]:
    """Generate up to ``max_tokens`` tokens after ``prompt_ids``; the stop token is not returned.

    Fails at once, before any pass runs, with RequestTooLarge when prompt and output could never fit in the page
    pool, and with PastContext when they would pass the model's context.
    """
    if not prompt_ids:
        raise ValueError("the prompt is empty")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
    core = scheduler.core
    # The last sampled token is returned, never fed back: it needs neither KV nor a position.
    longest = len(prompt_ids) + max_tokens - 1
    pages = -(-longest // core.page_size)
    if pages > core.pool_pages:
        core.stats.too_large += 1
        raise RequestTooLarge(longest, pages, core.pool_pages, core.page_size)
    context = core.runner.config.max_position_embeddings
    if longest > context:  # else its passes run, stream tokens, and the one that crosses the context fails
        raise PastContext(
            f"the prompt ({len(prompt_ids)} tokens) and max_tokens ({max_tokens}) would take the sequence to "
            f"{longest} tokens, past the model's context of {context}"
        )
    sampler = Sampler(sampling)
    top = sampler.top_tokens_needed(core.runner.config.vocab_size)  # read on the device where that will do
    stops = set(stop_token_ids)
    seq = scheduler.new_sequence(priority)
    produced: list[int] = []
    try:
        logits = await scheduler.forward(seq, prompt_ids, top=top)
        while True:
            assert logits is not None
            token = sampler.sample(logits)
            if token in stops:
                break
            produced.append(token)
            if on_token is not None:
                on_token(token)
            if len(produced) == max_tokens:
                break
            logits = await scheduler.forward(seq, [token], top=top)
    finally:
        core.drop(seq)
    return produced
