from __future__ import annotations

import re
from dataclasses import replace

import numpy as np
import pytest

from pie.model.config import (
    InvalidConfig,
    Llama3RopeScaling,
    ModelConfig,
    check_layer_indices,
    default_head_dim,
    weight_shapes,
)
from pie.models import ARCHITECTURES
from pie.testing.models import tiny_config

LLAMA31_SCALING = Llama3RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                    original_max_position_embeddings=8192)


def _transformers_inv_freq(config: ModelConfig) -> np.ndarray:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rope: dict = {"rope_type": "default", "rope_theta": config.rope_theta}
    if config.rope_scaling is not None:
        rope = {"rope_type": "llama3", "rope_theta": config.rope_theta, **vars(config.rope_scaling)}
    hf = LlamaConfig(hidden_size=config.num_heads * config.head_dim, num_attention_heads=config.num_heads,
                     head_dim=config.head_dim, max_position_embeddings=131072, rope_parameters=rope)
    return LlamaRotaryEmbedding(hf).inv_freq.numpy()


@pytest.mark.parametrize("scaling", [
    None, LLAMA31_SCALING, Llama3RopeScaling(factor=4.0, low_freq_factor=1.5, high_freq_factor=5.0,
                                             original_max_position_embeddings=3000),
], ids=["default", "llama3.1", "llama3-odd"])
@pytest.mark.parametrize("head_dim,theta", [(64, 10000.0), (64, 100000.0), (128, 500000.0)])
def test_rope_inv_freq_matches_transformers(scaling: Llama3RopeScaling | None, head_dim: int, theta: float) -> None:
    pytest.importorskip("transformers")
    config = tiny_config(num_heads=4, num_kv_heads=4, head_dim=head_dim, rope_theta=theta, rope_scaling=scaling)
    ours = config.rope_inv_freq()
    assert ours.dtype == np.float32 and ours.shape == (head_dim // 2,)
    np.testing.assert_array_equal(ours, _transformers_inv_freq(config))  # bit for bit


def test_llama3_scaling_keeps_high_frequencies_and_divides_low_ones() -> None:
    base = tiny_config(head_dim=128, num_heads=2, num_kv_heads=2, rope_theta=500000.0)
    plain, scaled = base.rope_inv_freq(), replace(base, rope_scaling=LLAMA31_SCALING).rope_inv_freq()
    assert scaled[0] == plain[0]
    np.testing.assert_allclose(scaled[-1], plain[-1] / 8.0, rtol=1e-6)


def test_rope_freq_factors_divide_the_frequencies() -> None:
    config = tiny_config()
    factors = tuple(float(x) for x in np.linspace(1.0, 4.0, config.head_dim // 2))
    np.testing.assert_allclose(replace(config, rope_freq_factors=factors).rope_inv_freq(),
                               config.rope_inv_freq() / np.asarray(factors, np.float32), rtol=1e-7)


@pytest.mark.parametrize("change,message", [
    ({"architecture": "gpt2"}, "architecture"),
    ({"num_kv_heads": 3}, "num_kv_heads"),
    ({"hidden_size": 0}, "hidden_size"),
    ({"head_dim": 15}, "head_dim"),
    ({"rms_norm_eps": 0.0}, "rms_norm_eps"),
    ({"rope_freq_factors": (1.0,)}, "rope_freq_factors"),
    ({"rope_freq_factors": (float("nan"),) * 8}, "'rope_freq_factors' holds a value that is not a positive number"),
    ({"num_layers": 2**31}, "'num_layers' must be an integer from 1 to 2147483647, got 2147483648"),
    ({"vocab_size": 2.0}, "'vocab_size' must be an integer"),
    ({"rope_theta": float("inf")}, "'rope_theta' must be a positive number, got inf"),
    ({"bos_token_id": -1}, "'bos_token_id' is -1, outside the vocabulary of"),
    ({"eos_token_ids": (2, 400)}, "'eos_token_ids' is 400, outside the vocabulary of"),
])
def test_invalid_configs_are_rejected(change: dict, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        tiny_config(**change)


def test_an_invalid_config_is_told_in_a_file_s_own_names() -> None:
    with pytest.raises(InvalidConfig) as info:
        tiny_config(num_kv_heads=3)
    assert info.value.naming({"num_heads": "n_head"}) == "'n_head' (4) is not a multiple of 'num_kv_heads' (3)"
    assert default_head_dim(64, 4) == 16
    with pytest.raises(InvalidConfig, match="'hidden_size' .64. is not a multiple of 'num_heads' .5."):
        default_head_dim(64, 5)


def test_layer_count_must_match_the_layers_present() -> None:
    check_layer_indices(2, {0, 1})
    with pytest.raises(InvalidConfig, match="'num_layers' is 10000000, but the file holds tensors for 2 layers"):
        check_layer_indices(10**7, {0, 1})
    with pytest.raises(InvalidConfig, match="'num_layers' is 2, but the file's layers are numbered 0 to 7"):
        check_layer_indices(2, {0, 7})


def test_describe_shape_names_the_fields_of_each_dimension() -> None:
    names = {"num_kv_heads": "num_key_value_heads"}
    describe_shape = ARCHITECTURES["llama"].describe_shape
    assert describe_shape("model.layers.3.self_attn.k_proj.weight", names) == "[num_key_value_heads × head_dim, hidden_size]"
    assert describe_shape("model.embed_tokens.weight", names) == "[vocab_size, hidden_size]"


def test_weight_shapes_follow_hugging_face_names_and_layout() -> None:
    config = tiny_config(attention_bias=True, tie_word_embeddings=True)
    shapes = weight_shapes(config)
    assert shapes["model.layers.1.self_attn.q_proj.weight"] == (64, 64)
    assert shapes["model.layers.1.self_attn.k_proj.weight"] == (32, 64)
    assert shapes["model.layers.0.self_attn.k_proj.bias"] == (32,)
    assert shapes["model.layers.1.self_attn.o_proj.bias"] == (64,)  # Llama biases all four projections
    assert shapes["model.layers.0.mlp.down_proj.weight"] == (64, 128)
    assert "lm_head.weight" not in shapes
    assert next(iter(shapes)) == "model.embed_tokens.weight" and list(shapes)[-1] == "model.norm.weight"
    assert len(shapes) == 1 + 2 * 13 + 1
    qwen2 = weight_shapes(tiny_config(architecture="qwen2"))
    assert "model.layers.0.self_attn.q_proj.bias" in qwen2 and "model.layers.0.self_attn.o_proj.bias" not in qwen2
