"""Llama 2 and 3 (and SmolLM2, which is a Llama): the family the others vary."""

from __future__ import annotations

from typing import ClassVar

from .base import FFN, HIDDEN, KV, Q, Architecture, LayerWeight

ATTENTION_WEIGHTS = (
    LayerWeight("input_layernorm.weight", (HIDDEN,), "attn_norm", "attn_norm.weight"),
    LayerWeight("self_attn.q_proj.weight", (Q, HIDDEN), "qkv", "attn_q.weight"),
    LayerWeight("self_attn.k_proj.weight", (KV, HIDDEN), "qkv", "attn_k.weight"),
    LayerWeight("self_attn.v_proj.weight", (KV, HIDDEN), "qkv", "attn_v.weight"),
    LayerWeight("self_attn.q_proj.bias", (Q,), "qkv_bias", "attn_q.bias"),
    LayerWeight("self_attn.k_proj.bias", (KV,), "qkv_bias", "attn_k.bias"),
    LayerWeight("self_attn.v_proj.bias", (KV,), "qkv_bias", "attn_v.bias"),
    LayerWeight("self_attn.o_proj.weight", (HIDDEN, Q), "o", "attn_output.weight"),
)
"""The attention weights of a Llama layer, with Q, K and V in separate matrices (in load order)."""
MLP_WEIGHTS = (
    LayerWeight("post_attention_layernorm.weight", (HIDDEN,), "mlp_norm", "ffn_norm.weight"),
    LayerWeight("mlp.gate_proj.weight", (FFN, HIDDEN), "gate_up", "ffn_gate.weight"),
    LayerWeight("mlp.up_proj.weight", (FFN, HIDDEN), "gate_up", "ffn_up.weight"),
    LayerWeight("mlp.down_proj.weight", (HIDDEN, FFN), "down", "ffn_down.weight"),
)
"""The gated MLP of a Llama layer, gate and up in separate matrices."""
OUTPUT_BIAS = LayerWeight("self_attn.o_proj.bias", (HIDDEN,), "o_bias", "attn_output.bias")


class Llama(Architecture):
    """RMSNorm, GQA attention with rotate_half rope, SwiGLU MLP. ``attention_bias`` biases Q, K, V and
    the output projection."""

    name = "llama"
    hf_model_types = ("llama",)
    hf_architectures = ("LlamaForCausalLM",)
    gguf_architecture = "llama"
    gguf_permutes_qk = True
    layer_weights: ClassVar[tuple[LayerWeight, ...]] = (*ATTENTION_WEIGHTS, OUTPUT_BIAS, *MLP_WEIGHTS)
