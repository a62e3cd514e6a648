"""`pie bench` at batch 1: how the decode rate and the roofline share are taken from the runs."""

from __future__ import annotations

from pathlib import Path

import pytest
from pie import bench
from pie.plugins import EngineRegistry
from pie.runtime.llm import LLM
from pie.runtime.model_runner import ModelRunner
from pie.testing.models import make_gguf_model, random_weights, tiny_config, tiny_tokenizer


def test_a_paired_run_is_its_steps_bytes_over_their_time_against_the_passes_between_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Steps of 2, 1 and 1 seconds, each followed by a pass: the clock reads before and after each step.
    clock = iter([0.0, 2.0, 10.0, 11.0, 20.0, 21.0])
    monkeypatch.setattr(bench.time, "perf_counter", lambda: next(clock))
    passes = iter([100.0, 50.0, 100.0])
    steps: list[int] = []

    seconds, reads = bench.paired_steps(lambda: steps.append(1), 3, lambda: next(passes))

    assert seconds == [2.0, 1.0, 1.0] and reads == [100.0, 50.0, 100.0]
    assert len(steps) == 3 and next(clock, None) is None
    # 3 x 200 bytes in 4 s is 150 B/s. Passes of one buffer at 100, 50 and 100 B/s average 75 over their
    # time (the harmonic mean), not 83.3: a slow step still counts in full, and so does a slow pass.
    share, bandwidth = bench.paired_share(seconds, reads, 200)
    assert bandwidth == pytest.approx(75.0)
    assert share == pytest.approx(2.0)


def test_the_bench_reports_the_paired_share_and_the_share_of_the_best_reads(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    shape = {"hidden_size": 32, "intermediate_size": 64, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1, "head_dim": 16}
    llm = LLM.load(str(make_gguf_model(tmp_path / "m.gguf", "F32", seed=1, **shape)), "cpu")
    monkeypatch.setattr(LLM, "load", classmethod(lambda cls, *args, **kwargs: llm))
    # The warm-up, then three runs of 10 tokens: 10, 4 and 2 tok/s, each between two best reads and
    # followed by a paired run: its steps' shares and passes.
    seconds = iter([0.1, 1.0, 2.5, 5.0])
    best_reads = iter([1e9, 2e9, 2e9, 1e9, 1e9, 4e9])
    per_token = bench.decode_bytes_per_token(llm, 8 + 5)
    # Paired runs whose steps read at 2.7, 0.8 and 1.9 GB/s between passes at 3, 1 and 2 GB/s.
    paired = iter(
        [
            ([per_token / 2.7e9] * 10, [3e9] * 10),
            ([per_token / 0.8e9] * 10, [1e9] * 10),
            ([per_token / 1.9e9] * 10, [2e9] * 10),
        ]
    )
    monkeypatch.setattr(bench, "decode_seconds", lambda llm, prompt, tokens: next(seconds))
    monkeypatch.setattr(bench, "measure_bandwidth", lambda device: next(best_reads))
    monkeypatch.setattr(bench, "paired_decode", lambda llm, prompt, tokens, read: next(paired))

    report = bench.run_bench(None, "cpu", prompt_tokens=8, decode_tokens=10, runs=3, concurrency=1)

    # Against the faster best read around each run (2, 2 and 4 GB/s) the runs' shares are 5, 2 and 0.5 x
    # per_token / 1e9: their median is the second run's.
    assert report["roofline_fraction_of_best_read"] == pytest.approx(2 * per_token / 1e9)
    assert report["best_bandwidth_gb_per_s"] == pytest.approx(2.0)
    assert report["decode_tokens_per_s"] == pytest.approx(4.0)
    # The headline share and bandwidth are the medians of the paired runs' (0.9, 0.8, 0.95 and 3, 1, 2 GB/s).
    assert report["roofline_fraction"] == pytest.approx(0.9)
    assert report["bandwidth_gb_per_s"] == pytest.approx(2.0)
    assert report["decode_roofline_tokens_per_s"] == pytest.approx(2e9 / per_token)
    assert next(seconds, None) is None and next(best_reads, None) is None and next(paired, None) is None
    assert "roofline reached: 90%" in report["text"]


@pytest.mark.parametrize("tied", [True, False])
def test_a_decode_step_reads_each_weight_in_its_uploaded_type(tmp_path: Path, tied: bool) -> None:
    shape = {"hidden_size": 64, "intermediate_size": 128, "num_heads": 2, "num_kv_heads": 1, "head_dim": 32,
             "tie_word_embeddings": tied}
    f32 = LLM.load(str(make_gguf_model(tmp_path / "f32.gguf", "F32", **shape)), "cpu")
    q8 = LLM.load(str(make_gguf_model(tmp_path / "q8.gguf", "Q8_0", **shape)), "cpu")
    config = f32.runner.config
    embedding = config.vocab_size * config.hidden_size * 4
    kv = bench.kv_bytes_per_token(config, "float32")
    # An untied embedding table is only looked up (one row), so it is not read as a whole.
    assert bench.decode_bytes_per_token(f32, 10) == f32.memory.weight_bytes - (0 if tied else embedding) + 10 * kv
    f32_matrices = bench.decode_bytes_per_token(f32, 0)
    # Q8_0 matrices take 34 bytes per 32 values where float32 takes 128; norms stay float32.
    assert 34 / 128 < bench.decode_bytes_per_token(q8, 0) / f32_matrices < 0.3


def test_a_paired_decode_reads_once_after_each_real_step(monkeypatch: pytest.MonkeyPatch) -> None:
    config = tiny_config(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16)
    device = EngineRegistry().select("cpu")[0]
    llm = LLM(ModelRunner(config, random_weights(config, seed=1).items(), device, page_size=4), tiny_tokenizer())
    passes_run: list[int] = []
    step, step_top = llm.runner.step, llm.runner.step_top
    monkeypatch.setattr(llm.runner, "step", lambda work: passes_run.append(len(work[0].tokens)) or step(work))
    monkeypatch.setattr(llm.runner, "step_top",  # greedy decode steps read the argmax on the device
                        lambda work, top: passes_run.append(len(work[0].tokens)) or step_top(work, top))

    steps_before_each_read: list[int] = []

    def read() -> float:
        steps_before_each_read.append(len(passes_run))
        return 1e9

    seconds, reads = bench.paired_decode(llm, [5, 6, 7], 4, read)

    assert passes_run == [3, 1, 1, 1, 1]  # the prefill, then four one-token steps
    assert steps_before_each_read == [2, 3, 4, 5]  # a read after each step, never two steps between reads
    assert reads == [1e9] * 4 and len(seconds) == 4 and all(step > 0 for step in seconds)
    assert llm.runner.pages.used_count == 0  # the sequence was freed


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
    with pytest.raises(ValueError, match="the prompt is empty"):
        next(llm.generate_tokens([], stop_token_ids=()))
    assert llm.runner.pages.used_count == 0


def test_a_prompt_and_decode_beyond_the_context_are_refused_before_any_pass(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    llm = LLM.load(str(make_gguf_model(tmp_path / "m.gguf", "F32", seed=1)), "cpu")

    def load(cls, *args, max_cached_tokens, **kwargs) -> LLM:  # the loaded model, its KV cache sized as asked
        max_cached_tokens(llm.runner.config)
        return llm

    monkeypatch.setattr(LLM, "load", classmethod(load))
    monkeypatch.setattr(bench, "prefill_seconds", lambda *args: pytest.fail("a pass ran"))
    monkeypatch.setattr(bench, "decode_seconds", lambda *args: pytest.fail("a pass ran"))
    context = llm.context_length
    for concurrency in (1, 4):
        with pytest.raises(ValueError, match=f"--prompt-tokens {context} and --decode-tokens 1 make {context + 1} "
                                             f"tokens, more than the model's context of {context}"):
            bench.run_bench(None, "cpu", context, 1, 1, concurrency)
