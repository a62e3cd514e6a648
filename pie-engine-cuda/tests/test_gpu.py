"""The engine on a real GPU (NVIDIA through CUDA, AMD through HIP): the conformance kit, the checks
of ``cuda_checks``, a random model and SmolLM2 against the CPU engine. On a machine without a GPU
the whole module is skipped with the reason the device probe gives."""

from __future__ import annotations

import os

import cuda_checks as checks
import numpy as np
import pytest
from pie.plugins import Device, EngineRegistry
from pie.testing.conformance import ConformanceSuite


def _skip_reason() -> str | None:
    if ":" in os.environ.get("PIE_CUDA_BACKEND", ""):
        return "PIE_CUDA_BACKEND names an installed backend (the host emulator), not a GPU"
    try:
        from pie_engine_cuda.backend import probe

        backend, devices = probe()
    except Exception as exc:  # noqa: BLE001 - the reason is the message
        return f"no usable GPU: {exc}"
    if not devices:
        return f"no GPU: the {backend} driver found none"
    return None


SKIP_REASON = _skip_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or "")]


@pytest.fixture(scope="module")
def device() -> Device:
    return EngineRegistry().engine("cuda").open(0)


class TestCudaConformance(ConformanceSuite):
    engine = "cuda"


def test_the_device_is_a_gpu_compiled_for_its_own_architecture(device: Device) -> None:
    extra = dict(device.info.extra)
    assert extra["backend"] in ("cuda", "hip")
    assert device.info.kind in ("gpu", "integrated-gpu")
    assert extra["compile_target"].split(":")[0].endswith(device.info.architecture.split("_")[-1])
    assert device.info.memory_bytes > 0


@pytest.mark.parametrize("weights", ["float16", "bfloat16"])
@pytest.mark.parametrize("name", checks.PROJECTIONS)
def test_projections_with_16_bit_weights(device: Device, name: str, weights: str) -> None:
    checks.check_projection_with_16_bit_weights(device, name, weights)


def test_tensor_core_projections_split_along_k(device: Device) -> None:
    checks.check_tensor_core_projections_split_along_k(device)


def test_embedding_of_a_half_table(device: Device) -> None:
    checks.check_embedding_of_a_half_table(device)


@pytest.mark.parametrize("head_dim, heads, kv_heads", checks.ATTENTION_SHAPES)
def test_attention_on_long_contexts(device: Device, head_dim: int, heads: int, kv_heads: int) -> None:
    checks.check_attention_on_long_contexts(device, head_dim, heads, kv_heads)


def test_split_kv_attention_splits_a_long_decode_once(device: Device) -> None:
    checks.check_split_kv_attention_splits_a_long_decode_once(device)


def test_random_batches_across_variants(device: Device) -> None:
    checks.check_random_batches_across_variants(device)


@pytest.mark.parametrize("cols, k", checks.TOP_K_SHAPES)
def test_top_k_candidates_match_a_stable_sort(device: Device, cols: int, k: int) -> None:
    checks.check_top_k(device, cols, k)


def test_a_small_llama_matches_the_cpu_engine(device: Device) -> None:
    checks.check_small_llama_against_the_cpu_engine(device, steps=8)


def test_large_projections_match_numpy(device: Device) -> None:
    """SmolLM2-sized shapes: the lm_head GEMV over 49152 rows and a 1536-wide prefill GEMM."""
    rng = np.random.default_rng(0)
    for tokens, k, n in ((1, 576, 49152), (200, 576, 1536)):
        x = rng.standard_normal((tokens, k)).astype(np.float32)
        w = (rng.standard_normal((n, k)) / 24).astype(np.float32)
        expected = x.astype(np.float64) @ w.astype(np.float64).T
        for variant in device.kernels()["linear"]:
            got = device.download(device.compile("linear", variant)(device.upload(x), device.upload(w), None))
            np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4, err_msg=f"linear[{variant}] {tokens}x{k}x{n}")


@pytest.mark.slow
def test_smollm2_greedy_tokens_match_the_cpu_engine(device: Device) -> None:
    from pie.model.loader import load_model
    from pie.model.store import resolve_model
    from pie.runtime.model_runner import ModelRunner, SequenceWork

    try:
        loaded = load_model(resolve_model(None))
    except Exception as exc:  # noqa: BLE001 - no network and no cached copy
        pytest.skip(f"SmolLM2 is not available: {exc}")
    cpu = EngineRegistry(env={}).engine("cpu").open(0)
    prompt = loaded.tokenizer.encode("The capital of France is")
    produced = []
    for target in (cpu, device):
        runner = ModelRunner(loaded.config, loaded.tensors(), target, max_cached_tokens=256)
        try:
            sequence = runner.new_sequence()
            logits = runner.step([SequenceWork(sequence, prompt)])[0]
            tokens = []
            for _ in range(24):
                tokens.append(int(np.argmax(logits)))
                logits = runner.step([SequenceWork(sequence, [tokens[-1]])])[0]
            produced.append(tokens)
        finally:
            runner.close()
    assert produced[1] == produced[0]


def test_the_engine_measures_the_gpus_read_bandwidth(device: Device) -> None:
    bandwidth = device.memory_bandwidth()
    print(f"read bandwidth of {device.info.name}: {bandwidth / 1e9:.0f} GB/s")
    assert bandwidth is not None and 1e9 < bandwidth < 1e14
