"""The concurrent benchmark behind `pie bench --concurrency N`, on the tiny model."""

from __future__ import annotations

from collections.abc import Callable

from pie.runtime.llm import LLM
from pie.runtime.model_runner import ModelRunner
from pie.scheduler.bench import concurrent_bench
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
    assert runner.allocator.free_count == runner.allocator.num_pages
