"""The shape of a Llama-family decoder, independent of the file it came from."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

ARCHITECTURES = ("llama", "qwen2")


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1's frequency-dependent rope scaling (`rope_type: llama3`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelConfig:
    """Hyperparameters of a Llama-family decoder.

    Rotary embeddings use the Hugging Face "rotate_half" (GPT-NeoX) layout: a head's first half
    of dimensions pairs with its second half. `attention_bias` means biased Q, K and V
    projections (always so for Qwen2); Llama's `attention_bias` biases the output projection too.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Llama3RopeScaling | None
    tie_word_embeddings: bool
    attention_bias: bool
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    # Per-frequency divisors some GGUF files carry as a `rope_freqs` tensor (llama.cpp's form of
    # Llama 3.1 scaling); applied after `rope_scaling`.
    rope_freq_factors: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"architecture {self.architecture!r} is not one of {ARCHITECTURES}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) is not a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps must be positive, got {self.rms_norm_eps!r}")
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta must be positive, got {self.rope_theta!r}")
        if self.rope_freq_factors is not None and len(self.rope_freq_factors) != self.head_dim // 2:
            raise ValueError(
                f"rope_freq_factors has {len(self.rope_freq_factors)} entries, expected {self.head_dim // 2}")

    def rope_inv_freq(self) -> np.ndarray:
        """Inverse rotary frequencies, float32 `[head_dim // 2]`, computed as transformers does."""
        dim = self.head_dim
        # float32 exponents, the power taken in float64 and rounded: bit-for-bit what torch does.
        exponent = (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)).astype(np.float64)
        inv_freq: np.ndarray = np.float32(1.0) / (np.float64(self.rope_theta) ** exponent).astype(np.float32)
        scaling = self.rope_scaling
        if scaling is not None:
            old_context = scaling.original_max_position_embeddings
            low_freq_wavelen = old_context / scaling.low_freq_factor
            high_freq_wavelen = old_context / scaling.high_freq_factor
            # torch computes `scalar / tensor` as `reciprocal(tensor) * scalar`; so do we, to match bits.
            wavelen = (np.float32(1) / inv_freq) * np.float32(2 * math.pi)
            scaled = np.where(wavelen > low_freq_wavelen, inv_freq / np.float32(scaling.factor), inv_freq)
            smooth = ((np.float32(1) / wavelen) * np.float32(old_context) - np.float32(scaling.low_freq_factor)) / (
                np.float32(scaling.high_freq_factor - scaling.low_freq_factor))
            smoothed = (1 - smooth) * scaled / np.float32(scaling.factor) + smooth * scaled
            is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
            inv_freq = np.where(is_medium, smoothed, scaled)
        if self.rope_freq_factors is not None:
            inv_freq = inv_freq / np.asarray(self.rope_freq_factors, dtype=np.float32)
        return np.ascontiguousarray(inv_freq, dtype=np.float32)


def weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every weight the model needs, by Hugging Face name, in load order, with its shape.

    Matrices are `[out_features, in_features]`.
    """
    hidden, q_dim = config.hidden_size, config.num_heads * config.head_dim
    kv_dim = config.num_kv_heads * config.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, hidden)}
    for i in range(config.num_layers):
        layer = f"model.layers.{i}"
        shapes[f"{layer}.input_layernorm.weight"] = (hidden,)
        shapes[f"{layer}.self_attn.q_proj.weight"] = (q_dim, hidden)
        shapes[f"{layer}.self_attn.k_proj.weight"] = (kv_dim, hidden)
        shapes[f"{layer}.self_attn.v_proj.weight"] = (kv_dim, hidden)
        if config.attention_bias:
            shapes[f"{layer}.self_attn.q_proj.bias"] = (q_dim,)
            shapes[f"{layer}.self_attn.k_proj.bias"] = (kv_dim,)
            shapes[f"{layer}.self_attn.v_proj.bias"] = (kv_dim,)
        shapes[f"{layer}.self_attn.o_proj.weight"] = (hidden, q_dim)
        if config.attention_bias and config.architecture == "llama":
            shapes[f"{layer}.self_attn.o_proj.bias"] = (hidden,)
        shapes[f"{layer}.post_attention_layernorm.weight"] = (hidden,)
        shapes[f"{layer}.mlp.gate_proj.weight"] = (config.intermediate_size, hidden)
        shapes[f"{layer}.mlp.up_proj.weight"] = (config.intermediate_size, hidden)
        shapes[f"{layer}.mlp.down_proj.weight"] = (hidden, config.intermediate_size)
    shapes["model.norm.weight"] = (hidden,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    return shapes
