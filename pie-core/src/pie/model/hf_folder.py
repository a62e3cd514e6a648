"""Loading a decoder model from a Hugging Face folder (config.json, safetensors, tokenizer.json)."""

from __future__ import annotations

import contextlib
import json
import math
import mmap
import os
import re
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import tokenizers
from safetensors import SafetensorError, safe_open

from .config import (
    InvalidConfig,
    Llama3RopeScaling,
    ModelConfig,
    check_layer_indices,
    default_head_dim,
    weight_shapes,
)
from .chat_template import check_renders
from .errors import ChatTemplateError, ModelLoadError, is_library_error
from .mapped_pages import FileIdentity, changed_error, check_unchanged, identity, release_pages
from .tokenizer import Tokenizer, check_encodes
from ..files import FileTooLargeError, NotRegularFileError, read_regular_file
from ..models import ARCHITECTURES, architecture_of, for_hf
from ..weights import StoredWeight, Weight

_DTYPES = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype(ml_dtypes.bfloat16)}
"""The tensor types a folder may hold, and how numpy reads each (safetensors is little-endian)."""
_INDEX = "model.safetensors.index.json"
_MISSING: Any = object()
_MAX_TEXT_BYTES = 128 << 20
"""The largest config, tokenizer or template file read (real tokenizer.json files reach about 35 MB)."""
_LAYER = re.compile(r"model\.layers\.(\d{1,9})\.")
_FIELD_NAMES = {
    "architecture": "model_type",
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "eos_token_ids": "eos_token_id",
    "layer_windows": "sliding_window",
    "attn_softcap": "attn_logit_softcapping",
    "final_softcap": "final_logit_softcapping",
    "rope_local_theta": "rope_local_base_freq",
}
"""config.json's name for each `ModelConfig` field whose name differs, for messages."""


def open_hf_folder(
    path: Path,
) -> tuple[ModelConfig, Tokenizer, dict[str, str], Callable[[bool], Iterator[tuple[str, Weight]]]]:
    """Read and check a folder's config, tokenizer and tensor index; weights are read later, on demand:
    ``read(stored)`` yields float32 arrays, or with ``stored`` each F16 or BF16 matrix as a
    :class:`StoredWeight` viewing the file (vectors and F32 matrices as float32 arrays).
    Also returns each weight's type as the files store it (``f32``, ``f16``, ``bf16``)."""
    config_path = path / "config.json"
    fields = _Fields(config_path, _read_json(config_path))
    generation_path = path / "generation_config.json"
    generation = _read_json(generation_path) if generation_path.exists() else {}
    backend, chat_template, template_tokens = _tokenizer_files(path)
    located, identities = _tensor_index(path)
    config = _config(fields, generation, backend, template_tokens,
                     {int(m[1]) for name in located if (m := _LAYER.match(name))})
    try:
        tokenizer = Tokenizer(backend, bos_token_id=config.bos_token_id, eos_token_ids=config.eos_token_ids,
                              chat_template=chat_template[1] if chat_template else None,
                              template_tokens=template_tokens)
        if chat_template:
            check_renders(tokenizer.apply_chat_template)
    except ChatTemplateError as exc:
        raise ModelLoadError(f"{chat_template[0] if chat_template else path}: {exc}") from exc

    largest = max(backend.get_vocab(with_added_tokens=True).values(), default=-1)
    if largest >= config.vocab_size:
        # A smaller tokenizer is normal (embeddings padded to a round size); a larger one would
        # index past the embedding at run time.
        raise ModelLoadError(f"{path / 'tokenizer.json'}: the tokenizer has token ids up to {largest}, but the "
                             f"model's vocabulary ({config_path}: 'vocab_size') is {config.vocab_size}")
    shapes = weight_shapes(config)
    files = _check_tensors(path, located, shapes, config)
    file_types = {name: located[name][1].lower() for name in shapes}

    def read_all(stored: bool = False) -> Iterator[tuple[str, Weight]]:
        # Weights come layer by layer, and a caller has taken (uploaded, copied) a layer by the time it asks
        # for the second layer after it: the pages read for older layers are dropped from the process then.
        maps = {file: _SafetensorsMap(file, identities[file]) for file in sorted(set(files.values()))}
        read: list[tuple[int, str]] = []  # (layer, name)
        for name, shape in shapes.items():
            layer = _load_layer(name, config.num_layers)
            for _, older in (item for item in read if item[0] < layer - 1):
                maps[files[older]].release(older)
            read = [item for item in read if item[0] >= layer - 1]
            array = maps[files[name]].array(name, shape)
            if stored and len(shape) == 2 and file_types[name] != "f32":
                yield name, StoredWeight(file_types[name], (shape[0], shape[1]), array.view(np.uint8))
            else:
                yield name, np.array(array, dtype=np.float32, order="C")
            read.append((layer, name))

    return config, tokenizer, file_types, read_all


def _load_layer(name: str, num_layers: int) -> int:
    """Where a weight comes in the load order by layer: the embedding before layer 0, the final norm
    and LM head after the last."""
    if match := _LAYER.match(name):
        return int(match[1])
    return -1 if name == "model.embed_tokens.weight" else num_layers


class _SafetensorsMap:
    """A safetensors file mapped read-only, its tensors read as views of the map.

    The ``safetensors`` library checks the file (`_tensor_index` opens every shard with it) but copies each
    tensor it reads; where each tensor lies comes from the file's JSON header here, so that a weight kept
    as stored is a view of the file until the engine copies it.
    """

    _LENGTH = struct.Struct("<Q")

    def __init__(self, path: Path, checked: FileIdentity) -> None:
        """``checked``: the identity of the file `_tensor_index` checked, which must be the one mapped."""
        self.path, self._identity = path, checked
        try:
            with open(path, "rb") as file:
                mapped = identity(os.fstat(file.fileno()))
                self._buffer = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as exc:
            raise ModelLoadError(f"{path}: not a readable safetensors file: {exc}") from exc
        if mapped != checked:  # not the file checked: its header may say anything
            raise changed_error(path)
        try:
            (length,) = self._LENGTH.unpack_from(self._buffer, 0)
            header = json.loads(self._buffer[self._LENGTH.size:self._LENGTH.size + length])
        except (ValueError, struct.error) as exc:
            raise ModelLoadError(f"{path}: not a readable safetensors file: {exc}") from exc
        start = self._LENGTH.size + length
        self._spans: dict[str, tuple[int, int, str]] = {}  # name: (offset, bytes, dtype)
        for name, entry in header.items():
            if name != "__metadata__":
                begin, end = entry["data_offsets"]
                self._spans[name] = (start + begin, end - begin, entry["dtype"])

    def array(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """The tensor as a read-only view of the map, in its stored numpy type."""
        check_unchanged(self.path, self._identity)
        offset, nbytes, stored = self._spans[name]
        dtype = _DTYPES[stored]
        if nbytes != math.prod(shape) * dtype.itemsize or offset + nbytes > len(self._buffer):
            raise ModelLoadError(f"{self.path}: tensor {name!r} cannot be read: its data does not fit its shape "
                                 "(the file changed while loading?)")
        return np.frombuffer(self._buffer, dtype, math.prod(shape), offset).reshape(shape)

    def release(self, name: str) -> None:
        """Drop the tensor's pages from this process's memory (see `release_pages`)."""
        offset, nbytes, _ = self._spans[name]
        release_pages(self._buffer, offset, nbytes)


def _read_text(path: Path) -> str:
    """A regular file's UTF-8 text (a device or pipe could never end), of at most `_MAX_TEXT_BYTES`."""
    try:
        return read_regular_file(path, _MAX_TEXT_BYTES).decode("utf-8")
    except FileNotFoundError as exc:
        raise ModelLoadError(f"{path}: file not found") from exc
    except NotRegularFileError as exc:
        raise ModelLoadError(f"{path}: {exc.strerror}") from exc
    except FileTooLargeError as exc:
        raise ModelLoadError(f"{path}: {exc.size} bytes, more than the {exc.limit} a model's text file may "
                             "have") from exc
    except UnicodeDecodeError as exc:
        raise ModelLoadError(f"{path}: not UTF-8 text: {exc.reason} at byte {exc.start}") from exc
    except OSError as exc:
        raise ModelLoadError(f"{path}: cannot be read: {exc.strerror or exc}") from exc


def _read_json(path: Path) -> dict[str, Any]:
    text = _read_text(path)
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as exc:  # ValueError: not JSON, or a number of more than 4300 digits
        raise ModelLoadError(f"{path}: not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


class _Fields:
    """Typed reads of config.json fields, with errors that name the file and field."""

    def __init__(self, path: Path, data: dict[str, Any]) -> None:
        self.path, self.data = path, data

    def get(self, name: str, kind: type | tuple[type, ...], default: Any = _MISSING) -> Any:
        value = self.data.get(name)
        if value is None:
            if default is _MISSING:
                raise ModelLoadError(f"{self.path}: missing field {name!r}")
            return default
        if kind is float:
            return self.number(name, value)
        if isinstance(value, bool) and kind is not bool or not isinstance(value, kind):
            raise self.error(name, f"has invalid value {value!r}")
        return value

    def number(self, name: str, value: Any) -> float:
        """``value``, read from the field ``name`` (``rope_parameters.factor``), as a float."""
        if not isinstance(value, bool) and isinstance(value, (int, float)):
            with contextlib.suppress(OverflowError):  # an integer of more than 308 digits
                return float(value)
        raise self.error(name, f"has invalid value {value!r}")

    def error(self, name: str, problem: str) -> ModelLoadError:
        return ModelLoadError(f"{self.path}: field {name!r} {problem}")


def _config(fields: _Fields, generation: dict[str, Any], backend: tokenizers.Tokenizer,
            template_tokens: dict[str, str | None], layers: set[int]) -> ModelConfig:
    """The config, its layer count checked against ``layers`` (the layer numbers of the tensors present)."""
    model_type = fields.get("model_type", str)
    architecture = for_hf(fields.data)
    if architecture is None:
        supported = ", ".join(repr(t) for arch in ARCHITECTURES.values() for t in arch.hf_model_types)
        raise fields.error("model_type", f"is {model_type!r}; supported: {supported}")
    try:
        # Before anything is built per layer (an architecture's windows): the count is only a number in the file.
        check_layer_indices(fields.get("num_hidden_layers", int), layers)
    except InvalidConfig as exc:
        raise ModelLoadError(f"{fields.path}: {exc.naming(_FIELD_NAMES)}") from exc
    extra = architecture.hf_config(fields)
    heads = fields.get("num_attention_heads", int)
    hidden = fields.get("hidden_size", int)
    # null: derived from the other fields, as transformers' Llama does (a file that leaves one out means its family's)
    head_dim = architecture.hf_field(fields, "head_dim", int, None)
    kv_heads = architecture.hf_field(fields, "num_key_value_heads", int, None)
    context = architecture.hf_field(fields, "max_position_embeddings", int)
    theta, scaling = _rope(fields, architecture.hf_field(fields, "rope_theta", float), context)

    def token_ids(field: str, token_key: str) -> tuple[int, ...]:
        """Ids from config.json and generation_config.json (either may hold one id or a list),
        else the id of the token tokenizer_config.json names."""
        ids = []
        for file, value in (("config.json", fields.data.get(field)), ("generation_config.json", generation.get(field))):
            for item in value if isinstance(value, list) else [value]:
                if item is not None and (isinstance(item, bool) or not isinstance(item, int)):
                    raise ModelLoadError(f"{fields.path.parent / file}: field {field!r} has invalid value {value!r}")
                if item is not None:
                    ids.append(item)
        token = template_tokens.get(token_key)
        if not ids and token:
            found = backend.token_to_id(token)
            ids = [found] if found is not None else []
        return tuple(dict.fromkeys(ids))

    bos = token_ids("bos_token_id", "bos_token")
    try:
        common: dict[str, Any] = dict(
            architecture=architecture.name,
            vocab_size=fields.get("vocab_size", int),
            hidden_size=hidden,
            intermediate_size=fields.get("intermediate_size", int),
            num_layers=fields.get("num_hidden_layers", int),
            num_heads=heads,
            num_kv_heads=heads if kv_heads is None else kv_heads,
            head_dim=default_head_dim(hidden, heads) if head_dim is None else head_dim,
            rms_norm_eps=architecture.hf_field(fields, "rms_norm_eps", float),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=architecture.hf_field(fields, "tie_word_embeddings", bool),
            attention_bias=fields.get("attention_bias", bool, False),
            max_position_embeddings=context,
            bos_token_id=bos[0] if bos else None,
            eos_token_ids=token_ids("eos_token_id", "eos_token"),
        )
        return ModelConfig(**{**common, **extra})
    except InvalidConfig as exc:
        raise ModelLoadError(f"{fields.path}: {exc.naming(_FIELD_NAMES)}") from exc


def _rope(fields: _Fields, theta: float, context: int) -> tuple[float, Llama3RopeScaling | None]:
    """Rope base and scaling, from `rope_theta` + `rope_scaling` (older files) or `rope_parameters`, as transformers
    takes them: a `rope_scaling` in place of `rope_parameters`; the base these hold, else ``theta`` (the top-level
    `rope_theta`, or the family's default); Llama 3 scaling's original context, where they give none, ``context``
    (`max_position_embeddings`)."""
    newer = "rope_parameters" in fields.data and not fields.data.get("rope_scaling")
    name = "rope_parameters" if newer else "rope_scaling"
    params = fields.get(name, dict, {})
    ignored = {} if newer else fields.get("rope_parameters", dict, {})
    if ignored and _completed(ignored, theta) != _completed(params, theta):
        # which one the model was trained with is not ours to guess
        raise fields.error("rope_scaling", f"is {params!r}, which rope_parameters ({ignored!r}) contradicts; "
                                           "keep one of the two")
    if params.get("rope_theta") is not None:
        theta = fields.number(f"{name}.rope_theta", params["rope_theta"])
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise fields.error(f"{name}.rope_type", f"is {kind!r}; supported: 'default', 'llama3'")

    def positive(key: str, integer: bool = False, default: Any = None) -> float:
        value = params.get(key, default)
        number = fields.number(f"{name}.{key}", value)
        if integer and not isinstance(value, int) or not 0 < number < math.inf:
            raise fields.error(f"{name}.{key}", f"has invalid value {value!r}")
        return number

    scaling = Llama3RopeScaling(
        factor=positive("factor"),
        low_freq_factor=positive("low_freq_factor"),
        high_freq_factor=positive("high_freq_factor"),
        original_max_position_embeddings=int(positive("original_max_position_embeddings", True, context)),
    )
    if scaling.high_freq_factor <= scaling.low_freq_factor:
        raise fields.error(f"{name}.high_freq_factor", "must be greater than low_freq_factor")
    return theta, scaling


def _completed(params: dict[str, Any], theta: float) -> dict[str, Any]:
    """Rope parameters as transformers completes them: their kind under ``rope_type``, and ``theta`` as the base
    where they have none."""
    completed = {key: value for key, value in params.items() if key != "type"}
    completed["rope_type"] = params.get("rope_type", params.get("type", "default"))
    if completed.get("rope_theta") is None:
        completed["rope_theta"] = theta
    return completed


def _tokenizer_files(path: Path) -> tuple[tokenizers.Tokenizer, tuple[Path, str] | None, dict[str, str | None]]:
    """The tokenizer, the chat template (and the file it came from), and the special-token
    strings tokenizer_config.json gives templates."""
    tokenizer_path = path / "tokenizer.json"
    text = _read_text(tokenizer_path)
    try:
        backend = tokenizers.Tokenizer.from_str(text)
    except BaseException as exc:  # tokenizers raises a bare Exception for malformed files, and panics on some
        if not is_library_error(exc):
            raise
        raise ModelLoadError(f"{tokenizer_path}: not a valid tokenizer: {exc}") from exc
    check_encodes(backend, str(tokenizer_path))
    config_path = path / "tokenizer_config.json"
    tokenizer_config = _read_json(config_path) if config_path.exists() else {}
    template_tokens = {}
    for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
        value = tokenizer_config.get(key)
        token = value.get("content") if isinstance(value, dict) else value
        if token is not None and not isinstance(token, str):
            raise ModelLoadError(f"{config_path}: field {key!r} has invalid value {value!r}")
        template_tokens[key] = token
    template_path = path / "chat_template.jinja"
    if template_path.exists():
        return backend, (template_path, _read_text(template_path)), template_tokens
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        for index, entry in enumerate(template):
            if not (isinstance(entry, dict) and isinstance(entry.get("name"), str)
                    and isinstance(entry.get("template"), str)):
                raise ModelLoadError(f"{config_path}: field 'chat_template' entry {index} is not "
                                     '{"name": text, "template": text}')
        template = next((entry["template"] for entry in template if entry["name"] == "default"), None)
    if template is not None and not isinstance(template, str):
        raise ModelLoadError(f"{config_path}: field 'chat_template' has invalid value")
    return backend, (config_path, template) if template else None, template_tokens


def _open(file: Path) -> Any:
    try:
        return safe_open(str(file), framework="numpy")
    except (SafetensorError, OSError) as exc:
        raise ModelLoadError(f"{file}: not a readable safetensors file: {exc}") from exc


def _tensor_index(path: Path) -> tuple[dict[str, tuple[Path, str, tuple[int, ...]]], dict[Path, FileIdentity]]:
    """Every tensor the folder's safetensors files hold: the file, dtype and shape of each; and the identity of
    each file as it was checked."""
    index_path = path / _INDEX
    if index_path.exists():
        weight_map = _read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ModelLoadError(f"{index_path}: field 'weight_map' is missing or malformed")
        for name in set(weight_map.values()):
            if Path(name).name != name or name in ("", ".", ".."):
                raise ModelLoadError(f"{index_path}: field 'weight_map' names {name!r}, not a file in this folder")
        shards = sorted({path / name for name in weight_map.values()})
    else:
        shards = sorted(path.glob("*.safetensors"))
        if not shards:
            raise ModelLoadError(f"{path}: no *.safetensors files")
    located: dict[str, tuple[Path, str, tuple[int, ...]]] = {}
    identities: dict[Path, FileIdentity] = {}
    for shard in shards:
        if shard.exists() and not shard.is_file():
            raise ModelLoadError(f"{shard}: not a regular file")
        with _open(shard) as handle:
            identities[shard] = identity(os.stat(shard))
            for name in handle.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                if name in located:
                    raise ModelLoadError(f"{shard}: tensor {name!r} also appears in {located[name][0]}")
                tensor = handle.get_slice(name)
                located[name] = (shard, tensor.get_dtype(), tuple(tensor.get_shape()))
    return located, identities


def _check_tensors(path: Path, located: dict[str, tuple[Path, str, tuple[int, ...]]],
                   shapes: dict[str, tuple[int, ...]], config: ModelConfig) -> dict[str, Path]:
    """Which file holds each weight, after checking every weight is present with its shape and dtype."""
    for name, (shard, dtype, shape) in located.items():
        if name not in shapes:
            _check_unexpected(shard, name)
            continue
        if dtype not in _DTYPES:
            raise ModelLoadError(f"{shard}: tensor {name!r} has unsupported dtype {dtype}; "
                                 f"supported: {', '.join(_DTYPES)}")
        if shape != shapes[name]:
            raise ModelLoadError(f"{shard}: tensor {name!r} has shape {list(shape)}, expected {list(shapes[name])} "
                                 f"({architecture_of(config).describe_shape(name, _FIELD_NAMES)} in {path / 'config.json'})")
    for name in shapes:
        if name not in located:
            raise ModelLoadError(f"{path}: missing tensor {name!r}")
    return {name: located[name][0] for name in shapes}


def _check_unexpected(shard: Path, name: str) -> None:
    """Extra tensors that change nothing are skipped; any other means an unsupported variant."""
    if name == "lm_head.weight" or name.endswith(".rotary_emb.inv_freq"):
        return  # a tied head saved anyway; rope tables some old checkpoints carry
    raise ModelLoadError(f"{shard}: unexpected tensor {name!r} (a model variant Pie does not support)")
