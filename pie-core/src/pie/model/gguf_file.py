"""Loading a Llama-family model from a single GGUF file (llama.cpp's format)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, ReaderTensor
from gguf.quants import dequantize

from .config import ModelConfig, weight_shapes
from .errors import ModelLoadError
from .gguf_metadata import GGUFMetadata
from .gguf_tokenizer import tokenizer_from_gguf
from .tokenizer import Tokenizer

SUPPORTED_TYPES = frozenset({
    GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16,
    GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1,
})

_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.o_proj.bias": "attn_output.bias",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_ROPE_FREQS = "rope_freqs.weight"


def gguf_name(hf_name: str) -> str:
    """The GGUF (llama.cpp) name of a Hugging Face weight name."""
    if hf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[hf_name]
    _, _, layer, suffix = hf_name.split(".", 3)
    return f"blk.{layer}.{_LAYER_NAMES[suffix]}"


class _Reader(GGUFReader):
    """GGUFReader, but a tensor it cannot describe (an unknown type, data past the end of a
    truncated file) is reported by name instead of as a bare ValueError."""

    def _build_tensors(self, start_offs: int, fields: list[Any]) -> None:
        built: dict[str, ReaderTensor] = {}
        for field in fields:
            name = bytes(field.parts[1]).decode("utf-8", errors="replace")
            if name in built:
                raise ModelLoadError(f"tensor {name!r} appears twice")
            try:
                super()._build_tensors(start_offs, [field])
            except ValueError as exc:
                raise ModelLoadError(f"tensor {name!r} cannot be read: {self._explain(field, start_offs, exc)}") from exc
            built[name] = self.tensors[0]
        self.tensors = list(built.values())

    def _explain(self, field: Any, start_offs: int, exc: ValueError) -> str:
        _, _, _, dims, raw_type, offset = field.parts
        try:
            block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(int(raw_type[0]))]
        except ValueError:
            return str(exc)  # an unknown type: gguf's message names it
        end = start_offs + int(offset[0]) + int(np.prod(dims)) * type_size // block_size
        if end > len(self.data):
            return f"its data ends at byte {end} but the file has {len(self.data)} (truncated?)"
        return str(exc)


def open_gguf(path: Path) -> tuple[ModelConfig, Tokenizer, Callable[[], Iterator[tuple[str, np.ndarray]]]]:
    """Read and check a GGUF file's metadata and tensor index; weights are read later, on demand."""
    try:
        reader = _Reader(path)
    except ModelLoadError as exc:
        raise ModelLoadError(f"{path}: {exc}") from exc
    except Exception as exc:  # gguf raises ValueError, IndexError, KeyError... on damaged headers
        raise ModelLoadError(f"{path}: not a readable GGUF file: {type(exc).__name__}: {exc}") from exc
    meta = GGUFMetadata(reader, path)
    tensors = {t.name: t for t in reader.tensors}
    tokenizer = tokenizer_from_gguf(meta)
    config = _config(meta, tensors, tokenizer)
    shapes = weight_shapes(config)
    wanted = {gguf_name(name): name for name in shapes}
    for name, tensor in tensors.items():
        if name not in wanted and name != _ROPE_FREQS:
            raise ModelLoadError(f"{path}: unexpected tensor {name!r} (a model variant Pie does not support)")
        if tensor.tensor_type not in SUPPORTED_TYPES:
            raise ModelLoadError(
                f"{path}: tensor {name!r} has unsupported type {tensor.tensor_type.name}; "
                f"supported: {', '.join(sorted(t.name for t in SUPPORTED_TYPES))}")
    for gname, hf_name in wanted.items():
        if gname not in tensors:
            raise ModelLoadError(f"{path}: missing tensor {gname!r} ({hf_name})")
        shape = tuple(int(d) for d in reversed(tensors[gname].shape))
        if shape != shapes[hf_name]:
            raise ModelLoadError(f"{path}: tensor {gname!r} has shape {list(shape)}, expected {list(shapes[hf_name])}")

    def read_all() -> Iterator[tuple[str, np.ndarray]]:
        for hf_name, shape in shapes.items():
            yield hf_name, _read(path, config, tensors[gguf_name(hf_name)], hf_name, shape)

    return config, tokenizer, read_all


def _read(path: Path, config: ModelConfig, tensor: ReaderTensor, hf_name: str, shape: tuple[int, ...]) -> np.ndarray:
    try:
        array = dequantize(tensor.data, tensor.tensor_type)
    except Exception as exc:
        raise ModelLoadError(f"{path}: tensor {tensor.name!r} cannot be dequantized: {exc}") from exc
    array = array.reshape(shape)
    if config.architecture == "llama" and (".q_proj." in hf_name or ".k_proj." in hf_name):
        array = _unpermute_rows(array, config.num_heads if ".q_proj." in hf_name else config.num_kv_heads)
    if np.may_share_memory(array, tensor.data):  # F32 data is a view of the read-only memory map
        array = array.copy()
    return np.ascontiguousarray(array, dtype=np.float32)


def _unpermute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation.

    llama.cpp's converter reorders each head's rows from the rotate_half layout (pairs `(j,
    j + d/2)`) to an interleaved one (pairs `(2j, 2j + 1)`) for its own rope kernel; the reverse
    takes row `2j + k` of a head back to row `j + k * d/2`.
    """
    rows = weight.shape[0]
    return weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _config(meta: GGUFMetadata, tensors: dict[str, ReaderTensor], tokenizer: Tokenizer) -> ModelConfig:
    arch = meta.get("general.architecture", str)
    if arch not in ("llama", "qwen2"):
        raise ModelLoadError(f"{meta.path}: unsupported architecture {arch!r} (general.architecture); "
                             "supported: llama, qwen2")
    hidden = meta.require_positive(f"{arch}.embedding_length")
    heads = meta.require_positive(f"{arch}.attention.head_count")
    head_dim = meta.require_positive(f"{arch}.attention.key_length", hidden // heads)
    rope_dim = meta.get(f"{arch}.rope.dimension_count", int, head_dim)
    if rope_dim != head_dim:
        raise ModelLoadError(f"{meta.path}: metadata key '{arch}.rope.dimension_count' is {rope_dim}; "
                             f"partial rotary embeddings (head_dim {head_dim}) are unsupported")
    scaling = meta.get(f"{arch}.rope.scaling.type", str, "none")
    if scaling != "none":
        raise ModelLoadError(f"{meta.path}: metadata key '{arch}.rope.scaling.type' is {scaling!r}; "
                             "unsupported rope scaling")
    values: dict[str, Any] = {
        "architecture": arch,
        "vocab_size": meta.require_positive(f"{arch}.vocab_size", tokenizer.vocab_size),
        "hidden_size": hidden,
        "intermediate_size": meta.require_positive(f"{arch}.feed_forward_length"),
        "num_layers": meta.require_positive(f"{arch}.block_count"),
        "num_heads": heads,
        "num_kv_heads": meta.require_positive(f"{arch}.attention.head_count_kv", heads),
        "head_dim": head_dim,
        "rms_norm_eps": meta.get(f"{arch}.attention.layer_norm_rms_epsilon", float),
        "rope_theta": meta.get(f"{arch}.rope.freq_base", float, 10000.0),
        "rope_scaling": None,
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": arch == "qwen2" or "blk.0.attn_q.bias" in tensors,
        "max_position_embeddings": meta.require_positive(f"{arch}.context_length"),
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_ids": tokenizer.eos_token_ids,
        "rope_freq_factors": _rope_freq_factors(meta.path, tensors.get(_ROPE_FREQS), head_dim),
    }
    try:
        return ModelConfig(**values)
    except ValueError as exc:
        raise ModelLoadError(f"{meta.path}: inconsistent metadata: {exc}") from exc


def _rope_freq_factors(path: Path, tensor: ReaderTensor | None, head_dim: int) -> tuple[float, ...] | None:
    """llama.cpp stores Llama 3.1's rope scaling as precomputed per-frequency divisors."""
    if tensor is None:
        return None
    if tuple(int(d) for d in tensor.shape) != (head_dim // 2,):
        raise ModelLoadError(f"{path}: tensor {_ROPE_FREQS!r} has shape {list(tensor.shape)}, "
                             f"expected [{head_dim // 2}]")
    return tuple(float(x) for x in dequantize(tensor.data, tensor.tensor_type))
