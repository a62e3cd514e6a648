"""Native projections and embeddings on Q5_0 and the K-quants (Q4_K, Q5_K, Q6_K): random valid blocks against
the `gguf` library's dequantization on every activation path and build, and a tiny K-quant model against its
float32 copy."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from pie.model import load_model
from pie.plugins import EngineRegistry
from pie.runtime.model_runner import ModelRunner
from pie.testing.kquants import quantize_k, random_blocks
from pie.testing.model_parity import KQuantModelParity
from pie.testing.models import make_k_quant_model
from pie_engine_cpu import kernels, native
import test_stored_weights
from test_stored_weights import ALL_TOKENS, _integer_activations, _logits, _reference_dequantized

activation_path = test_stored_weights.activation_path
"""The fixture: a compiled build, its activation path restored after the test."""

TYPES = ("q5_0", "q4_k", "q5_k", "q6_k")
# Odd row counts, one to several super-blocks a row, one token to more than MAX_TOKENS (8) and a token block.
SHAPES = ((7, 256, 1), (9, 768, 1), (37, 512, 3), (13, 768, 9), (5, 256, 17))


@pytest.mark.parametrize("weight_type", TYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_float_path_matches_the_dequantized_blocks(
    activation_path: native.NativeKernels, weight_type: str, shape: tuple[int, int, int]
) -> None:
    rows, cols, tokens = shape
    rng = np.random.default_rng(rows * cols + tokens)
    weight, x = random_blocks(rng, weight_type, rows, cols), rng.standard_normal((tokens, cols)).astype(np.float32)
    bias = rng.standard_normal(rows).astype(np.float32)
    reference = x.astype(np.float64) @ _reference_dequantized(weight).T + bias
    activation_path.quant_config(native.ACTIVATIONS["float"], 0, 0)
    got = native.make_linear(kernels.linear)(x, weight, bias)  # random blocks: sums in the hundreds
    np.testing.assert_allclose(got, reference, rtol=1e-5, atol=1e-6 * np.abs(reference).max())


@pytest.mark.parametrize("weight_type", TYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("scalar", [0, 1], ids=["vector", "scalar"])
@pytest.mark.parametrize(("activations", "top", "within"), [("int8", 127, 0.02), ("int16", 32767, 1e-4)])
def test_integer_paths_are_the_product_with_integer_activations(
    activation_path: native.NativeKernels,
    weight_type: str,
    shape: tuple[int, int, int],
    scalar: int,
    activations: str,
    top: int,
    within: float,
) -> None:
    rows, cols, tokens = shape
    rng = np.random.default_rng(rows * cols + tokens + 1)
    weight, x = random_blocks(rng, weight_type, rows, cols), rng.standard_normal((tokens, cols)).astype(np.float32)
    activation_path.quant_config(native.ACTIVATIONS[activations], scalar, ALL_TOKENS)
    got = native.make_linear(kernels.linear)(x, weight)
    dequantized = _reference_dequantized(weight)
    scale = np.abs(x.astype(np.float64) @ dequantized.T).max()
    np.testing.assert_allclose(got, _integer_activations(x, top) @ dequantized.T, rtol=1e-4, atol=1e-5 * scale)
    assert np.abs(got - x.astype(np.float64) @ dequantized.T).max() < within * scale


@pytest.mark.parametrize("weight_type", ("q4_k", "q5_k", "q6_k"))
@pytest.mark.parametrize("shape", ((13, 768, 9), (5, 256, 17), (41, 512, 33)))
def test_batches_with_int16_activations_are_the_product_with_int16_activations(
    activation_path: native.NativeKernels, weight_type: str, shape: tuple[int, int, int]
) -> None:
    """The panels where the build has them (Q6_K's half-group scales apart), else the float path."""
    rows, cols, tokens = shape
    rng = np.random.default_rng(rows * cols + tokens + 2)
    weight, x = random_blocks(rng, weight_type, rows, cols), rng.standard_normal((tokens, cols)).astype(np.float32)
    activation_path.quant_config(native.ACTIVATIONS["int16"], 0, native.INTEGER_MAX_TOKENS)
    got = native.make_linear(kernels.linear)(x, weight)
    dequantized = _reference_dequantized(weight)
    scale = np.abs(x.astype(np.float64) @ dequantized.T).max()
    want = (_integer_activations(x, 32767) if activation_path.has_panels else x.astype(np.float64)) @ dequantized.T
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * scale)


@pytest.mark.parametrize("weight_type", TYPES)
def test_fused_projections_and_embedding_read_the_blocks(activation_path: native.NativeKernels, weight_type: str) -> None:
    rng = np.random.default_rng(9)
    tokens, cols, inter = 2, 256, 96
    x, norm = rng.standard_normal((tokens, cols)).astype(np.float32), rng.standard_normal(cols).astype(np.float32)
    gate_up = random_blocks(rng, weight_type, 2 * inter, cols)
    activation_path.quant_config(native.ACTIVATIONS["float"], 0, 0)
    normed = kernels.make_rms_norm(1e-5)(x, norm)
    both = normed.astype(np.float64) @ _reference_dequantized(gate_up).T
    gate, up = both[:, :inter], both[:, inter:]
    got = native.make_rms_norm_gate_up_silu(kernels.make_rms_norm_gate_up_silu(1e-5), 1e-5)(x, norm, gate_up)
    want = gate / (1 + np.exp(-gate)) * up
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * np.abs(want).max())
    table, ids = random_blocks(rng, weight_type, 31, cols), np.array([3, 0, 30, 3], np.int32)
    np.testing.assert_array_equal(native.make_embedding(kernels.embedding)(ids, table), _reference_dequantized(table)[ids])


@pytest.mark.parametrize("weight_type", ["q4_k", "q5_k", "q6_k"])
def test_the_test_quantizer_writes_blocks_near_its_input(weight_type: str) -> None:
    rng = np.random.default_rng(4)
    x = rng.standard_normal((3, 512)).astype(np.float32)
    error = np.abs(quantize_k(x, weight_type).dequantize() - x).max()
    # Half a step of the coarsest group: 4 bits over about 6 sigma, 5 bits, 6 bits over the largest |x|.
    assert error < {"q4_k": 0.25, "q5_k": 0.12, "q6_k": 0.08}[weight_type] * np.abs(x).max()
    assert error > 0  # and it did quantize


class TestCpuKQuantModel(KQuantModelParity):
    engine = "cpu"
    stored_types = frozenset({"q4_k", "q5_k", "q6_k"})


@pytest.mark.parametrize("activations", ["float", "int16"])
def test_k_quant_model_logits_match_its_float32_copy(tmp_path: Path, activations: str) -> None:
    loaded = load_model(make_k_quant_model(tmp_path / "m.gguf"))
    device = EngineRegistry().engine("cpu").open(0)
    compiled = native.load()
    compiled.quant_config(native.ACTIVATIONS[activations], 0, native.INTEGER_MAX_TOKENS)
    try:
        stored = ModelRunner(loaded.config, loaded.stored_tensors(), device, page_size=4, max_cached_tokens=256)
        dense = ModelRunner(loaded.config, loaded.tensors(), device, page_size=4, max_cached_tokens=256)
        rng = np.random.default_rng(3)
        prompts = [[int(t) for t in rng.integers(0, loaded.config.vocab_size, n)] for n in (11, 6)]
        for step, (got, want) in enumerate(zip(_logits(stored, prompts, 4), _logits(dense, prompts, 4), strict=True)):
            scale = np.abs(want).max()
            within = 1e-4 if activations == "float" else 1e-3
            assert np.abs(got - want).max() < within * scale, f"step {step}"
    finally:
        compiled.quant_config(native.ACTIVATIONS[native.activations()], 0, native.INTEGER_MAX_TOKENS)
