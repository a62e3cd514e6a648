"""Qwen2 (and Qwen2.5): a Llama whose Q, K and V projections are always biased, the output projection never.

With ``use_sliding_window``, the layers ``layer_types`` names (in older files, those from ``max_window_layers``
on) attend within ``sliding_window``, in Qwen2 and Qwen3 alike."""

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
        **Architecture.hf_defaults, "num_key_value_heads": 32, "max_position_embeddings": 32_768,
        "sliding_window": 4096, "max_window_layers": 28}

    def hf_config(self, fields: HFConfigReader) -> dict[str, Any]:
        super().hf_config(fields)
        return {"attention_bias": True, "layer_windows": qwen_layer_windows(self, fields)}

    def gguf_config(self, meta: ConfigReader, tensor_names: Any) -> dict[str, Any]:
        return {"attention_bias": True}

    def check(self, config: Any) -> str | None:
        return None if config.attention_bias else "Qwen2's Q, K and V projections are biased: attention_bias must be true"


def qwen_layer_windows(architecture: Architecture, fields: HFConfigReader) -> tuple[int, ...]:
    """A Qwen2 or Qwen3 config.json's layer windows, as transformers reads them: none without
    ``use_sliding_window`` (whatever ``layer_types`` says)."""
    if not fields.get("use_sliding_window", bool, False):
        return ()
    first = architecture.hf_field(fields, "max_window_layers", int)
    return architecture.hf_layer_windows(fields, architecture.hf_field(fields, "sliding_window", int, 0),
                                         lambda index: index >= first)
