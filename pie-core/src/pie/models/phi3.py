"""Phi-3: a Llama whose checkpoints store Q/K/V as one ``qkv_proj`` and gate/up as one ``gate_up_proj``,
already Poem's stacked layout."""

from __future__ import annotations

from typing import Any, ClassVar

from pie.model.config import ModelConfig

from .base import FFN, GATE_UP, HIDDEN, QKV, Q, Architecture, HFConfigReader, LayerWeight


class Phi3(Architecture):
    name = "phi3"
    hf_model_types = ("phi3",)
    hf_architectures = ("Phi3ForCausalLM",)
    gguf_architecture = "phi3"
    hf_defaults: ClassVar[dict[str, Any]] = {
        **Architecture.hf_defaults, "rms_norm_eps": 1e-5, "max_position_embeddings": 4096}
    layer_weights: ClassVar[tuple[LayerWeight, ...]] = (
        LayerWeight("input_layernorm.weight", (HIDDEN,), "attn_norm", "attn_norm.weight"),
        LayerWeight("self_attn.qkv_proj.weight", (QKV, HIDDEN), "qkv", "attn_qkv.weight"),
        LayerWeight("self_attn.o_proj.weight", (HIDDEN, Q), "o", "attn_output.weight"),
        LayerWeight("post_attention_layernorm.weight", (HIDDEN,), "mlp_norm", "ffn_norm.weight"),
        LayerWeight("mlp.gate_up_proj.weight", (GATE_UP, HIDDEN), "gate_up", "ffn_up.weight"),
        LayerWeight("mlp.down_proj.weight", (HIDDEN, FFN), "down", "ffn_down.weight"),
    )

    def hf_config(self, fields: HFConfigReader) -> dict[str, Any]:
        super().hf_config(fields)
        for name in ("rope_parameters", "rope_scaling"):
            params = fields.get(name, dict, {})
            kind = params.get("rope_type", params.get("type", "default"))
            if kind in ("longrope", "su", "yarn"):
                raise fields.error(f"{name}.rope_type", f"is {kind!r}: Phi-3's long-context (LongRoPE) scaling is "
                                                        "unsupported; use a 4k-context Phi-3 model")
            if kind != "default":  # what transformers' Phi-3 refuses too
                raise fields.error(f"{name}.rope_type", f"is {kind!r}; a Phi-3 model's rope is 'default' (or LongRoPE)")
        window = fields.get("sliding_window", int, 0)
        return {"layer_windows": (window,) * fields.get("num_hidden_layers", int) if window else ()}

    def check(self, config: ModelConfig) -> str | None:
        if config.attention_bias:
            return "Phi-3 has no attention biases: attention_bias must be false"
        return None
