"""What a model architecture is to Pie: one `Architecture` subclass per family, in a module of its own.

An architecture says everything its family means and nothing else does: which config.json and GGUF
fields it reads, its weights by Hugging Face name (shapes, GGUF names, how they stack into Poem's
weights, offsets folded at load), the tables derived from the config (rotary frequencies), and its
layers as `pie.contract.DecoderLayerBlock` records, from which `pie.models.decoder` builds the graph.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import numpy as np

from pie.contract import DecoderLayerBlock, LayerActivation
from pie.model.config import ModelConfig
from pie.weights import Weight, stack_rows

Dims = tuple[tuple[str, ...], ...]
"""Each dimension of a weight as the `ModelConfig` fields whose product it is."""
VOCAB, HIDDEN, FFN = ("vocab_size",), ("hidden_size",), ("intermediate_size",)
Q, KV, HEAD = ("num_heads", "head_dim"), ("num_kv_heads", "head_dim"), ("head_dim",)
QKV = ("num_heads+2*num_kv_heads", "head_dim")
"""The rows of a fused QKV matrix (Phi-3's ``qkv_proj``)."""
GATE_UP = ("2", "intermediate_size")
"""The rows of a fused gate/up matrix (Phi-3's ``gate_up_proj``)."""

EMBED, FINAL_NORM, LM_HEAD = "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"
GLOBAL_GGUF_NAMES = {EMBED: "token_embd.weight", FINAL_NORM: "output_norm.weight", LM_HEAD: "output.weight"}


@dataclass(frozen=True)
class LayerWeight:
    """One weight of each decoder layer, as the Hugging Face checkpoint names it."""

    name: str
    """Its name after ``model.layers.{i}.``."""
    dims: Dims
    role: str
    """The `pie.contract.LAYER_WEIGHT_ROLES` entry it is, or is a part of: parts of one role are stacked
    by rows in table order (Q, K, V into ``qkv``; gate, up into ``gate_up``)."""
    gguf: str
    """Its name after ``blk.{i}.`` in a GGUF file."""


ROLE_NAMES = {
    "attn_norm": "ln1", "qkv": "qkv", "qkv_bias": "qkv_bias", "q_norm": "q_norm", "k_norm": "k_norm", "o": "o",
    "o_bias": "o_bias", "attn_post_norm": "ln1_post", "mlp_norm": "ln2", "gate_up": "gate_up", "down": "down",
    "mlp_post_norm": "ln2_post",
}
"""Each role's Poem weight name in layer i, after ``w.L{i}.``."""
NORM_ROLES = frozenset({"attn_norm", "q_norm", "k_norm", "attn_post_norm", "mlp_norm", "mlp_post_norm"})
_AS_ABSENT: Any = object()
"""`Architecture.hf_field`'s mark that a null field means what leaving it out does."""


class ConfigReader(Protocol):
    """Typed reads of a file's config fields (config.json's or a GGUF file's metadata)."""

    def get(self, name: str, kind: Any, default: Any = ...) -> Any: ...


class HFConfigReader(ConfigReader, Protocol):
    data: dict[str, Any]

    def error(self, name: str, problem: str) -> Exception: ...

    def number(self, name: str, value: Any) -> float:
        """``value``, read from the field ``name`` (``rope_parameters.full_attention.rope_theta``), as a float; the
        error naming the field if it is no number or too large for one."""
        ...


class GGUFConfigReader(ConfigReader, Protocol):
    def error(self, key: str, problem: str) -> Exception:
        """The error that names the file and metadata ``key``: ``problem`` says what is wrong with it."""
        ...


class Architecture:
    """A decoder family. Subclasses set the class variables and override what differs from Llama's."""

    name: ClassVar[str]
    """`ModelConfig.architecture` for this family."""
    hf_model_types: ClassVar[tuple[str, ...]]
    """config.json ``model_type`` values that mean this family."""
    hf_architectures: ClassVar[tuple[str, ...]] = ()
    """config.json ``architectures`` entries that mean this family."""
    gguf_architecture: ClassVar[str | None] = None
    """A GGUF file's ``general.architecture`` for this family (None: no GGUF support)."""
    layer_weights: ClassVar[tuple[LayerWeight, ...]]
    gguf_permutes_qk: ClassVar[bool] = False
    """Whether llama.cpp's converter reorders this family's Q/K rows for its interleaved rope."""
    qk_norm: ClassVar[bool] = False
    post_norms: ClassVar[bool] = False
    activation: ClassVar[LayerActivation] = "silu"
    norm_offset: ClassVar[float] = 0.0
    """Added to every norm weight at load (Gemma's norms scale by ``1 + w``)."""
    gguf_norms_offset: ClassVar[bool] = False
    """Whether llama.cpp's converter stores this family's norms with `norm_offset` already added (Gemma's):
    the GGUF reader takes it off again, so that a GGUF file's weights read as the checkpoint's."""
    scales_embedding: ClassVar[bool] = False
    """Whether the embedding is multiplied by ``sqrt(hidden_size)`` (Gemma)."""
    hf_defaults: ClassVar[dict[str, Any]] = {
        "head_dim": None, "num_key_value_heads": None, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
        "max_position_embeddings": 2048, "rope_theta": 10_000.0,
    }
    """This family's transformers defaults (`hf_field`) of the config.json fields Pie reads: what a file that
    leaves one out means (transformers saves a config without ``tie_word_embeddings`` where it is true). These
    are Llama's; a family states each of its own on top of them. ``head_dim`` None: ``hidden_size //
    num_attention_heads``; ``num_key_value_heads`` None: ``num_attention_heads``."""

    # -- config ------------------------------------------------------------------------------------

    def hf_config(self, fields: HFConfigReader) -> dict[str, Any]:
        """The `ModelConfig` fields of this family beyond the common ones `pie.model.hf_folder` reads, and
        refusals (``fields.error``) of what Pie does not run. The base refuses a non-SiLU MLP, MLP biases and partial
        rotary embeddings (which every family's checkpoint could ask for, and none was run with)."""
        if fields.get("hidden_act", str, "silu") != "silu":
            raise fields.error("hidden_act", f"is {fields.data['hidden_act']!r}; only 'silu' is supported")
        if fields.get("mlp_bias", bool, False):
            raise fields.error("mlp_bias", "is true; MLP biases are unsupported")
        for name in ("rope_parameters", "rope_scaling"):
            params = fields.get(name, dict, {})
            partial = params.get("partial_rotary_factor", fields.get("partial_rotary_factor", float, 1.0))
            if partial != 1.0:
                raise fields.error("partial_rotary_factor", f"is {partial!r}; partial rotary embeddings are unsupported")
        return {}

    def hf_field(self, fields: HFConfigReader, name: str, kind: type, none: Any = _AS_ABSENT) -> Any:
        """config.json's field ``name``: `hf_defaults`'s value where the file leaves it out; where it is null,
        ``none`` if given (no window, no cap), else the same."""
        default = self.hf_defaults[name]
        if name not in fields.data:
            return default
        return fields.get(name, kind, default if none is _AS_ABSENT else none)

    def hf_layer_windows(self, fields: HFConfigReader, window: int, slides: Callable[[int], bool]) -> tuple[int, ...]:
        """`ModelConfig.layer_windows`: ``window`` (0: none) on the layers config.json's ``layer_types`` says slide,
        or in a file without it, on the layers ``slides`` picks (the family's rule for older files)."""
        layers = fields.get("num_hidden_layers", int)
        types = fields.get("layer_types", list, None)
        if types is None:
            types = ["sliding_attention" if slides(i) else "full_attention" for i in range(layers)]
        if len(types) != layers or any(t not in ("sliding_attention", "full_attention") for t in types):
            raise fields.error("layer_types",
                               f"is {types!r}; expected {layers} of 'sliding_attention', 'full_attention'")
        return tuple(window if t == "sliding_attention" else 0 for t in types) if window else ()

    def gguf_config(self, meta: GGUFConfigReader, tensor_names: Iterable[str]) -> dict[str, Any]:
        """The `ModelConfig` fields of this family beyond the common ones `pie.model.gguf_file` reads, from
        the metadata keys llama.cpp reads for it (``gguf_key`` spells them), and refusals (``meta.error``)
        of what Pie does not run."""
        return {}

    def gguf_key(self, name: str) -> str:
        """A metadata key of this family's GGUF files: ``attention.sliding_window`` is
        ``gemma2.attention.sliding_window`` in a Gemma 2 file."""
        return f"{self.gguf_architecture}.{name}"

    def check(self, config: ModelConfig) -> str | None:
        """What in ``config`` this family cannot have, else None (`ModelConfig` raises it)."""
        return None

    # -- weights -----------------------------------------------------------------------------------

    def has_weight(self, config: ModelConfig, weight: LayerWeight) -> bool:
        """Whether each layer has ``weight``: biases only with ``attention_bias``."""
        return weight.role not in ("qkv_bias", "o_bias") or config.attention_bias

    def present_layer_weights(self, config: ModelConfig) -> tuple[LayerWeight, ...]:
        return tuple(w for w in self.layer_weights if self.has_weight(config, w))

    def weight_shapes(self, config: ModelConfig) -> dict[str, tuple[int, ...]]:
        """Every weight the model needs, by Hugging Face name, in load order, with its shape
        (matrices ``[out_features, in_features]``)."""
        shapes = {EMBED: _shape(config, (VOCAB, HIDDEN))}
        layer = self.present_layer_weights(config)
        for i in range(config.num_layers):
            shapes.update((f"model.layers.{i}.{w.name}", _shape(config, w.dims)) for w in layer)
        shapes[FINAL_NORM] = _shape(config, (HIDDEN,))
        if not config.tie_word_embeddings:
            shapes[LM_HEAD] = _shape(config, (VOCAB, HIDDEN))
        return shapes

    def describe_shape(self, hf_name: str, names: Mapping[str, str]) -> str:
        """What sets a weight's shape, in a file's own field names: ``[num_key_value_heads × head_dim, hidden_size]``."""
        dims = self._dims(hf_name)
        return "[" + ", ".join(" × ".join(names.get(f, f) for f in dim) for dim in dims) + "]"

    def gguf_name(self, hf_name: str) -> str:
        """The GGUF (llama.cpp) name of a Hugging Face weight name."""
        if hf_name in GLOBAL_GGUF_NAMES:
            return GLOBAL_GGUF_NAMES[hf_name]
        _, _, layer, local = hf_name.split(".", 3)
        return f"blk.{layer}.{self._layer_weight(local).gguf}"

    def poem_name(self, hf_name: str) -> str:
        """The Poem weight a Hugging Face weight is (or is a stacked part of)."""
        if hf_name == EMBED:
            return "w.embed"
        if hf_name == FINAL_NORM:
            return "w.norm"
        if hf_name == LM_HEAD:
            return "w.lm_head"
        _, _, layer, local = hf_name.split(".", 3)
        return f"w.L{layer}.{ROLE_NAMES[self._layer_weight(local).role]}"

    def poem_weight_shapes(self, config: ModelConfig) -> dict[str, tuple[int, ...]]:
        """The shape of each Poem weight the loaded ones become (stacked parts' rows added up)."""
        shapes: dict[str, tuple[int, ...]] = {}
        for hf_name, shape in self.weight_shapes(config).items():
            name = self.poem_name(hf_name)
            if name in shapes:
                shape = (shapes[name][0] + shape[0], *shape[1:])
            shapes[name] = shape
        if config.tie_word_embeddings:
            shapes["w.lm_head"] = shapes["w.embed"]
        return shapes

    def poem_weights(self, config: ModelConfig, tensors: Iterable[tuple[str, Weight]]) -> Iterator[tuple[str, Weight]]:
        """Rename HF tensors to Poem weight names, stacking the parts of one role as they arrive (as byte
        rows where all parts share a stored type, see `pie.weights.stack_rows`) and folding norm offsets."""
        parts: dict[str, list[str]] = {}
        for weight in self.present_layer_weights(config):
            parts.setdefault(weight.role, []).append(weight.name)
        pending: dict[tuple[str, str], Weight] = {}
        for name, array in tensors:
            if not name.startswith("model.layers.") and name not in (EMBED, FINAL_NORM, LM_HEAD):
                raise ValueError(f"unexpected tensor {name!r}")
            target = self.poem_name(name)
            if name == EMBED and config.tie_word_embeddings:
                yield target, array
                target = "w.lm_head"
            if self.is_norm(name):
                array = self._folded(array)
            if not name.startswith("model.layers."):
                yield target, array
                continue
            layer, _, local = name[len("model.layers."):].partition(".")
            role = self._layer_weight(local).role
            names = parts[role]
            if len(names) == 1:
                yield target, array
                continue
            pending[(layer, local)] = array
            if all((layer, part) in pending for part in names):
                yield target, stack_rows([pending.pop((layer, part)) for part in names])
        if pending:
            raise ValueError(f"incomplete stacked weights: {sorted(f'{layer}/{local}' for layer, local in pending)}")

    def derived_weights(self, config: ModelConfig) -> dict[str, np.ndarray]:
        """Weights computed from the config, by Poem name: the rotary inverse frequencies."""
        return {"w.inv_freq": config.rope_inv_freq()}

    def is_norm(self, hf_name: str) -> bool:
        """Whether a weight is a norm's (the final norm, or a layer's of a `NORM_ROLES` role)."""
        if hf_name == FINAL_NORM:
            return True
        return hf_name.startswith("model.layers.") and self._layer_weight(hf_name.split(".", 3)[3]).role in NORM_ROLES

    def _folded(self, norm: Weight) -> Weight:
        if not self.norm_offset:
            return norm
        assert isinstance(norm, np.ndarray), "norm weights load as float32 arrays"
        return (norm + np.float32(self.norm_offset)).astype(np.float32)

    def _layer_weight(self, local: str) -> LayerWeight:
        for weight in self.layer_weights:
            if weight.name == local:
                return weight
        raise ValueError(f"unexpected tensor {local!r} in a {self.name} layer")

    def _dims(self, hf_name: str) -> Dims:
        if hf_name in (EMBED, LM_HEAD):
            return (VOCAB, HIDDEN)
        if hf_name == FINAL_NORM:
            return (HIDDEN,)
        return self._layer_weight(hf_name.split(".", 3)[3]).dims

    # -- the layers --------------------------------------------------------------------------------

    def attention_scale(self, config: ModelConfig) -> float:
        return float(config.head_dim) ** -0.5

    def layer_window(self, config: ModelConfig, index: int) -> int:
        """Layer ``index``'s sliding window (0: global attention)."""
        return config.layer_windows[index] if config.layer_windows else 0

    def layer_inv_freq(self, config: ModelConfig, index: int) -> str:
        """The Poem weight holding layer ``index``'s rotary inverse frequencies."""
        return "w.inv_freq"

    def layer(self, config: ModelConfig, index: int, x: str, output: str, inputs: Mapping[str, str]) -> DecoderLayerBlock:
        """Decoder layer ``index`` reading the residual stream ``x`` and writing ``output``; ``inputs`` names
        the pass-wide values (`DecoderLayerBlock`'s fields ``pool``, ``positions``, ``slots``...)."""
        present = {w.role for w in self.present_layer_weights(config)}
        weights = tuple((role, f"w.L{index}.{ROLE_NAMES[role]}") for role in ROLE_NAMES if role in present)
        return DecoderLayerBlock(
            layer=index, weights=weights, x=x, output=output, inv_freq=self.layer_inv_freq(config, index),
            hidden=config.hidden_size, intermediate=config.intermediate_size, num_heads=config.num_heads,
            num_kv_heads=config.num_kv_heads, head_dim=config.head_dim, eps=float(config.rms_norm_eps),
            scale=self.attention_scale(config), qk_norm=self.qk_norm, window=self.layer_window(config, index),
            softcap=float(config.attn_softcap), post_norms=self.post_norms, activation=self.activation, **inputs,
        )


def _shape(config: ModelConfig, dims: Dims) -> tuple[int, ...]:
    return tuple(math.prod(_field(config, f) for f in dim) for dim in dims)


def _field(config: ModelConfig, name: str) -> int:
    """A factor of a dimension: a `ModelConfig` field, or one of the two that fused matrices name."""
    if name == GATE_UP[0]:
        return 2
    if name == QKV[0]:
        return config.num_heads + 2 * config.num_kv_heads
    value: int = getattr(config, name)
    return value
