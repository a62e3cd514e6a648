"""Qwen2 (and Qwen2.5): a Llama whose Q, K and V projections are always biased, the output projection never."""

from __future__ import annotations

from typing import Any, ClassVar

from .base import Architecture, ConfigReader, HFConfigReader, LayerWeight
from .llama import ATTENTION_WEIGHTS, MLP_WEIGHTS


class Qwen2(Architecture):
    name = "qwen2"
    hf_model_types = ("qwen2",)
    hf_architectures = ("Qwen2ForCausalLM",)
    gguf_architecture = "qwen2"
    layer_weights: ClassVar[tuple[LayerWeight, ...]] = (*ATTENTION_WEIGHTS, *MLP_WEIGHTS)
    hf_defaults: ClassVar[dict[str, Any]] = {
        **Architecture.hf_defaults, "num_key_value_heads": 32, "max_position_embeddings": 32_768}

    def hf_config(self, fields: HFConfigReader) -> dict[str, Any]:
        super().hf_config(fields)
        if fields.get("use_sliding_window", bool, False):
            raise fields.error("use_sliding_window", "is true; Qwen2's sliding-window layers are unsupported")
        return {"attention_bias": True}

    def gguf_config(self, meta: ConfigReader, tensor_names: Any) -> dict[str, Any]:
        return {"attention_bias": True}

    def check(self, config: Any) -> str | None:
        return None if config.attention_bias else "Qwen2's Q, K and V projections are biased: attention_bias must be true"
