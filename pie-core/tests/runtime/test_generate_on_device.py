"""`pie run`'s decode loop (LLM.generate_tokens) reads the candidates it samples from on the device."""

from __future__ import annotations

import pytest
from pie.generation import Sampler, SamplingParams
from pie.plugins import EngineRegistry
from pie.runtime.llm import LLM
from pie.runtime.model_runner import ModelRunner, SequenceWork
from pie.testing.models import random_weights, tiny_config, tiny_tokenizer


@pytest.fixture
def llm() -> LLM:
    config = tiny_config(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16)
    device = EngineRegistry().select("cpu")[0]
    return LLM(ModelRunner(config, random_weights(config, seed=4).items(), device, page_size=4), tiny_tokenizer())


def count_reads(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> dict[str, list[int]]:
    """Which of the runner's reads each pass took: whole logits (``forward``) or candidates (``forward_top``)."""
    reads: dict[str, list[int]] = {"logits": [], "top": []}
    forward, forward_top = llm.runner.forward, llm.runner.forward_top
    monkeypatch.setattr(llm.runner, "forward", lambda batch: reads["logits"].append(0) or forward(batch))
    monkeypatch.setattr(llm.runner, "forward_top",
                        lambda batch, top: reads["top"].append(top) or forward_top(batch, top))
    return reads


@pytest.mark.parametrize("sampling,top", [(SamplingParams(), 1), (SamplingParams(1.0, top_k=8, seed=3), 8)])
def test_greedy_and_top_k_decode_read_candidates_and_draw_the_host_paths_tokens(
    llm: LLM, monkeypatch: pytest.MonkeyPatch, sampling: SamplingParams, top: int
) -> None:
    prompt = [5, 9, 13, 2, 7]
    reads = count_reads(llm, monkeypatch)
    tokens = list(llm.generate_tokens(prompt, sampling, max_tokens=6, stop_token_ids=[]))
    assert reads == {"logits": [0], "top": [top] * 5}  # the prompt's pass, then five decode steps
    # The host path: every decode step's whole logits, sampled by the same sampler.
    sampler, sequence, expected = Sampler(sampling), llm.runner.new_sequence(), []
    logits = llm.prefill(sequence, prompt)
    for _ in range(6):
        expected.append(sampler.sample(logits))
        logits = llm.runner.step([SequenceWork(sequence, [expected[-1]])])[0]
    sequence.free()
    assert tokens == expected


def test_top_p_reads_whole_logits(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    reads = count_reads(llm, monkeypatch)
    list(llm.generate_tokens([5, 9, 13], SamplingParams(1.0, top_p=0.9, seed=1), max_tokens=4, stop_token_ids=[]))
    assert reads == {"logits": [0] * 4, "top": []}
