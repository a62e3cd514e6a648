"""Qwen3: a Llama (biases with ``attention_bias``) whose queries and keys are RMS-normalized per head before rope,
with Qwen2's sliding windows."""

from __future__ import annotations

from typing import Any, ClassVar

from .base import HEAD, Architecture, HFConfigReader, LayerWeight
from .llama import ATTENTION_WEIGHTS, MLP_WEIGHTS, OUTPUT_BIAS
from .qwen2 import Qwen2, qwen_layer_windows


class Qwen3(Architecture):
    name = "qwen3"
    hf_model_types = ("qwen3",)
    hf_architectures = ("Qwen3ForCausalLM",)
    gguf_architecture = "qwen3"
    qk_norm = True
    hf_defaults: ClassVar[dict[str, Any]] = {**Qwen2.hf_defaults, "head_dim": 128}
    layer_weights: ClassVar[tuple[LayerWeight, ...]] = (
        *ATTENTION_WEIGHTS,
        OUTPUT_BIAS,
        LayerWeight("self_attn.q_norm.weight", (HEAD,), "q_norm", "attn_q_norm.weight"),
        LayerWeight("self_attn.k_norm.weight", (HEAD,), "k_norm", "attn_k_norm.weight"),
        *MLP_WEIGHTS,
    )

    def hf_config(self, fields: HFConfigReader) -> dict[str, Any]:
        return {**super().hf_config(fields), "layer_windows": qwen_layer_windows(self, fields)}
