"""The concurrent benchmark behind `pie bench --concurrency N`, on the tiny model."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from pie.runtime.llm import LLM
from pie.runtime.model_runner import ModelRunner
from pie.scheduler.bench import MAX_CONCURRENCY, concurrent_bench, steady_decode_rate
from pie.testing.models import tiny_tokenizer


def test_concurrent_bench_batches_the_requests_and_reports_latencies(make_runner: Callable[..., ModelRunner]) -> None:
    runner = make_runner(pages=256, page_size=4)
    llm = LLM(runner, tiny_tokenizer())
    report = concurrent_bench(llm, concurrency=6, prompt_tokens=10, decode_tokens=5)
    assert report["concurrency"] == 6 and report["decode_tokens"] == 5
    assert report["largest_batch"] == 6
    # 6 prompts in one step, then 4 decode steps: batched, not 6 x 5 passes.
    assert report["steps"] == 5
    assert report["decode_tokens_per_s"] > 0 and report["output_tokens_per_s"] > 0
    for key in ("ttft_s", "token_latency_s"):
        p = report[key]
        assert 0 < p["p50"] <= p["p90"] <= p["p99"] <= report["wall_s"]
    assert "6 concurrent" in report["text"]
    assert runner.pages.free_count == runner.pages.num_pages


def test_the_most_concurrency_is_what_one_step_decodes_and_more_is_refused(
    make_runner: Callable[..., ModelRunner]
) -> None:
    """`pie bench --concurrency 100000` ran on, silent, for minutes: requests beyond one step's batch take turns."""
    runner = make_runner(pages=MAX_CONCURRENCY + 8, page_size=4)
    llm = LLM(runner, tiny_tokenizer())
    report = concurrent_bench(llm, concurrency=MAX_CONCURRENCY, prompt_tokens=1, decode_tokens=2)
    assert report["largest_batch"] == MAX_CONCURRENCY and report["steps"] == 2, "all at once, in two steps"
    with pytest.raises(ValueError, match=f"concurrency {MAX_CONCURRENCY + 1} is more than {MAX_CONCURRENCY}"):
        concurrent_bench(llm, concurrency=MAX_CONCURRENCY + 1, prompt_tokens=1, decode_tokens=2)
    assert runner.pages.free_count == runner.pages.num_pages


def test_steady_decode_rate_leaves_out_the_prefill_a_late_request_waits_through() -> None:
    # Request A's first token at t=1, then one token per 0.1 s; B was prefilled in a second,
    # slower step: its first token comes at t=2, while A waited. Once both decode, each step
    # (0.1 s) yields two tokens: 20 tok/s, whatever the prefill stall before it cost.
    a = [1.0, 2.0, *(2.0 + 0.1 * i for i in range(1, 11))]
    b = [2.0, *(2.0 + 0.1 * i for i in range(1, 12))]
    assert steady_decode_rate([a, b]) == pytest.approx(20.0)


def test_steady_decode_rate_without_a_common_window_counts_every_later_token() -> None:
    # A finishes before B's first token: no moment when both decode.
    a = [0.0, 0.5, 1.0]
    b = [2.0, 2.5, 3.0]
    assert steady_decode_rate([a, b]) == pytest.approx(4 / 3.0)
    assert steady_decode_rate([[1.0]]) == 0.0
