"""Weights carried in their stored type (pie.weights): the loader, the choice of upload type, stacking."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pie.model import load_model
from pie.testing.models import make_gguf_model
from pie.weights import (
    StoredWeight,
    choose_weight_types,
    convert,
    describe_choices,
    upload_type,
    stack_rows,
    weight_type,
)


@pytest.mark.parametrize("weight_type_name", ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1"])
def test_stored_tensors_dequantize_to_the_float_tensors(tmp_path: Path, weight_type_name: str) -> None:
    loaded = load_model(make_gguf_model(tmp_path / "m.gguf", weight_type_name))
    dense = dict(loaded.tensors())
    for name, weight in loaded.stored_tensors():
        if dense[name].ndim == 1:
            assert isinstance(weight, np.ndarray) and weight.dtype == np.float32
            continue
        assert isinstance(weight, StoredWeight) and weight.type == weight_type_name.lower(), name
        assert weight.shape == dense[name].shape
        # Q and K rows are reordered (llama.cpp's rope permutation undone) as byte rows: exactly the float rows.
        np.testing.assert_array_equal(weight.dequantize(), dense[name], err_msg=name)


def test_an_unpermuted_weight_is_a_copy_and_the_rest_view_the_file(tmp_path: Path) -> None:
    loaded = load_model(make_gguf_model(tmp_path / "m.gguf", "Q8_0"))
    stored = dict(loaded.stored_tensors())
    assert not stored["model.layers.0.mlp.down_proj.weight"].data.flags.writeable  # the memory map itself
    assert stored["model.layers.0.self_attn.q_proj.weight"].data.flags.writeable


def test_stacking_keeps_a_shared_type_and_falls_back_to_float32() -> None:
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((4, 64)).astype(np.float32), rng.standard_normal((2, 64)).astype(np.float32)
    qa, qb = convert(a, "q8_0"), convert(b, "q8_0")
    stacked = stack_rows([qa, qb])
    assert isinstance(stacked, StoredWeight) and stacked.shape == (6, 64)
    np.testing.assert_array_equal(stacked.dequantize(), np.concatenate([qa.dequantize(), qb.dequantize()]))
    mixed = stack_rows([qa, convert(b, "q4_1")])
    assert weight_type(mixed) == "f32" and mixed.shape == (6, 64)


@pytest.mark.parametrize("narrow", ["q5_0", "q4_0"])
def test_q8_0_holds_q5_0_and_q4_0_exactly_so_a_mixed_stack_stays_8_bit(narrow: str) -> None:
    rng = np.random.default_rng(1)
    # Odd row counts, values spread over several magnitudes, and a block of zeros (scale 0).
    q, k = rng.standard_normal((5, 96)).astype(np.float32) * 3, rng.standard_normal((3, 96)).astype(np.float32)
    q[2, 32:64] = 0.0
    v = convert(rng.standard_normal((3, 96)).astype(np.float32) / 7, "q8_0")
    parts = [convert(q, narrow), convert(k, narrow), v]
    stacked = stack_rows(parts)
    assert isinstance(stacked, StoredWeight) and stacked.type == "q8_0" and stacked.shape == (11, 96)
    np.testing.assert_array_equal(stacked.dequantize(), np.concatenate([p.dequantize() for p in parts]))


def test_a_stored_weight_checks_its_layout() -> None:
    with pytest.raises(ValueError, match="whole blocks"):
        StoredWeight("q8_0", (2, 40), np.zeros((2, 40), np.uint8))
    with pytest.raises(ValueError, match="uint8"):
        StoredWeight("q4_1", (2, 64), np.zeros((2, 20), np.uint8))


def test_a_weight_not_taken_as_stored_goes_to_float32_never_to_another_quantization() -> None:
    assert upload_type("q4_1", {"q4_1"}) == "q4_1"
    assert upload_type("q4_1", set()) == "f32"
    assert upload_type("q4_0", {"q8_0"}) == "f32"  # q8_0 would quantize it a second time
    assert upload_type("bf16", {"f16", "q8_0"}) == "f32"  # f16 cannot hold bf16's range


def test_choice_needs_every_reader_and_the_plan_lists_conversions() -> None:
    readers = {"w.L0.qkv": {"rms_norm_linear"}, "w.embed": {"embedding", "linear"}, "w.L0.ln1": {"rms_norm"}}
    declared = {"rms_norm_linear": ("q4_1",), "linear": ("q4_1",)}
    choices = choose_weight_types(readers, {"w.L0.qkv": "q4_1", "w.embed": "q4_1", "w.L0.ln1": "f32"}, declared)
    assert choices["w.L0.qkv"].uploaded == "q4_1" and not choices["w.L0.qkv"].converted
    assert choices["w.embed"].uploaded == "f32" and choices["w.embed"].readers == ("embedding", "linear")
    text = describe_choices(choices)
    assert "as stored: 1 f32, 1 q4_1" in text and "q4_1 -> f32: w.embed (read by embedding, linear)" in text
