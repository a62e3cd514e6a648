"""A whole model on the Metal engine against the CPU engine: prefill, then batched decode.

On a Mac the Metal engine runs on the GPU; here and everywhere it also runs on the
emulator, which checks the lowered plan, the fused kernels, the paged KV cache and the
command-buffer batching of real forward passes.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import NOT_MACOS_REASON, ON_MACOS
from msl_emulator.engine import emulated_engine
from pie.plugins import Device, EngineError, EngineRegistry
from pie.profiles import variant_chooser
from pie.runtime.model_runner import ModelRunner, SequenceWork
from pie.testing.models import random_weights, tiny_config


def _runner(device: Device, config, weights) -> ModelRunner:
    """With the profiles as ``LLM`` applies them: here the engine's default profile (GEMV for decode)."""
    chooser, _ = variant_chooser(device, {"PIE_PROFILE_PATH": "/nonexistent"})
    return ModelRunner(config, weights.items(), device, page_size=4, max_cached_tokens=128, choose_variant=chooser)


def _compare(metal: Device, architecture: str) -> None:
    config = tiny_config(architecture)
    weights = random_weights(config, seed=3)
    cpu = EngineRegistry().engine("cpu").open(0)
    on_metal, on_cpu = _runner(metal, config, weights), _runner(cpu, config, weights)
    plan = on_metal.plan.describe()
    assert "rms_norm_gate_up_silu" in plan and "cpu fallback" not in plan
    rng = np.random.default_rng(5)
    prompts = [list(rng.integers(3, config.vocab_size, n)) for n in (7, 5)]
    seqs = {runner: [runner.new_sequence() for _ in prompts] for runner in (on_metal, on_cpu)}
    work = {
        runner: [SequenceWork(seq, prompt) for seq, prompt in zip(seqs[runner], prompts, strict=True)]
        for runner in (on_metal, on_cpu)
    }
    for step in range(4):
        got, expected = on_metal.step(work[on_metal]), on_cpu.step(work[on_cpu])
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4, err_msg=f"step {step}")
        tokens = [int(t) for t in expected.argmax(axis=-1)]
        for runner in (on_metal, on_cpu):
            work[runner] = [SequenceWork(seq, [t]) for seq, t in zip(seqs[runner], tokens, strict=True)]
    on_metal.close()


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
def test_emulated_metal_matches_the_cpu_engine(architecture: str) -> None:
    engine, drivers = emulated_engine()
    registry = EngineRegistry(autoload=False)
    registry.register("metal", engine)
    _compare(registry.engine("metal").open(0), architecture)
    driver = drivers[0]
    # Each forward pass (about 30 dispatches here) went to the GPU as one command buffer.
    assert driver.commits == 4 and len(driver.log) >= 4 * 25
    assert {d.function for d in driver.log} >= {"attention_prefill", "attention_decode", "linear_gemv", "append_kv"}


@pytest.mark.gpu
@pytest.mark.skipif(not ON_MACOS, reason=NOT_MACOS_REASON)
def test_metal_gpu_matches_the_cpu_engine() -> None:
    _compare(EngineRegistry().engine("metal").open(0), "llama")


def test_a_head_dim_beyond_prefill_attention_is_refused_when_the_plan_is_built(open_emulated) -> None:
    """Every pass but a decode runs ``attention_prefill``, which holds 128 dims a row: such a model loaded whole,
    and its first prompt failed."""
    metal = open_emulated().device
    config = tiny_config(head_dim=192)
    with pytest.raises(EngineError, match=r"^engine 'metal' runs attention with head_dim up to 128; this model's is "
                                          r"192 \(use --engine cpu or xla\)$"):
        ModelRunner(config, random_weights(config).items(), metal, page_size=4, max_cached_tokens=64)

