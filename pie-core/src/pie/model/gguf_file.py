"""Loading a decoder model from a single GGUF file (llama.cpp's format)."""

from __future__ import annotations

import re
from dataclasses import replace
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from .config import (
    InvalidConfig,
    ModelConfig,
    check_layer_indices,
    check_size,
    default_head_dim,
    weight_shapes,
)
from .errors import ModelLoadError
from .gguf_header import GGUFHeader, TensorInfo
from .gguf_metadata import GGUFMetadata
from .gguf_tokenizer import tokenizer_from_gguf
from .tokenizer import Tokenizer
from ..models import ARCHITECTURES, architecture_of, for_gguf
from ..weights import WEIGHT_TYPES, StoredWeight, Weight, type_of_ggml

SUPPORTED_TYPES = frozenset(GGMLQuantizationType[ggml_name] for ggml_name, _, _ in WEIGHT_TYPES.values())
"""The tensor types a GGUF file may hold: the weight types pie carries."""

_ROPE_FREQS = "rope_freqs.weight"


_LAYER = re.compile(r"blk\.(\d{1,9})\.")


def open_gguf(
    path: Path,
) -> tuple[ModelConfig, Tokenizer, dict[str, str], Callable[[bool], Iterator[tuple[str, Weight]]]]:
    """Read and check a GGUF file's metadata and tensor index; weights are read later, on demand:
    ``read(stored)`` yields float32 arrays, or with ``stored`` each matrix in its file's type.
    Also returns each weight's type as the file stores it, by Hugging Face name."""
    header = GGUFHeader(path)
    tensors = header.tensors
    for name, tensor in tensors.items():
        if tensor.type not in SUPPORTED_TYPES:
            raise ModelLoadError(
                f"{path}: tensor {name!r} has unsupported type {tensor.type.name}; "
                f"supported: {', '.join(sorted(t.name for t in SUPPORTED_TYPES))}")
    meta = GGUFMetadata(header)
    # Before the tokenizer is built: its cost grows with the tokens the file claims, and the embedding's rows,
    # whose data the file holds, bound them.
    embedding, tokens = tensors.get("token_embd.weight"), meta.count("tokenizer.ggml.tokens")
    if embedding is None:
        raise ModelLoadError(f"{path}: missing tensor 'token_embd.weight'")
    if tokens is not None and tokens > embedding.shape[0]:
        raise ModelLoadError(f"{path}: metadata key 'tokenizer.ggml.tokens' holds {tokens} tokens, but tensor "
                             f"'token_embd.weight' has {embedding.shape[0]} rows (the model's vocabulary)")
    tokenizer = tokenizer_from_gguf(meta)
    config = _config(header, meta, tokenizer)
    names = _field_names(meta.get("general.architecture", str))
    if names["vocab_size"] not in meta:  # the tokens' count stands for it
        names["vocab_size"] = "number of tokenizer.ggml.tokens"
    shapes = weight_shapes(config)
    architecture = architecture_of(config)
    wanted = {architecture.gguf_name(name): name for name in shapes}
    for name in tensors:
        if name not in wanted and name != _ROPE_FREQS:
            raise ModelLoadError(f"{path}: unexpected tensor {name!r} (a model variant Pie does not support)")
    for gname, hf_name in wanted.items():
        if gname not in tensors:
            raise ModelLoadError(f"{path}: missing tensor {gname!r} ({hf_name})")
        shape = tensors[gname].shape
        if shape != shapes[hf_name]:
            raise ModelLoadError(f"{path}: tensor {gname!r} has shape {list(shape)}, expected {list(shapes[hf_name])} "
                                 f"({architecture.describe_shape(hf_name, names)})")

    def read_all(stored: bool = False) -> Iterator[tuple[str, Weight]]:
        # Weights come layer by layer, and a caller has taken (uploaded, copied) a layer by the time it asks
        # for the second layer after it: the pages read for older layers are dropped from the process then.
        read: list[tuple[int, TensorInfo]] = []  # (layer, tensor)
        for hf_name, shape in shapes.items():
            tensor = tensors[architecture.gguf_name(hf_name)]
            layer = _load_layer(hf_name, config.num_layers)
            header.release(t for at, t in read if at < layer - 1)
            read = [(at, t) for at, t in read if at >= layer - 1]
            if stored and len(shape) == 2 and tensor.type != GGMLQuantizationType.F32:
                yield hf_name, _read_stored(header, config, tensor, hf_name, shape)
            else:
                yield hf_name, _read(header, config, tensor, hf_name, shape)
            read.append((layer, tensor))

    file_types = {hf_name: type_of_ggml(tensors[gname].type.name) or "" for gname, hf_name in wanted.items()}
    return config, tokenizer, file_types, read_all


def _load_layer(hf_name: str, num_layers: int) -> int:
    """Where a weight comes in the load order by layer: the embedding before layer 0, the final norm
    and LM head after the last."""
    if hf_name.startswith("model.layers."):
        return int(hf_name.split(".")[2])
    return -1 if hf_name == "model.embed_tokens.weight" else num_layers


def _read(header: GGUFHeader, config: ModelConfig, tensor: TensorInfo, hf_name: str,
          shape: tuple[int, ...]) -> np.ndarray:
    data = header.data(tensor)
    try:
        array = dequantize(data, tensor.type)
    except Exception as exc:
        raise ModelLoadError(f"{header.path}: tensor {tensor.name!r} cannot be dequantized: {exc}") from exc
    array = array.reshape(shape)
    architecture = architecture_of(config)
    if architecture.gguf_permutes_qk and (".q_proj." in hf_name or ".k_proj." in hf_name):
        array = _unpermute_rows(array, config.num_heads if ".q_proj." in hf_name else config.num_kv_heads)
    if architecture.gguf_norms_offset and architecture.is_norm(hf_name):
        # Exact for stored values in [0.5, 4), as is adding it back (`Architecture.poem_weights`).
        array = array - np.float32(architecture.norm_offset)
    if np.may_share_memory(array, data):  # F32 data is a view of the read-only memory map
        array = array.copy()
    return np.ascontiguousarray(array, dtype=np.float32)


def _read_stored(header: GGUFHeader, config: ModelConfig, tensor: TensorInfo, hf_name: str,
                 shape: tuple[int, ...]) -> StoredWeight:
    """A matrix in its file's type: its bytes as rows, a view of the memory map unless rows are reordered."""
    data = header.data(tensor).reshape(shape[0], -1)
    weight = StoredWeight(type_of_ggml(tensor.type.name) or "", (shape[0], shape[1]), data)
    if architecture_of(config).gguf_permutes_qk and (".q_proj." in hf_name or ".k_proj." in hf_name):
        heads = config.num_heads if ".q_proj." in hf_name else config.num_kv_heads
        weight = weight.rows(_unpermute_rows(np.arange(shape[0]), heads))
    return weight


def _unpermute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation.

    llama.cpp's converter reorders each head's rows from the rotate_half layout (pairs `(j,
    j + d/2)`) to an interleaved one (pairs `(2j, 2j + 1)`) for its own rope kernel; the reverse
    takes row `2j + k` of a head back to row `j + k * d/2`.
    """
    rows = weight.shape[0]
    return weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _field_names(arch: str) -> dict[str, str]:
    """The metadata key behind each `ModelConfig` field, for messages."""
    return {
        "architecture": "general.architecture",
        "vocab_size": f"{arch}.vocab_size",
        "hidden_size": f"{arch}.embedding_length",
        "intermediate_size": f"{arch}.feed_forward_length",
        "num_layers": f"{arch}.block_count",
        "num_heads": f"{arch}.attention.head_count",
        "num_kv_heads": f"{arch}.attention.head_count_kv",
        "head_dim": f"{arch}.attention.key_length",
        "rms_norm_eps": f"{arch}.attention.layer_norm_rms_epsilon",
        "rope_theta": f"{arch}.rope.freq_base",
        "max_position_embeddings": f"{arch}.context_length",
        "bos_token_id": "tokenizer.ggml.bos_token_id",
        "eos_token_ids": "tokenizer.ggml.eos_token_id",
        "rope_freq_factors": _ROPE_FREQS,
    }


def _config(header: GGUFHeader, meta: GGUFMetadata, tokenizer: Tokenizer) -> ModelConfig:
    tensors = header.tensors
    arch = meta.get("general.architecture", str)
    architecture = for_gguf(arch)
    if architecture is None:
        supported = ", ".join(a.gguf_architecture for a in ARCHITECTURES.values() if a.gguf_architecture)
        raise ModelLoadError(f"{meta.path}: unsupported architecture {arch!r} (general.architecture); "
                             f"supported: {supported}")
    names = _field_names(arch)
    try:
        # Before anything is built per layer (an architecture's windows): the count is only a number in the file.
        check_layer_indices(meta.get(names["num_layers"], int),
                            {int(m[1]) for name in tensors if (m := _LAYER.match(name))})
        hidden = meta.get(names["hidden_size"], int)
        heads = meta.get(names["num_heads"], int)
        head_dim = meta.get(names["head_dim"], int, None)
        if head_dim is None:
            head_dim = default_head_dim(hidden, heads)
        check_size("head_dim", head_dim)  # before the rope's dimensions are compared with it
        rope_dim = meta.get(f"{arch}.rope.dimension_count", int, head_dim)
        if rope_dim != head_dim:
            raise ModelLoadError(f"{meta.path}: metadata key '{arch}.rope.dimension_count' is {rope_dim}; "
                                 f"partial rotary embeddings (head_dim {head_dim}) are unsupported")
        scaling = meta.get(f"{arch}.rope.scaling.type", str, "none")
        if scaling != "none":
            raise ModelLoadError(f"{meta.path}: metadata key '{arch}.rope.scaling.type' is {scaling!r}; "
                                 "unsupported rope scaling")
        for key in (f"{arch}.rope.scaling.factor", f"{arch}.rope.scale_linear"):
            # llama.cpp scales positions by a factor whatever the type says (linear where none is given)
            factor = meta.get(key, float, 0.0)
            if factor not in (0.0, 1.0):
                raise ModelLoadError(f"{meta.path}: metadata key '{key}' is {factor!r}; rope scaling is unsupported")
        config = ModelConfig(
            architecture=architecture.name,
            vocab_size=meta.get(names["vocab_size"], int, tokenizer.vocab_size),
            hidden_size=hidden,
            intermediate_size=meta.get(names["intermediate_size"], int),
            num_layers=meta.get(names["num_layers"], int),
            num_heads=heads,
            num_kv_heads=meta.get(names["num_kv_heads"], int, heads),
            head_dim=head_dim,
            rms_norm_eps=meta.get(names["rms_norm_eps"], float),
            rope_theta=meta.get(names["rope_theta"], float, 10000.0),
            rope_scaling=None,
            tie_word_embeddings="output.weight" not in tensors,
            max_position_embeddings=meta.get(names["max_position_embeddings"], int),
            bos_token_id=tokenizer.bos_token_id,
            eos_token_ids=tokenizer.eos_token_ids,
            rope_freq_factors=_rope_freq_factors(header, head_dim),
            attention_bias="blk.0.attn_q.bias" in tensors,
        )
        return replace(config, **architecture.gguf_config(meta, tensors))
    except InvalidConfig as exc:
        raise ModelLoadError(f"{meta.path}: {exc.naming(names)}") from exc


def _rope_freq_factors(header: GGUFHeader, head_dim: int) -> tuple[float, ...] | None:
    """llama.cpp stores Llama 3.1's rope scaling as precomputed per-frequency divisors."""
    tensor = header.tensors.get(_ROPE_FREQS)
    if tensor is None:
        return None
    if tensor.dims != (head_dim // 2,):
        raise ModelLoadError(f"{header.path}: tensor {_ROPE_FREQS!r} has shape {list(tensor.dims)}, "
                             f"expected [{head_dim // 2}]")
    return tuple(float(x) for x in dequantize(header.data(tensor), tensor.type))
