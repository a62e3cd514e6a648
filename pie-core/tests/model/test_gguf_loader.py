from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pie.model import Llama3RopeScaling, load_model, weight_shapes
from pie.testing.models import (
    make_gguf_model,
    random_weights,
    tiny_config,
    tiny_tokenizer,
)

# Largest |error| allowed per weight type, relative to the largest |weight| of the tensor's block.
QUANT_STEP = {"Q8_0": 1 / 127, "Q4_0": 1 / 8, "Q4_1": 1 / 15}


def _bf16(x: np.ndarray) -> np.ndarray:
    """Round to bfloat16 (nearest even) and back, independently of gguf."""
    import torch

    return torch.from_numpy(x).bfloat16().float().numpy()


@pytest.mark.parametrize("weight_type", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"])
def test_weights_match_originals(tmp_path: Path, weight_type: str) -> None:
    loaded = load_model(make_gguf_model(tmp_path / "m.gguf", weight_type))
    originals = random_weights(tiny_config())
    names = []
    for name, array in loaded.tensors():
        names.append(name)
        original = originals[name]
        assert array.dtype == np.float32 and array.shape == original.shape
        assert array.flags.c_contiguous and array.flags.writeable
        if original.ndim == 1 or weight_type == "F32":
            np.testing.assert_array_equal(array, original, err_msg=name)
        elif weight_type == "F16":
            np.testing.assert_array_equal(array, original.astype(np.float16).astype(np.float32), err_msg=name)
        elif weight_type == "BF16":
            pytest.importorskip("torch")
            np.testing.assert_array_equal(array, _bf16(original), err_msg=name)
        else:
            blocks = np.abs(original).reshape(-1, 32).max(axis=1, keepdims=True)
            error = np.abs(array - original).reshape(-1, 32)
            assert np.all(error <= blocks * QUANT_STEP[weight_type] * 1.01 + 1e-6), name
    assert names == list(weight_shapes(loaded.config))


def test_config_and_tokenizer_from_metadata(tiny_gguf_model: Path) -> None:
    loaded = load_model(tiny_gguf_model)
    assert loaded.config == tiny_config()
    reference = tiny_tokenizer()
    for text in ["Hello wörld!", "The quick brown fox 12345", "日本語 and emoji 😀🎉", "  spaces\n\tand tabs"]:
        assert loaded.tokenizer.encode(text) == reference.encode(text).ids
        assert loaded.tokenizer.encode(text, add_special_tokens=False) == reference.encode(text, add_special_tokens=False).ids
    text = loaded.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<|endoftext|><|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_qk_unpermute_matches_transformers_gguf_loader(tiny_gguf_model: Path) -> None:
    """transformers undoes llama.cpp's Q/K permutation too; both must give the same weights."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # transformers needs it to read GGUF
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_gguf_model.parent, gguf_file=tiny_gguf_model.name)
    reference = {name: tensor.numpy() for name, tensor in model.state_dict().items()}
    for name, array in load_model(tiny_gguf_model).tensors():
        np.testing.assert_array_equal(array, reference[name], err_msg=name)


def test_qwen2_has_bias_and_no_permutation(tmp_path: Path) -> None:
    loaded = load_model(make_gguf_model(tmp_path / "qwen.gguf", "F16", architecture="qwen2", tie_word_embeddings=True))
    assert loaded.config.architecture == "qwen2" and loaded.config.attention_bias
    assert loaded.config.tie_word_embeddings
    originals = random_weights(tiny_config(architecture="qwen2", tie_word_embeddings=True))
    tensors = dict(loaded.tensors())
    assert "lm_head.weight" not in tensors
    np.testing.assert_array_equal(tensors["model.layers.0.self_attn.q_proj.bias"],
                                  originals["model.layers.0.self_attn.q_proj.bias"])
    np.testing.assert_array_equal(tensors["model.layers.1.self_attn.k_proj.weight"],
                                  originals["model.layers.1.self_attn.k_proj.weight"].astype(np.float16).astype(np.float32))


def test_llama_biases_and_qk_bias_unpermuted(tmp_path: Path) -> None:
    loaded = load_model(make_gguf_model(tmp_path / "bias.gguf", "F32", attention_bias=True))
    assert loaded.config.attention_bias and "model.layers.1.self_attn.o_proj.bias" in weight_shapes(loaded.config)
    originals = random_weights(tiny_config(attention_bias=True))
    for name, array in loaded.tensors():
        np.testing.assert_array_equal(array, originals[name], err_msg=name)


def test_rope_freqs_tensor_becomes_frequency_factors(tmp_path: Path) -> None:
    factors = tuple(float(f) for f in np.linspace(1.0, 8.0, 8))
    config = load_model(make_gguf_model(tmp_path / "rope.gguf", "F32", rope_freq_factors=factors)).config
    assert config.rope_freq_factors == factors
    np.testing.assert_allclose(config.rope_inv_freq(), tiny_config().rope_inv_freq() / np.float32(factors), rtol=1e-7)


def test_llama3_rope_scaling_round_trips_as_frequency_factors(tmp_path: Path) -> None:
    scaling = Llama3RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64)
    config = load_model(make_gguf_model(tmp_path / "llama3.gguf", "F32", rope_scaling=scaling, rope_theta=500000.0)).config
    assert config.rope_scaling is None and config.rope_freq_factors is not None
    expected = tiny_config(rope_scaling=scaling, rope_theta=500000.0).rope_inv_freq()
    np.testing.assert_allclose(config.rope_inv_freq(), expected, rtol=2e-7)
