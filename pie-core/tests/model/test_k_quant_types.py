"""Q5_0 and the K-quants (Q4_K, Q5_K, Q6_K) as weight types: their layout, where they rank, what they convert
to, and a K-quant GGUF through the loader."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from pie.model import load_model
from pie.testing.kquants import quantize_k, random_blocks
from pie.testing.models import Q4_K_M_TYPES, make_gguf_model, make_k_quant_model
from pie.weights import QUANTIZABLE, WEIGHT_TYPES, StoredWeight, convert, upload_type, row_bytes


def test_every_type_has_the_gguf_librarys_layout() -> None:
    for name, (ggml_name, block, size) in WEIGHT_TYPES.items():
        assert gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[ggml_name]] == (block, size), name


def test_a_k_quant_row_is_whole_super_blocks() -> None:
    assert row_bytes("q4_k", 512) == 288 and row_bytes("q6_k", 256) == 210
    with pytest.raises(ValueError, match="a q4_k row holds whole blocks of 256; 576 columns do not"):
        row_bytes("q4_k", 576)  # SmolLM2's width: llama.cpp writes Q5_0 there instead


def test_k_quants_convert_only_to_types_the_gguf_library_writes() -> None:
    assert upload_type("q6_k", {"q8_0", "q4_0"}) == "f32"  # an engine without q6_k gets it exactly
    assert upload_type("q5_k", {"q5_k"}) == "q5_k"
    weight = random_blocks(np.random.default_rng(0), "q6_k", 3, 256)
    converted = convert(weight, "q8_0")
    assert isinstance(converted, StoredWeight) and converted.type == "q8_0"
    np.testing.assert_allclose(converted.dequantize(), weight.dequantize(), atol=np.abs(weight.dequantize()).max() / 200)
    with pytest.raises(ValueError, match="cannot be converted to 'q4_k'"):
        convert(weight, "q4_k")
    assert "q4_k" not in QUANTIZABLE


def test_the_test_quantizer_rejects_what_it_does_not_write() -> None:
    with pytest.raises(ValueError, match="not 'q4_0'"):
        quantize_k(np.zeros((1, 256), np.float32), "q4_0")
    with pytest.raises(ValueError, match="whole blocks of 256"):
        quantize_k(np.zeros((1, 64), np.float32), "q6_k")
    with pytest.raises(ValueError, match="block types, not 'f16'"):
        random_blocks(np.random.default_rng(0), "f16", 1, 256)


def test_a_k_quant_gguf_loads_in_its_types(tmp_path: Path) -> None:
    loaded = load_model(make_k_quant_model(tmp_path / "m.gguf"))
    dense = dict(loaded.tensors())
    kinds = {}
    for name, weight in loaded.stored_tensors():
        if dense[name].ndim == 1:
            continue
        assert isinstance(weight, StoredWeight), name
        kinds[name] = weight.type
        # Q and K rows unpermuted as byte rows: exactly the library's dequantized rows.
        np.testing.assert_array_equal(weight.dequantize(), dense[name], err_msg=name)
    for name, kind in kinds.items():
        want = next((t.lower() for part, t in Q4_K_M_TYPES.items() if part in name), "q4_k")
        assert kind == want, name
    assert set(kinds.values()) == {"q4_k", "q5_k", "q6_k"}


def test_a_q5_0_gguf_loads_in_its_type(tmp_path: Path) -> None:
    loaded = load_model(make_gguf_model(tmp_path / "m.gguf", "Q5_0"))
    stored = dict(loaded.stored_tensors())
    assert stored["model.layers.1.mlp.up_proj.weight"].type == "q5_0"
