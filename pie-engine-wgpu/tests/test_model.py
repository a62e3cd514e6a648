"""Whole models on the WebGPU engine through the shared runtime, against the CPU engine."""

from __future__ import annotations

import numpy as np
import pytest
from pie.model.config import ModelConfig
from pie.plugins import Device, EngineRegistry
from pie.runtime.model_runner import ModelRunner, SequenceWork
from pie.testing.models import random_weights, tiny_config
from pie_engine_wgpu.plugin import engine as wgpu_engine

ENGINE = "wgpu"


@pytest.fixture(scope="module")
def registry() -> EngineRegistry:
    return EngineRegistry()


def runner(
    device: Device, config: ModelConfig, tensors: list[tuple[str, np.ndarray]], page_size: int = 4
) -> ModelRunner:
    return ModelRunner(config, tensors, device, page_size=page_size, max_cached_tokens=256)


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
def test_random_model_logits_match_the_cpu_engine(registry: EngineRegistry, architecture: str) -> None:
    config = tiny_config(architecture)
    tensors = list(random_weights(config, seed=3).items())
    cpu = runner(registry.engine("cpu").open(0), config, tensors)
    gpu = runner(registry.engine(ENGINE).open(0), config, tensors)
    assert not any(step.fallback for step in gpu.plan.steps), "every kernel runs on the engine"
    rng = np.random.default_rng(7)
    # 11 and 6 prompt tokens over pages of 4: both sequences span several pages.
    prompts = [[int(t) for t in rng.integers(0, config.vocab_size, n)] for n in (11, 6)]
    cpu_seqs, gpu_seqs = [cpu.new_sequence() for _ in prompts], [gpu.new_sequence() for _ in prompts]
    expected = cpu.step([SequenceWork(s, p) for s, p in zip(cpu_seqs, prompts, strict=True)])
    got = gpu.step([SequenceWork(s, p) for s, p in zip(gpu_seqs, prompts, strict=True)])
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-4, err_msg="prefill")
    for step in range(5):
        tokens = [int(np.argmax(row)) for row in expected]
        expected = cpu.step([SequenceWork(s, [t]) for s, t in zip(cpu_seqs, tokens, strict=True)])
        got = gpu.step([SequenceWork(s, [t]) for s, t in zip(gpu_seqs, tokens, strict=True)])
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-4, err_msg=f"decode step {step}")
    assert gpu_seqs[0].length == 16 and len(gpu_seqs[0].pages) == 4
    gpu.close()


def test_a_forward_pass_is_one_submission(registry: EngineRegistry) -> None:
    config = tiny_config()
    device = registry.engine(ENGINE).open(0)
    gpu = runner(device, config, list(random_weights(config).items()))
    backend = wgpu_engine.backend(device.info)
    sequence = gpu.new_sequence()
    gpu.step([SequenceWork(sequence, [1, 2, 3])])
    before = backend.submissions
    gpu.step([SequenceWork(sequence, [4])])
    assert backend.submissions - before == 1, f"{len(gpu.plan.steps)} launches should share one submission"
    gpu.close()


@pytest.mark.slow
def test_smollm2_greedy_tokens_match_the_cpu_engine(registry: EngineRegistry) -> None:
    """The real model end to end through LLM (model store, Poem plan, scheduler-free generation)."""
    from pie.model.store import resolve_model
    from pie.runtime.llm import LLM

    path = str(resolve_model(None))
    results = []
    for name in ("cpu", ENGINE):
        llm = LLM.load(path, name, registry=registry, max_cached_tokens=256)
        assert llm.device.name == name
        prompt = llm.encode_prompt("The capital of France is", chat=False)
        results.append(list(llm.generate_tokens(prompt, max_tokens=8, stop_token_ids=())))
        llm.runner.close()
    assert len(results[0]) == 8
    assert results[1] == results[0]
