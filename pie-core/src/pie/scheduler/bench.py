"""Concurrent-request benchmark: many greedy requests at once through the batch scheduler."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from pie.scheduler.core import BatchScheduler, SchedulerConfig
from pie.scheduler.driver import Scheduler
from pie.scheduler.requests import generate

if TYPE_CHECKING:
    from pie.runtime.llm import LLM

MAX_CONCURRENCY = SchedulerConfig().max_batch_tokens
"""The most requests one step decodes together (a decode is one token of a step's batch): beyond it, requests
take turns instead of running at once, and the run grows without bound (100000 ran for minutes with no output)."""


def concurrent_bench(llm: LLM, concurrency: int, prompt_tokens: int, decode_tokens: int) -> dict[str, Any]:
    """Start ``concurrency`` requests at once (random prompts of ``prompt_tokens``, exactly
    ``decode_tokens`` greedy tokens each, no stop token) and measure them.

    ``decode_tokens_per_s`` is what the batch sustains while every request decodes (see
    :func:`steady_decode_rate`); ``output_tokens_per_s`` counts all tokens over the whole run,
    prefill included.
    """
    if concurrency < 1 or prompt_tokens < 1 or decode_tokens < 1:
        raise ValueError("concurrency, prompt_tokens and decode_tokens must be at least 1")
    if concurrency > MAX_CONCURRENCY:
        raise ValueError(f"concurrency {concurrency} is more than {MAX_CONCURRENCY}, the most requests one step "
                         "decodes")
    runner = llm.runner
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, runner.config.vocab_size, prompt_tokens).tolist() for _ in range(concurrency)]
    config = SchedulerConfig(max_batch_sequences=max(256, concurrency))
    warm_up = Scheduler(BatchScheduler(runner, None, config))
    asyncio.run(generate(warm_up, prompts[0][:8], max_tokens=2))  # first-use allocations and caches
    scheduler = Scheduler(BatchScheduler(runner, None, config))

    stamps: list[list[float]] = [[] for _ in range(concurrency)]

    async def run_all() -> float:
        start = time.perf_counter()
        await asyncio.gather(
            *(
                generate(scheduler, prompt, max_tokens=decode_tokens, on_token=_stamper(times))
                for prompt, times in zip(prompts, stamps, strict=True)
            )
        )
        return start

    start = asyncio.run(run_all())
    stats = scheduler.core.stats
    first = np.array([s[0] for s in stamps]) - start
    last = max(s[-1] for s in stamps) - start
    gaps = np.concatenate([np.diff(s) for s in stamps]) if decode_tokens > 1 else np.zeros(0)
    report: dict[str, Any] = {
        "concurrency": concurrency,
        "prompt_tokens": prompt_tokens,
        "decode_tokens": decode_tokens,
        "wall_s": last,
        "decode_tokens_per_s": steady_decode_rate(stamps),
        "output_tokens_per_s": concurrency * decode_tokens / last,
        "ttft_s": _percentiles(first),
        "token_latency_s": _percentiles(gaps),
        "steps": stats.steps,
        "largest_batch": stats.largest_batch,
        "preemptions": stats.preemptions,
    }
    ttft, per_token = report["ttft_s"], report["token_latency_s"]
    report["text"] = (
        f"{concurrency} concurrent x ({prompt_tokens} prompt + {decode_tokens} decode tokens): "
        f"{report['decode_tokens_per_s']:.1f} decode tok/s aggregate "
        f"({report['output_tokens_per_s']:.1f} tok/s with prefill); "
        f"TTFT p50 {ttft['p50'] * 1e3:.0f} ms p99 {ttft['p99'] * 1e3:.0f} ms; "
        f"per token p50 {per_token['p50'] * 1e3:.1f} ms p90 {per_token['p90'] * 1e3:.1f} ms "
        f"p99 {per_token['p99'] * 1e3:.1f} ms; {stats.steps} steps, {stats.preemptions} preemptions"
    )
    return report


def steady_decode_rate(stamps: list[list[float]]) -> float:
    """Aggregate tokens/s while every request is decoding: tokens stamped after the last request's
    first token (all prompts are in by then) up to the first request's last token (the batch is
    still whole), over that time. This is the batch's decode rate, without the prefill steps that
    a request arriving with the others waits through, as a decode-only peer measures it.

    When no such window exists (a request finishes before another's first token), every token
    after each request's first counts, over the time from the first first-token to the last token.
    """
    starts = [s[0] for s in stamps if s]
    ends = [s[-1] for s in stamps if s]
    if not starts:
        return 0.0
    begin, end = max(starts), min(ends)
    tokens = sum(1 for s in stamps for t in s if begin < t <= end)
    if tokens and end > begin:
        return tokens / (end - begin)
    tokens = sum(len(s) - 1 for s in stamps if s)
    window = max(ends) - min(starts)
    return tokens / window if tokens and window > 0 else 0.0


def _stamper(times: list[float]) -> Callable[[int], None]:
    return lambda _token: times.append(time.perf_counter())


def _percentiles(values: np.ndarray) -> dict[str, float]:
    if values.size == 0:
        return {"p50": 0.0, "p90": 0.0, "p99": 0.0}
    p50, p90, p99 = np.percentile(values, [50, 90, 99])
    return {"p50": float(p50), "p90": float(p90), "p99": float(p99)}
