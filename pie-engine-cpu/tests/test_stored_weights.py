"""Native projections and embeddings on weights in their stored types (F16, BF16, Q8_0, Q4_0, Q4_1), each against the
`gguf` library's dequantization, on both activation paths, and whole tiny models against their float32 copies."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from pie.model import load_model
from pie.plugins import EngineRegistry
from pie.runtime.model_runner import ModelRunner, SequenceWork
from pie.testing.kquants import random_blocks
from pie.testing.models import make_gguf_model
from pie.weights import StoredWeight, convert
from pie_engine_cpu import kernels, native

TYPES = ("f16", "bf16", "q8_0", "q4_0", "q4_1")
BLOCK_TYPES = ("q8_0", "q4_0", "q4_1")
# Rows that are not a multiple of the row blocks, odd and even block counts (the batch-1 GEMVs take blocks in
# pairs), one token to more than MAX_TOKENS (8) and more than a token block.
SHAPES = ((7, 96, 1), (33, 64, 1), (3, 32, 1), (37, 160, 3), (130, 576, 9), (5, 32, 17))
ALL_TOKENS = 1 << 30
"""An integer path's token limit that every pass here is within."""


def _reference_dequantized(weight: StoredWeight) -> np.ndarray:
    """The gguf library's own dequantization of the weight's bytes, as float64."""
    qtype = GGMLQuantizationType[weight.type.upper()]
    return dequantize(weight.data, qtype).reshape(weight.shape).astype(np.float64)


def _integer_activations(x: np.ndarray, top: int) -> np.ndarray:
    """x as an integer path sees it: each block of 32 rounded to steps of its largest |x| / top (127 or 32767)."""
    blocks = x.reshape(x.shape[0], -1, 32).astype(np.float32)
    d = np.abs(blocks).max(axis=2, keepdims=True) / np.float32(top)
    q = np.rint(blocks * np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), 0))
    return (q * d).reshape(x.shape).astype(np.float64)


@pytest.fixture
def activation_path(compiled: native.NativeKernels) -> Iterator[native.NativeKernels]:
    yield compiled
    compiled.quant_config(native.ACTIVATIONS[native.activations()], 0, native.INTEGER_MAX_TOKENS)


def _weight(rng: np.random.Generator, weight_type: str, rows: int, cols: int) -> StoredWeight:
    stored = convert((0.1 * rng.standard_normal((rows, cols))).astype(np.float32), weight_type)
    assert isinstance(stored, StoredWeight)
    return stored


@pytest.mark.parametrize("weight_type", TYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_float_path_matches_the_dequantized_weight(
    activation_path: native.NativeKernels, weight_type: str, shape: tuple[int, int, int]
) -> None:
    rows, cols, tokens = shape
    rng = np.random.default_rng(rows * cols + tokens)
    weight, x = _weight(rng, weight_type, rows, cols), rng.standard_normal((tokens, cols)).astype(np.float32)
    bias, residual = rng.standard_normal(rows).astype(np.float32), rng.standard_normal((tokens, rows)).astype(np.float32)
    reference = x.astype(np.float64) @ _reference_dequantized(weight).T
    activation_path.quant_config(native.ACTIVATIONS["float"], 0, 0)
    linear, linear_add = native.make_linear(kernels.linear), native.make_linear_add(kernels.linear_add)
    np.testing.assert_allclose(linear(x, weight, bias), reference + bias, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(linear_add(x, weight, residual), reference + residual, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("weight_type", (*BLOCK_TYPES, "q5_0"))
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
    weight, x = _weight(rng, weight_type, rows, cols), rng.standard_normal((tokens, cols)).astype(np.float32)
    activation_path.quant_config(native.ACTIVATIONS[activations], scalar, ALL_TOKENS)
    got = native.make_linear(kernels.linear)(x, weight)
    dequantized = _reference_dequantized(weight)
    np.testing.assert_allclose(got, _integer_activations(x, top) @ dequantized.T, rtol=1e-4, atol=1e-4)
    # And within the activations' rounding of the float product.
    exact = x.astype(np.float64) @ dequantized.T
    assert np.abs(got - exact).max() < within * np.abs(exact).max()


@pytest.mark.parametrize("weight_type", (*BLOCK_TYPES, "q5_0"))
@pytest.mark.parametrize("shape", ((130, 576, 9), (5, 32, 17), (41, 96, 32), (9, 160, 33), (64, 1536, 100)))
def test_batches_with_int16_activations_are_the_product_with_int16_activations(
    activation_path: native.NativeKernels, weight_type: str, shape: tuple[int, int, int]
) -> None:
    """Past MAX_TOKENS, int16 activations take the panels where the build has them (odd groups of 16 tokens, row
    counts off the row blocks), else the float path: either is within the int16 rounding of the exact product."""
    rows, cols, tokens = shape
    rng = np.random.default_rng(rows * cols + tokens + 2)
    weight, x = _weight(rng, weight_type, rows, cols), rng.standard_normal((tokens, cols)).astype(np.float32)
    residual = rng.standard_normal((tokens, rows)).astype(np.float32)
    activation_path.quant_config(native.ACTIVATIONS["int16"], 0, native.INTEGER_MAX_TOKENS)
    dequantized = _reference_dequantized(weight)
    want = (_integer_activations(x, 32767) if activation_path.has_panels else x.astype(np.float64)) @ dequantized.T
    np.testing.assert_allclose(native.make_linear(kernels.linear)(x, weight), want, rtol=1e-4, atol=1e-4)
    got = native.make_linear_add(kernels.linear_add)(x, weight, residual)
    np.testing.assert_allclose(got, want + residual, rtol=1e-4, atol=1e-4)


def test_avx512_vnni_builds_take_the_panels(compiled: native.NativeKernels, request: pytest.FixtureRequest) -> None:
    from pie.enginekit.host import cpu_flags

    native_build = request.node.callspec.params["compiled"] == "native"
    assert compiled.has_panels == (native_build and {"avx512f", "avx512bw", "avx512_vnni"} <= cpu_flags())


def test_passes_over_the_integer_token_limit_take_float_activations(activation_path: native.NativeKernels) -> None:
    rng = np.random.default_rng(11)
    weight = _weight(rng, "q4_1", 40, 128)
    dequantized, limit = _reference_dequantized(weight), native.INTEGER_MAX_TOKENS
    activation_path.quant_config(native.ACTIVATIONS["int8"], 0, limit)
    linear = native.make_linear(kernels.linear)
    for tokens in (limit, limit + 1):
        x = rng.standard_normal((tokens, 128)).astype(np.float32)
        got, exact = linear(x, weight), x.astype(np.float64) @ dequantized.T
        if tokens <= limit:  # int8 activations: their rounding shows
            np.testing.assert_allclose(got, _integer_activations(x, 127) @ dequantized.T, rtol=1e-4, atol=1e-4)
            assert np.abs(got - exact).max() > 1e-4 * np.abs(exact).max()
        else:
            np.testing.assert_allclose(got, exact, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("weight_type", TYPES)
def test_fused_projections_and_embedding_read_stored_weights(activation_path: native.NativeKernels, weight_type: str) -> None:
    rng = np.random.default_rng(5)
    tokens, cols, inter, rows = 3, 96, 64, 41
    x, norm = rng.standard_normal((tokens, cols)).astype(np.float32), rng.standard_normal(cols).astype(np.float32)
    weight, gate_up = _weight(rng, weight_type, rows, cols), _weight(rng, weight_type, 2 * inter, cols)
    activation_path.quant_config(native.ACTIVATIONS["float"], 0, 0)
    normed = kernels.make_rms_norm(1e-5)(x, norm)
    expected = normed.astype(np.float64) @ _reference_dequantized(weight).T
    got = native.make_rms_norm_linear(kernels.make_rms_norm_linear(1e-5), 1e-5)(x, norm, weight)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    both = normed.astype(np.float64) @ _reference_dequantized(gate_up).T
    gate, up = both[:, :inter], both[:, inter:]
    got = native.make_rms_norm_gate_up_silu(kernels.make_rms_norm_gate_up_silu(1e-5), 1e-5)(x, norm, gate_up)
    np.testing.assert_allclose(got, gate / (1 + np.exp(-gate)) * up, rtol=1e-5, atol=1e-5)
    table, ids = _weight(rng, weight_type, 50, cols), np.array([3, 0, 49, 3], np.int32)
    np.testing.assert_array_equal(native.make_embedding(kernels.embedding)(ids, table), _reference_dequantized(table)[ids])
    np.testing.assert_array_equal(kernels.embedding(ids, table), _reference_dequantized(table)[ids])
    with pytest.raises(IndexError):
        native.make_embedding(kernels.embedding)(np.array([50], np.int32), table)


def test_blas_rows_dequantize_the_stored_weight() -> None:
    rng = np.random.default_rng(2)
    weight, x = _weight(rng, "q4_1", 9, 64), rng.standard_normal((4, 64)).astype(np.float32)
    expected = x.astype(np.float64) @ _reference_dequantized(weight).T
    np.testing.assert_allclose(kernels.linear(x, weight), expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(kernels.ROWS.linear(x, weight), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("weight_type", ["f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q4_k", "q5_k", "q6_k"])
def test_native_dequantization_gives_the_gguf_librarys_values(compiled: native.NativeKernels, weight_type: str) -> None:
    """What the BLAS paths dequantize a stored weight with, on every build: the reference's exact values."""
    rng = np.random.default_rng(4)
    if weight_type in ("f16", "bf16"):  # every finite value and its neighbours (subnormals, zeros of both signs)
        weight = convert((rng.standard_normal((13, 512)) * 10.0 ** rng.integers(-9, 4, (13, 512))).astype(np.float32),
                         weight_type)
    else:
        weight = random_blocks(rng, weight_type, 13, 512)
    got = native.dequantized(weight)
    assert got.dtype == np.float32 and got.shape == (13, 512) and got.flags.c_contiguous
    np.testing.assert_array_equal(got, weight.dequantize())


def _logits(runner: ModelRunner, prompts: list[list[int]], steps: int) -> list[np.ndarray]:
    """A ragged prefill, then greedy batched decode steps (the stack of decoder layers), every step's logits."""
    sequences = [runner.new_sequence() for _ in prompts]
    out = [runner.step([SequenceWork(s, p) for s, p in zip(sequences, prompts, strict=True)])]
    for _ in range(steps):
        tokens = [int(np.argmax(row)) for row in out[-1]]
        out.append(runner.step([SequenceWork(s, [t]) for s, t in zip(sequences, tokens, strict=True)]))
    return out


@pytest.mark.parametrize("weight_type,activations", [
    (weight_type, activations) for weight_type in ("Q8_0", "Q4_1", "Q4_0") for activations in ("float", "int16", "int8")
] + [("F16", "float"), ("BF16", "float")])  # F16 and BF16 weights always take float activations
def test_tiny_model_matches_its_dequantized_float32_copy(tmp_path: Path, weight_type: str, activations: str) -> None:
    loaded = load_model(make_gguf_model(tmp_path / "m.gguf", weight_type, tie_word_embeddings=True))
    device = EngineRegistry().engine("cpu").open(0)
    kernels_ = native.load()
    kernels_.quant_config(native.ACTIVATIONS[activations], 0, native.INTEGER_MAX_TOKENS)
    try:
        stored = ModelRunner(loaded.config, loaded.stored_tensors(), device, page_size=4, max_cached_tokens=256)
        dense = ModelRunner(loaded.config, loaded.tensors(), device, page_size=4, max_cached_tokens=256)
        kept = {c.uploaded for c in stored.weight_choices.values() if not c.converted}
        assert weight_type.lower() in kept and not any(c.converted for c in stored.weight_choices.values())
        assert isinstance(stored._env[stored.plan.slots["w.embed"]], StoredWeight)
        rng = np.random.default_rng(3)
        prompts = [[int(t) for t in rng.integers(0, loaded.config.vocab_size, n)] for n in (11, 6)]
        for step, (got, want) in enumerate(zip(_logits(stored, prompts, 4), _logits(dense, prompts, 4), strict=True)):
            scale = np.abs(want).max()
            if activations == "float":
                np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * scale, err_msg=f"step {step}")
            else:  # integer activations: within their rounding, relative to the logits' spread
                within = 1e-3 if activations == "int16" else 0.05
                assert np.abs(got - want).max() < within * scale, f"step {step}"
    finally:
        kernels_.quant_config(native.ACTIVATIONS[native.activations()], 0, native.INTEGER_MAX_TOKENS)
