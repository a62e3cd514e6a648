"""Gemma 2 and Gemma 3 (text): norms that scale by ``1 + w`` (folded into the weights at load), an
embedding scaled by ``sqrt(hidden_size)``, a GeGLU MLP (tanh-approximate GELU), norms before and after
attention and the MLP, and sliding-window layers alternating with global ones. Gemma 2 soft-caps the
attention scores and the logits; Gemma 3 normalizes queries and keys per head, gives its sliding layers
their own rope base, and soft-caps only the logits, where its config sets ``final_logit_softcapping``.

llama.cpp's converter writes their GGUF files with the norms' 1 already added (`gguf_norms_offset`), Gemma 2's
head always tied to the embedding (it drops ``lm_head``), and neither the layers' attention types nor
``query_pre_attn_scalar``: llama.cpp fixes the pattern of sliding layers per family (`gguf_sliding_period`)
and knows the one size whose queries scale by ``hidden_size / num_heads`` by its layer count
(`gguf_hidden_per_head_layers`). Pie reads the files as llama.cpp does."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import numpy as np

from pie.model.config import ModelConfig

from .base import FFN, HEAD, HIDDEN, KV, Q, Architecture, GGUFConfigReader, HFConfigReader, LayerWeight

_ATTENTION = (
    LayerWeight("input_layernorm.weight", (HIDDEN,), "attn_norm", "attn_norm.weight"),
    LayerWeight("self_attn.q_proj.weight", (Q, HIDDEN), "qkv", "attn_q.weight"),
    LayerWeight("self_attn.k_proj.weight", (KV, HIDDEN), "qkv", "attn_k.weight"),
    LayerWeight("self_attn.v_proj.weight", (KV, HIDDEN), "qkv", "attn_v.weight"),
    LayerWeight("self_attn.o_proj.weight", (HIDDEN, Q), "o", "attn_output.weight"),
    LayerWeight("post_attention_layernorm.weight", (HIDDEN,), "attn_post_norm", "post_attention_norm.weight"),
)
_MLP = (
    LayerWeight("pre_feedforward_layernorm.weight", (HIDDEN,), "mlp_norm", "ffn_norm.weight"),
    LayerWeight("mlp.gate_proj.weight", (FFN, HIDDEN), "gate_up", "ffn_gate.weight"),
    LayerWeight("mlp.up_proj.weight", (FFN, HIDDEN), "gate_up", "ffn_up.weight"),
    LayerWeight("mlp.down_proj.weight", (HIDDEN, FFN), "down", "ffn_down.weight"),
    LayerWeight("post_feedforward_layernorm.weight", (HIDDEN,), "mlp_post_norm", "post_ffw_norm.weight"),
)


class Gemma2(Architecture):
    name = "gemma2"
    hf_model_types = ("gemma2",)
    hf_architectures = ("Gemma2ForCausalLM",)
    gguf_architecture = "gemma2"
    post_norms = True
    activation = "gelu_tanh"
    norm_offset = 1.0
    gguf_norms_offset = True
    scales_embedding = True
    layer_weights: ClassVar[tuple[LayerWeight, ...]] = (*_ATTENTION, *_MLP)
    gguf_sliding_period: ClassVar[int] = 2
    """In a GGUF file, the last layer of every run of this many is global, the others slide (llama.cpp's
    ``set_swa_pattern``)."""
    gguf_hidden_per_head_layers: ClassVar[int] = 46
    """The layer count of Gemma 2 27B, whose queries scale by ``hidden_size / num_heads`` (llama.cpp's rule)."""
    hf_defaults: ClassVar[dict[str, Any]] = {
        **Architecture.hf_defaults, "head_dim": 256, "num_key_value_heads": 4, "max_position_embeddings": 8192,
        "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True, "query_pre_attn_scalar": 256.0,
        "sliding_window": 4096, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
    }

    def hf_config(self, fields: HFConfigReader) -> dict[str, Any]:
        activation = self.hf_field(fields, "hidden_activation", str)  # transformers' Gemma 2/3 ignore hidden_act
        if activation != "gelu_pytorch_tanh":
            raise fields.error("hidden_activation", f"is {activation!r}; only 'gelu_pytorch_tanh' is supported")
        if fields.get("attention_bias", bool, False):
            raise fields.error("attention_bias", "is true; Gemma attention biases are unsupported")
        if fields.get("use_bidirectional_attention", bool, False):
            raise fields.error("use_bidirectional_attention", "is true; only causal attention is supported")
        window = self.hf_field(fields, "sliding_window", int, 0)
        return {
            "attention_bias": False,
            "layer_windows": self.hf_layer_windows(fields, window, self.hf_slides(fields)),
            "attn_softcap": self.hf_field(fields, "attn_logit_softcapping", float, 0.0),
            "final_softcap": self.hf_field(fields, "final_logit_softcapping", float, 0.0),
            "query_pre_attn_scalar": self.hf_field(fields, "query_pre_attn_scalar", float, None),
        }

    def hf_slides(self, fields: HFConfigReader) -> Callable[[int], bool]:
        """Which layers slide in a config.json without ``layer_types``: every other one, the first included."""
        return lambda i: i % 2 == 0

    def gguf_config(self, meta: GGUFConfigReader, tensor_names: Iterable[str]) -> dict[str, Any]:
        """llama.cpp's defaults where a key is absent: Gemma 2's window of 4096 and soft-caps of 50 and 30."""
        return {**self._gguf_layers(meta, meta.get(self.gguf_key("attention.sliding_window"), int, 4096)),
                "attn_softcap": meta.get(self.gguf_key("attn_logit_softcapping"), float, 50.0),
                "final_softcap": meta.get(self.gguf_key("final_logit_softcapping"), float, 30.0)}

    def _gguf_layers(self, meta: GGUFConfigReader, window: int) -> dict[str, Any]:
        """The windows and query scalar of a GGUF file's layers, from its sliding window (0: none)."""
        layers = meta.get(self.gguf_key("block_count"), int)
        period = self.gguf_sliding_period
        extra: dict[str, Any] = {
            "attention_bias": False,
            "layer_windows": tuple(0 if (i + 1) % period == 0 else window for i in range(layers)) if window else (),
        }
        if layers == self.gguf_hidden_per_head_layers:
            hidden, heads = (meta.get(self.gguf_key(k), int) for k in ("embedding_length", "attention.head_count"))
            extra["query_pre_attn_scalar"] = float(hidden // heads)
        return extra

    def attention_scale(self, config: ModelConfig) -> float:
        scalar = config.query_pre_attn_scalar
        return float(config.head_dim if scalar is None else scalar) ** -0.5

    def check(self, config: ModelConfig) -> str | None:
        return "Gemma has no attention biases: attention_bias must be false" if config.attention_bias else None


class Gemma3(Gemma2):
    name = "gemma3"
    hf_model_types = ("gemma3_text",)
    hf_architectures = ("Gemma3ForCausalLM",)
    gguf_architecture = "gemma3"
    qk_norm = True
    gguf_sliding_period = 6
    gguf_hidden_per_head_layers = 62
    hf_defaults: ClassVar[dict[str, Any]] = {
        **Gemma2.hf_defaults, "max_position_embeddings": 131_072, "attn_logit_softcapping": 0.0,
        "final_logit_softcapping": 0.0, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0}
    layer_weights: ClassVar[tuple[LayerWeight, ...]] = (
        *_ATTENTION[:4],
        LayerWeight("self_attn.q_norm.weight", (HEAD,), "q_norm", "attn_q_norm.weight"),
        LayerWeight("self_attn.k_norm.weight", (HEAD,), "k_norm", "attn_k_norm.weight"),
        *_ATTENTION[4:],
        *_MLP,
    )

    def hf_config(self, fields: HFConfigReader) -> dict[str, Any]:
        extra = super().hf_config(fields)
        params = fields.get("rope_parameters", dict, {})
        thetas = {"full_attention": self.hf_field(fields, "rope_theta", float),
                  "sliding_attention": self.hf_field(fields, "rope_local_base_freq", float)}
        for kind in thetas:
            rope = params.get(kind)
            if rope is None:  # transformers' default rope, of the top-level base
                continue
            if not isinstance(rope, dict):
                raise fields.error(f"rope_parameters.{kind}", f"has invalid value {rope!r}")
            scaling = rope.get("rope_type", rope.get("type", "default"))
            if scaling != "default":
                raise fields.error(f"rope_parameters.{kind}.rope_type",
                                   f"is {scaling!r}; Gemma 3's rope scaling is unsupported (only 'default')")
            if rope.get("rope_theta") is not None:  # null: not given, as for a top-level field
                thetas[kind] = fields.number(f"rope_parameters.{kind}.rope_theta", rope["rope_theta"])
        return {**extra, "attn_softcap": 0.0, "rope_theta": thetas["full_attention"],
                "rope_local_theta": thetas["sliding_attention"]}

    def hf_slides(self, fields: HFConfigReader) -> Callable[[int], bool]:
        """Which layers slide in a config.json without ``layer_types``: all but the last of every
        ``sliding_window_pattern`` (6)."""
        pattern = fields.get("sliding_window_pattern", int, 6)

        def slides(index: int) -> bool:
            if pattern < 1:
                raise fields.error("sliding_window_pattern", f"is {pattern}; expected 1 or more")
            return (index + 1) % pattern != 0

        return slides

    def gguf_config(self, meta: GGUFConfigReader, tensor_names: Iterable[str]) -> dict[str, Any]:
        """A file without a sliding window has only global layers; local layers rotate with base 10000 unless
        the file says otherwise (``rope.freq_base_swa``)."""
        window = meta.get(self.gguf_key("attention.sliding_window"), int, 0)
        return {**self._gguf_layers(meta, window), "attn_softcap": 0.0,
                "final_softcap": meta.get(self.gguf_key("final_logit_softcapping"), float, 0.0),
                "rope_local_theta": meta.get(self.gguf_key("rope.freq_base_swa"), float, 10_000.0) if window else None}

    def derived_weights(self, config: ModelConfig) -> dict[str, np.ndarray]:
        local = config.rope_inv_freq(config.rope_local_theta) if config.rope_local_theta else config.rope_inv_freq()
        return {**super().derived_weights(config), "w.inv_freq_local": local}

    def layer_inv_freq(self, config: ModelConfig, index: int) -> str:
        return "w.inv_freq_local" if self.layer_window(config, index) else "w.inv_freq"
