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


def test_the_prefill_runs_in_the_chunks_of_pie_run_and_equals_one_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    import numpy as np
    from pie.runtime import llm as llm_module
    from pie.runtime.model_runner import SequenceWork

    config = tiny_config(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16)
    device = EngineRegistry().select("cpu")[0]
    llm = LLM(ModelRunner(config, random_weights(config, seed=2).items(), device, page_size=4), tiny_tokenizer())
    prompt = [int(t) for t in np.random.default_rng(0).integers(1, config.vocab_size, 11)]
    whole = llm.runner.new_sequence()
    expected = llm.runner.step([SequenceWork(whole, prompt)])[0]
    whole.free()

    passes: list[tuple[int, bool]] = []
    step = llm.runner.step

    def recorded(work: list[SequenceWork]):
        passes.extend((len(w.tokens), w.logits) for w in work)
        return step(work)

    monkeypatch.setattr(llm_module, "DEFAULT_PREFILL_CHUNK", 4)
    monkeypatch.setattr(llm.runner, "step", recorded)
    assert bench.prefill_seconds(llm, prompt) > 0
    assert passes == [(4, False), (4, False), (3, True)]

    sequence = llm.runner.new_sequence()
    np.testing.assert_allclose(llm.prefill(sequence, prompt), expected, rtol=1e-5, atol=1e-5)
    assert sequence.length == len(prompt)
    sequence.free()
    with pytest.raises(ValueError, match="the prompt is empty"):
        llm.prefill(llm.runner.new_sequence(), [])
