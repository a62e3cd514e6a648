"""Weights read as stored on the Metal engine (``weights.metal``), on the CPU emulator: every
projection variant and the embedding per stored type against the ``gguf.quants`` dequantization
(float32 accumulation), and tiny GGUF models (Q8_0, Q4_1, a Q4_K_M-like K-quant mix) against their
float32 copies on the CPU engine."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from pie import kernels
from pie.enginekit.tensor import StoredTensor
from pie.kernels import WEIGHT_KERNELS
from pie.model import load_model
from pie.plugins import Device, EngineRegistry
from pie.runtime.model_runner import ModelRunner, SequenceWork
from pie.testing.kquants import K_TYPES, quantize_k
from pie.testing.models import make_gguf_model, make_k_quant_model
from pie.weights import StoredWeight, quantize
from pie_engine_metal.weights import STORED_TYPES

PROJECTIONS = ("linear", "rms_norm_linear", "linear_add", "rms_norm_gate_up_silu")
SHAPES = ((1, 64, 33), (3, 160, 35), (6, 96, 37))
"""(tokens, k, n): batch 1 and more (past the gemv's 4 tokens a pass), an odd number of weight rows
(out columns when paired), k of two to five 32-weight blocks."""
K_SHAPES = ((1, 256, 33), (3, 512, 35), (6, 256, 37))
"""The same for the K-quants, whose rows are whole super-blocks of 256."""


def _stored(array: np.ndarray, weight_type: str) -> StoredWeight:
    """``array`` in ``weight_type``; the ``gguf`` library writes no K-quant, ``pie.testing.kquants`` does."""
    stored = quantize_k(array, weight_type) if weight_type in K_TYPES else quantize(array, weight_type)
    assert isinstance(stored, StoredWeight)
    return stored


@pytest.fixture(scope="module")
def metal() -> Device:
    from msl_emulator.engine import emulated_registry

    return emulated_registry().engine("metal").open(0)


def _case(name: str, rng: np.random.Generator, tokens: int, k: int, n: int) -> tuple[tuple, dict, int]:
    """Host inputs, options and the index of the weight among them."""
    x = rng.standard_normal((tokens, k)).astype(np.float32)
    norm = (1 + 0.1 * rng.standard_normal(k)).astype(np.float32)
    w = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    if name == "linear":
        return (x, w, bias), {}, 1
    if name == "rms_norm_linear":
        return (x, norm, w, bias), {"eps": 1e-5}, 2
    if name == "linear_add":
        return (x, w, rng.standard_normal((tokens, n)).astype(np.float32)), {}, 1
    return (x, norm, w), {"eps": 1e-5}, 2


def test_the_engine_declares_every_stored_type_for_the_kernels_reading_weights(metal: Device) -> None:
    declared = metal.weight_types()
    assert set(declared) == set(WEIGHT_KERNELS)
    assert all(set(types) == {"f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q4_k", "q5_k", "q6_k"} for types in declared.values())


@pytest.mark.parametrize("weight_type", STORED_TYPES)
@pytest.mark.parametrize("name", PROJECTIONS)
def test_projections_read_weights_as_stored(metal: Device, name: str, weight_type: str) -> None:
    rng = np.random.default_rng(len(name) + len(weight_type))
    for tokens, k, n in K_SHAPES if weight_type in K_TYPES else SHAPES:
        n = 2 * n if name == "rms_norm_gate_up_silu" else n
        inputs, options, wi = _case(name, rng, tokens, k, n)
        stored = _stored(inputs[wi], weight_type)
        expected = kernels.REFERENCE[name](*inputs[:wi], stored.dequantize(), *inputs[wi + 1 :], **options)
        for variant in metal.kernels()[name]:
            uploaded = [metal.upload(a) for a in inputs]
            uploaded[wi] = metal.upload_weights([stored])[0]
            got = metal.download(metal.compile(name, variant, **options)(*uploaded))
            np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4,
                                       err_msg=f"{name}[{variant}] {weight_type} {tokens}x{k}x{n}")


@pytest.mark.parametrize("weight_type", STORED_TYPES)
def test_embedding_of_a_stored_table(metal: Device, weight_type: str) -> None:
    rng = np.random.default_rng(7)
    stored = _stored(rng.standard_normal((51, 256)).astype(np.float32), weight_type)
    table = metal.upload_weights([stored])[0]
    assert table.type == weight_type and table.words.nbytes == StoredTensor.packed(stored.data).nbytes, (
        "the table stays in its stored bytes"
    )
    ids = np.array([3, 50, 0, 3, 17], np.int32)
    got = metal.download(metal.compile("embedding")(metal.upload(ids), table))
    np.testing.assert_allclose(got, stored.dequantize()[ids], rtol=1e-6, atol=1e-7)


def test_a_weight_of_other_columns_is_refused(metal: Device) -> None:
    stored = quantize(np.ones((8, 64), np.float32), "q4_1")
    linear = metal.compile("linear", "gemv")
    with pytest.raises(ValueError, match=r"has 32 columns, the weight \(8, 64\) takes 64"):
        linear(metal.upload(np.ones((1, 32), np.float32)), metal.upload_weights([stored])[0], None)


def _model(folder: Path, kind: str) -> tuple[Path, set[str]]:
    """A tiny GGUF of one weight type, or the Q4_K_M-like mix of Q4_K, Q5_K and Q6_K; and its matrix types."""
    if kind == "Q4_K_M":
        return make_k_quant_model(folder / "q4_k_m.gguf"), {"q4_k", "q5_k", "q6_k"}
    return make_gguf_model(folder / "m.gguf", kind, tie_word_embeddings=True), {kind.lower()}


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_1", "Q4_K_M"])
def test_a_stored_model_matches_its_float32_copy_on_the_cpu_engine(metal: Device, tmp_path: Path, kind: str) -> None:
    path, weight_types = _model(tmp_path, kind)
    loaded = load_model(path)
    cpu = EngineRegistry(env={}).engine("cpu").open(0)
    dense = ModelRunner(loaded.config, loaded.tensors(), cpu, page_size=4, max_cached_tokens=128)
    stored = ModelRunner(loaded.config, loaded.stored_tensors(), metal, page_size=4, max_cached_tokens=128)
    try:
        kept = {c.uploaded for c in stored.weight_choices.values() if not c.converted}
        assert weight_types <= kept and not any(c.converted for c in stored.weight_choices.values())
        prompt = [int(t) for t in np.random.default_rng(0).integers(3, loaded.config.vocab_size, 11)]
        sequences = [runner.new_sequence() for runner in (dense, stored)]
        want, got = (r.step([SequenceWork(s, prompt)])[0] for r, s in zip((dense, stored), sequences))
        for step in range(4):
            scale = np.abs(want).max()
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * scale, err_msg=f"step {step}")
            token = int(np.argmax(want))
            assert int(np.argmax(got)) == token, f"step {step}"
            want, got = (r.step([SequenceWork(s, [token])])[0] for r, s in zip((dense, stored), sequences))
    finally:
        stored.close()
        dense.close()
