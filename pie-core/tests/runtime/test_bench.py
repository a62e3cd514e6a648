"""`pie bench` at batch 1: how the decode rate and the roofline share are taken from the runs."""

from __future__ import annotations

import pytest
from pie import bench
from pie.plugins import EngineRegistry
from pie.runtime.llm import LLM
from pie.runtime.model_runner import ModelRunner
from pie.testing.models import random_weights, tiny_config, tiny_tokenizer


def test_each_decode_run_is_measured_against_the_faster_bandwidth_read_around_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    config = tiny_config(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16)
    device = EngineRegistry().select("cpu")[0]
    llm = LLM(ModelRunner(config, random_weights(config, seed=1).items(), device, page_size=4), tiny_tokenizer())
    monkeypatch.setattr(LLM, "load", classmethod(lambda cls, *args, **kwargs: llm))
    # The warm-up, then three runs of 10 tokens: 10, 4 and 2 tok/s; a bandwidth read before the first
    # run and after each.
    seconds = iter([0.1, 1.0, 2.5, 5.0])
    bandwidths = iter([1e9, 2e9, 1e9, 4e9])
    monkeypatch.setattr(bench, "decode_seconds", lambda llm, prompt, tokens: next(seconds))
    monkeypatch.setattr(bench, "measure_bandwidth", lambda device: next(bandwidths))

    report = bench.run_bench(None, "cpu", prompt_tokens=8, decode_tokens=10, runs=3, concurrency=1)

    per_token = bench.decode_bytes_per_token(llm, 8 + 5)
    # Against the faster read around each run (2, 2 and 4 GB/s) the shares are 5, 2 and 0.5 x per_token / 1e9,
    # their median the second run's. Against the read after each run alone (2, 1, 4) the second run's share
    # would be 4, and the median rate over the median read 2.
    assert report["roofline_fraction"] == pytest.approx(2 * per_token / 1e9)
    assert report["decode_tokens_per_s"] == pytest.approx(4.0)
    assert report["bandwidth_gb_per_s"] == pytest.approx(2.0)
    assert next(seconds, None) is None and next(bandwidths, None) is None
    assert f"reached {100 * report['roofline_fraction']:.0f}%" in report["text"]
