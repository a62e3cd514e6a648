"""Mistral: a Llama (no biases) whose layers attend within a sliding window when ``sliding_window`` is set."""

from __future__ import annotations

from typing import Any, ClassVar

from .base import Architecture, HFConfigReader, LayerWeight
from .llama import ATTENTION_WEIGHTS, MLP_WEIGHTS


class Mistral(Architecture):
    name = "mistral"
    hf_model_types = ("mistral",)
    hf_architectures = ("MistralForCausalLM",)
    layer_weights: ClassVar[tuple[LayerWeight, ...]] = (*ATTENTION_WEIGHTS, *MLP_WEIGHTS)

    def hf_config(self, fields: HFConfigReader) -> dict[str, Any]:
        super().hf_config(fields)
        if fields.get("layer_types", list, None) is not None:
            raise fields.error("layer_types", "is set; Mistral layers of different attention types are unsupported")
        window = fields.get("sliding_window", int, 0)
        layers = fields.get("num_hidden_layers", int)
        return {"attention_bias": False, "layer_windows": (window,) * layers if window else ()}
