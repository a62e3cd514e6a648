"""Mistral: a Llama (no biases) whose layers attend within a sliding window when ``sliding_window`` is set.

llama.cpp's converter writes a ``MistralForCausalLM`` checkpoint as a ``llama`` GGUF file (its sliding window
dropped: such a file is a `Llama`), and the text model of ``Mistral3ForConditionalGeneration`` (Mistral Small
3) as ``mistral3``: the Llama layout, Q/K rows permuted alike, all layers global."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

from .base import Architecture, GGUFConfigReader, HFConfigReader, LayerWeight
from .llama import ATTENTION_WEIGHTS, MLP_WEIGHTS


class Mistral(Architecture):
    name = "mistral"
    hf_model_types = ("mistral",)
    hf_architectures = ("MistralForCausalLM",)
    gguf_architecture = "mistral3"
    gguf_permutes_qk = True
    layer_weights: ClassVar[tuple[LayerWeight, ...]] = (*ATTENTION_WEIGHTS, *MLP_WEIGHTS)
    hf_defaults: ClassVar[dict[str, Any]] = {
        **Architecture.hf_defaults, "num_key_value_heads": 8, "max_position_embeddings": 131_072,
        "sliding_window": 4096}

    def hf_config(self, fields: HFConfigReader) -> dict[str, Any]:
        super().hf_config(fields)
        if fields.get("layer_types", list, None) is not None:
            raise fields.error("layer_types", "is set; Mistral layers of different attention types are unsupported")
        window = self.hf_field(fields, "sliding_window", int, 0)
        layers = fields.get("num_hidden_layers", int)
        return {"attention_bias": False, "layer_windows": (window,) * layers if window else ()}

    def gguf_config(self, meta: GGUFConfigReader, tensor_names: Iterable[str]) -> dict[str, Any]:
        key = self.gguf_key("attention.temperature_scale")
        if meta.get(key, float, 0.0):
            raise meta.error(key, "is set; Ministral 3's position-dependent attention temperature is unsupported")
        return {"attention_bias": False}
