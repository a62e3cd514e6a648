"""Tiny random models for tests: a Hugging Face folder or a GGUF file in a fraction of a second.

`make_hf_model` needs `transformers` and `torch` (test-only dependencies); `make_gguf_model`
needs only what pie-core depends on. Both share one small byte-level BPE tokenizer, trained
on the spot, with ChatML special tokens and a chat template.
"""

from __future__ import annotations

import json
from dataclasses import replace
from functools import lru_cache
from pathlib import Path
from collections.abc import Mapping
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import quantize
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from pie.model.config import ModelConfig, weight_shapes
from pie.models import architecture_of
from pie.testing.kquants import K_TYPES, quantize_k

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
BOS_TOKEN_ID, EOS_TOKEN_ID = 0, 2

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

TOOLS_CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\n\n' }}{%- endif %}"
    "{{- '# Tools\n\n<tools>' }}"
    "{%- for tool in tools %}{{- '\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\n</tools>\n\nCall a function as <tool_call>\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\n</tool_call><|im_end|>\n' }}"
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first)"
    " or (message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant' }}"
    "{%- if message.content %}{{- '\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\n<tool_call>\n{\"name\": \"' }}{{- tool_call.name }}{{- '\", \"arguments\": ' }}"
    "{{- tool_call.arguments | tojson }}{{- '}\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)
"""Qwen2.5's chat template in short, tools and all: the tools in the system message, calls and their results in
Hermes's ``<tool_call>`` and ``<tool_response>`` tags."""

LLAMA_TOOLS_CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- set system_message = messages[0]['content'] %}{%- set messages = messages[1:] %}"
    "{%- else %}{%- set system_message = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\n\n' }}"
    "{%- if tools is not none %}{{- 'Environment: ipython\n' }}{%- endif %}"
    "{{- system_message + '<|eot_id|>' }}"
    "{%- if tools is not none %}"
    "{%- set first_user_message = messages[0]['content'] %}{%- set messages = messages[1:] %}"
    "{{- '<|start_header_id|>user<|end_header_id|>\n\n' }}"
    "{{- 'Given the following functions, please respond with a JSON for a function call with its proper arguments '"
    " 'that best answers the given prompt.\n\n' }}"
    "{{- 'Respond in the format {\"name\": function name, \"parameters\": dictionary of argument name and its value}.' }}"
    "{{- 'Do not use variables.\n\n' }}"
    "{%- for t in tools %}{{- t | tojson(indent=4) }}{{- '\n\n' }}{%- endfor %}"
    "{{- first_user_message + '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] + '<|eot_id|>' }}"
    "{%- elif 'tool_calls' in message %}"
    "{%- if not message.tool_calls | length == 1 %}"
    "{{- raise_exception('This model only supports single tool-calls at once!') }}{%- endif %}"
    "{%- set tool_call = message.tool_calls[0].function %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{{- '{\"name\": \"' + tool_call.name + '\", ' }}{{- '\"parameters\": ' }}{{- tool_call.arguments | tojson }}"
    "{{- '}' }}{{- '<|eot_id|>' }}"
    "{%- elif message.role == 'tool' or message.role == 'ipython' %}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\n\n' }}"
    "{%- if message.content is mapping or message.content is iterable %}{{- message.content | tojson }}"
    "{%- else %}{{- message.content }}{%- endif %}"
    "{{- '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}"
)
"""Llama 3.1's chat template (meta-llama/Llama-3.1-8B-Instruct) in short, without its built-in tools: the tools in
the first user message, a call written as the reply's JSON ``{"name": ..., "parameters": {...}}`` (one a turn), its
result in an ``ipython`` turn."""

MISTRAL_TOOLS_CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- set system_message = messages[0]['content'] %}{%- set loop_messages = messages[1:] %}"
    "{%- else %}{%- set loop_messages = messages %}{%- endif %}"
    "{%- if not tools is defined %}{%- set tools = none %}{%- endif %}"
    "{%- set user_messages = loop_messages | selectattr('role', 'equalto', 'user') | list %}"
    "{{- bos_token }}"
    "{%- for message in loop_messages %}"
    "{%- if message['role'] == 'user' %}"
    "{%- if tools is not none and (message == user_messages[-1]) %}"
    "{{- '[AVAILABLE_TOOLS] [' }}"
    "{%- for tool in tools %}{{- tool | tojson }}{%- if not loop.last %}{{- ', ' }}{%- endif %}{%- endfor %}"
    "{{- '][/AVAILABLE_TOOLS]' }}"
    "{%- endif %}"
    "{%- if loop.last and system_message is defined %}"
    "{{- '[INST] ' + system_message + '\n\n' + message['content'] + '[/INST]' }}"
    "{%- else %}{{- '[INST] ' + message['content'] + '[/INST]' }}{%- endif %}"
    "{%- elif message.tool_calls is defined and message.tool_calls is not none %}"
    "{{- '[TOOL_CALLS] [' }}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- set out = tool_call.function | tojson %}{{- out[:-1] }}"
    "{%- if not tool_call.id is defined or tool_call.id | length != 9 %}"
    "{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{%- endif %}"
    "{{- ', \"id\": \"' + tool_call.id + '\"}' }}"
    "{%- if not loop.last %}{{- ', ' }}{%- else %}{{- ']' + eos_token }}{%- endif %}"
    "{%- endfor %}"
    "{%- elif message['role'] == 'assistant' %}{{- ' ' + message['content'] | trim + eos_token }}"
    "{%- elif message['role'] == 'tool' %}"
    "{{- '[TOOL_RESULTS] {\"content\": ' + message.content | string + ', ' }}"
    "{%- if not message.tool_call_id is defined or message.tool_call_id | length != 9 %}"
    "{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{%- endif %}"
    "{{- '\"call_id\": \"' + message.tool_call_id + '\"}[/TOOL_RESULTS]' }}"
    "{%- else %}{{- raise_exception('Only user and assistant roles are supported!') }}"
    "{%- endif %}"
    "{%- endfor %}"
)
"""Mistral-7B-Instruct-v0.3's chat template (its v3 tokenizer's) in short: the tools in ``[AVAILABLE_TOOLS]`` before
the last user message, calls as ``[TOOL_CALLS]`` and a JSON array, each call's id 9 letters and digits (the template
refuses another), a result in ``[TOOL_RESULTS]``."""

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Pie serves language models on every kind of hardware.",
    "A paged key-value cache keeps the attention state of each sequence.",
    "Tokenizers split text into pieces; byte-level pieces never lose a character.",
    "Héllo wörld, ça va? Grüße aus Köln. Ñandú.",
    "日本語のテキストも少し。中文也有一点。",
    "def forward(x): return x @ w + b  # 12345 67890",
] * 8


@lru_cache(maxsize=1)
def _tokenizer_json() -> str:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(_CORPUS, trainer)
    bos = SPECIAL_TOKENS[BOS_TOKEN_ID]
    tokenizer.post_processor = processors.TemplateProcessing(
        single=[bos, "$A"], pair=[bos, "$A", bos, "$B"], special_tokens=[(bos, BOS_TOKEN_ID)])
    return tokenizer.to_str()


def tiny_tokenizer() -> Tokenizer:
    """The test tokenizer: byte-level BPE (about 400 tokens) that adds BOS when encoding."""
    return Tokenizer.from_str(_tokenizer_json())


TINY_WINDOW = 5
"""The sliding window of the tiny models that have one: shorter than the test prompts."""


def tiny_config(architecture: str = "llama", **overrides: Any) -> ModelConfig:
    """A small `ModelConfig` matching the test tokenizer; `overrides` are `ModelConfig` fields.

    Each architecture gets what makes it differ (see `TINY_VARIANTS`), sized for ``num_layers``.
    """
    layers = overrides.get("num_layers", 2)
    fields: dict[str, Any] = dict(
        architecture=architecture, vocab_size=tiny_tokenizer().get_vocab_size(), hidden_size=64,
        intermediate_size=128, num_layers=layers, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5,
        rope_theta=10000.0, rope_scaling=None, tie_word_embeddings=False, attention_bias=architecture == "qwen2",
        max_position_embeddings=256, bos_token_id=BOS_TOKEN_ID, eos_token_ids=(EOS_TOKEN_ID,))
    variant = TINY_VARIANTS.get(architecture)
    return ModelConfig(**{**fields, **(variant(layers) if variant else {}), **overrides})


def _alternating(layers: int) -> tuple[int, ...]:
    return tuple(TINY_WINDOW if i % 2 == 0 else 0 for i in range(layers))


TINY_VARIANTS: dict[str, Any] = {
    "mistral": lambda layers: {"layer_windows": (TINY_WINDOW,) * layers},
    "gemma2": lambda layers: {"layer_windows": _alternating(layers), "attn_softcap": 2.0, "final_softcap": 3.0,
                              "query_pre_attn_scalar": 24.0},
    "gemma3": lambda layers: {"layer_windows": _alternating(layers), "rope_theta": 1e6, "rope_local_theta": 1e4,
                              "query_pre_attn_scalar": 24.0},
}
"""`ModelConfig` fields per architecture for a model of ``layers`` layers: windows shorter than the test
prompts, soft-caps that bite on random weights, a query scalar other than ``head_dim``."""

HF_VARIANTS: dict[str, dict[str, Any]] = {
    "phi3": {"pad_token_id": EOS_TOKEN_ID},  # its default, 32000, is outside the tiny vocabulary
    "mistral": {"sliding_window": TINY_WINDOW},
    "gemma2": {"sliding_window": TINY_WINDOW, "attn_logit_softcapping": 2.0, "final_logit_softcapping": 3.0,
               "query_pre_attn_scalar": 24},
    "gemma3": {"sliding_window": TINY_WINDOW, "query_pre_attn_scalar": 24,
               "layer_types": ["sliding_attention", "full_attention"]},
}
"""transformers config fields per architecture for `make_hf_model`, as `TINY_VARIANTS` says them."""


def random_weights(config: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Random float32 weights by Hugging Face name; norms scatter around 1, the rest around 0."""
    rng = np.random.default_rng(seed)
    weights = {}
    for name, shape in weight_shapes(config).items():
        if "norm" in name:
            weights[name] = (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            weights[name] = (0.05 * rng.standard_normal(shape)).astype(np.float32)
    return weights


def make_hf_model(directory: str | Path, *, architecture: str = "llama", dtype: str = "float32",
                  max_shard_size: str | None = None, template_file: bool = False, seed: int = 0,
                  **config_overrides: Any) -> Path:
    """Write a random-weight Hugging Face folder of `architecture` (a key of `pie.models.ARCHITECTURES`)
    with transformers and return it.

    `config_overrides` are fields of the architecture's transformers config (after `HF_VARIANTS`). `dtype` is the stored weight type
    ("float32", "float16", "bfloat16"); `max_shard_size` (e.g. "100KB") writes sharded safetensors
    with an index; `template_file` puts the chat template in chat_template.jinja instead of
    tokenizer_config.json.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from pie.models import ARCHITECTURES

    directory = Path(directory)
    settings: dict[str, Any] = {
        "vocab_size": tiny_tokenizer().get_vocab_size(), "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "bos_token_id": BOS_TOKEN_ID, "eos_token_id": EOS_TOKEN_ID,
        **HF_VARIANTS.get(architecture, {}),
    }
    settings.update(config_overrides)
    settings.setdefault("head_dim", settings["hidden_size"] // settings["num_attention_heads"])
    torch.manual_seed(seed)
    config = AutoConfig.for_model(ARCHITECTURES[architecture].hf_model_types[0], **settings)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.copy_(1 + 0.1 * torch.randn_like(parameter))
            else:
                parameter.copy_(0.05 * torch.randn_like(parameter))
    model = model.to(getattr(torch, dtype))
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, **kwargs)

    (directory / "tokenizer.json").write_text(_tokenizer_json(), encoding="utf-8")
    tokenizer_config: dict[str, Any] = {
        "bos_token": SPECIAL_TOKENS[BOS_TOKEN_ID], "eos_token": SPECIAL_TOKENS[EOS_TOKEN_ID]}
    if template_file:
        (directory / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
    else:
        tokenizer_config["chat_template"] = CHAT_TEMPLATE
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2), encoding="utf-8")
    return directory


def add_tiny_vocabulary(writer: GGUFWriter, vocab_size: int) -> None:
    """`tiny_tokenizer()` as a GGUF file's byte-level BPE metadata, padded to ``vocab_size`` tokens."""
    tokenizer = tiny_tokenizer()
    ids = tokenizer.get_vocab()
    tokens = sorted(ids, key=ids.__getitem__)
    tokens += [f"[PAD{i}]" for i in range(len(tokens), vocab_size)]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in SPECIAL_TOKENS else 1 for t in tokens])
    merges = json.loads(tokenizer.to_str())["model"]["merges"]
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_bos_token_id(BOS_TOKEN_ID)
    writer.add_eos_token_id(EOS_TOKEN_ID)
    writer.add_add_bos_token(True)


GGUF_WRITER_ARCHITECTURES = ("llama", "qwen2", "qwen3", "phi3")
"""The architectures `make_gguf_model` writes as llama.cpp's converter would."""


def make_gguf_model(path: str | Path, weight_type: str | GGMLQuantizationType = "F32", *, seed: int = 0,
                    lm_head_scale: float = 1.0, weight_types: Mapping[str, str] | None = None,
                    chat_template: str = CHAT_TEMPLATE, **config: Any) -> Path:
    """Write a random-weight GGUF file the way llama.cpp's converter would, and return its path.

    `config` overrides `tiny_config()` fields (`architecture` included). The weights are
    `random_weights(tiny_config(**config), seed)`; matrices are stored as `weight_type`, norms and
    biases as F32 (as llama.cpp does). For the llama architecture the Q and K rows are permuted
    into llama.cpp's interleaved rope order. Llama 3 `rope_scaling` is stored as llama.cpp stores
    it, as a `rope_freqs` tensor of per-frequency divisors. `lm_head_scale` spreads the logits, so that
    greedy choices are never near-ties that float rounding could flip (for tests that compare runs).
    `weight_types` maps parts of Hugging Face names to the type of the matrices whose names hold them
    (`{"mlp.down_proj": "Q6_K"}`, as llama.cpp's Q4_K_M mixes types); K-quants (Q4_K, Q5_K, Q6_K) are
    written by `pie.testing.kquants.quantize_k` and need the matrices' columns to be multiples of 256.
    `chat_template` is the file's (`TOOLS_CHAT_TEMPLATE`: one that shows tools).
    """
    path = Path(path)
    qtype = GGMLQuantizationType[weight_type] if isinstance(weight_type, str) else weight_type
    model = tiny_config(**config)
    arch = model.architecture
    if arch not in GGUF_WRITER_ARCHITECTURES:  # their files carry keys and layouts this writer does not write
        raise ValueError(f"make_gguf_model writes {', '.join(GGUF_WRITER_ARCHITECTURES)} files, not {arch!r}: "
                         "tests/runtime/test_gguf_conversions_vs_transformers.py converts the others")

    writer = GGUFWriter(path, arch)
    writer.add_context_length(model.max_position_embeddings)
    writer.add_embedding_length(model.hidden_size)
    writer.add_block_count(model.num_layers)
    writer.add_feed_forward_length(model.intermediate_size)
    writer.add_head_count(model.num_heads)
    writer.add_head_count_kv(model.num_kv_heads)
    writer.add_key_length(model.head_dim)
    writer.add_rope_dimension_count(model.head_dim)
    writer.add_layer_norm_rms_eps(model.rms_norm_eps)
    writer.add_rope_freq_base(model.rope_theta)
    writer.add_vocab_size(model.vocab_size)
    add_tiny_vocabulary(writer, model.vocab_size)
    writer.add_chat_template(chat_template)

    factors = model.rope_freq_factors
    if model.rope_scaling is not None:  # llama.cpp's converter turns Llama 3.1 scaling into divisors
        factors = tuple(replace(model, rope_scaling=None).rope_inv_freq() / model.rope_inv_freq())
    if factors is not None:
        writer.add_tensor("rope_freqs.weight", np.asarray(factors, dtype=np.float32))
    for name, weight in random_weights(model, seed).items():
        if name == "lm_head.weight":
            weight = weight * np.float32(lm_head_scale)
        if architecture_of(model).gguf_permutes_qk and (".q_proj." in name or ".k_proj." in name):
            weight = _permute_rows(weight, model.num_heads if ".q_proj." in name else model.num_kv_heads)
        chosen = next((GGMLQuantizationType[t] for part, t in (weight_types or {}).items() if part in name), qtype)
        data, raw_dtype = _encode(weight, chosen)
        writer.add_tensor(architecture_of(model).gguf_name(name), data, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


Q4_K_M_TYPES = {"mlp.down_proj": "Q6_K", "lm_head": "Q6_K", "self_attn.o_proj": "Q5_K"}
"""`make_k_quant_model`'s mix: Q6_K where llama.cpp's Q4_K_M keeps more bits (the MLP's down projection, the
output), Q5_K for the attention output so that every K-quant type is read, Q4_K for the rest."""


def make_k_quant_model(path: str | Path, seed: int = 0) -> Path:
    """A tiny random Llama GGUF whose matrices are K-quants mixed as `Q4_K_M_TYPES` says: 256 wide, one
    super-block a row, and logits spread (`lm_head_scale`) so that greedy choices are clear."""
    return make_gguf_model(path, "Q4_K", seed=seed, weight_types=Q4_K_M_TYPES, hidden_size=256,
                           intermediate_size=512, num_heads=4, num_kv_heads=2, head_dim=64, lm_head_scale=8.0)


def rewrite_gguf(source: str | Path, target: str | Path, *, metadata: dict[str, Any] | None = None,
                 drop_keys: tuple[str, ...] = (), drop_tensors: tuple[str, ...] = (),
                 tensors: dict[str, tuple[np.ndarray, GGMLQuantizationType | None]] | None = None,
                 architecture: str | None = None,
                 typed_metadata: dict[str, tuple[Any, GGUFValueType, GGUFValueType | None]] | None = None) -> Path:
    """Copy a GGUF file, replacing metadata values (each keeps its stored type, or takes the value type and array
    item type ``typed_metadata`` gives it), leaving out keys or tensors, or replacing tensors (`(data, raw_dtype)` as
    `GGUFWriter.add_tensor` takes them)."""
    reader = GGUFReader(source)
    writer = GGUFWriter(target, architecture or reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in drop_keys or key in (typed_metadata or {}):
            continue
        sub_type = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(key, (metadata or {}).get(key, field.contents()), field.types[0], sub_type)
    for key, (value, value_type, sub_type) in (typed_metadata or {}).items():
        writer.add_key_value(key, value, value_type, sub_type)
    for tensor in reader.tensors:
        if tensor.name in drop_tensors:
            continue
        data, raw_dtype = (tensors or {}).get(tensor.name, (np.array(tensor.data), None))
        if raw_dtype is None and tensor.tensor_type not in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            raw_dtype = tensor.tensor_type
        writer.add_tensor(tensor.name, data, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(target)


def _encode(weight: np.ndarray, qtype: GGMLQuantizationType) -> tuple[np.ndarray, GGMLQuantizationType | None]:
    """The data and `raw_dtype` to hand `GGUFWriter.add_tensor`."""
    if weight.ndim == 1 or qtype == GGMLQuantizationType.F32:
        return weight, None
    if qtype == GGMLQuantizationType.F16:
        return weight.astype(np.float16), None
    if qtype.name.lower() in K_TYPES:
        return quantize_k(weight, qtype.name.lower()).data, qtype
    return quantize(weight, qtype), qtype


def _permute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter (`LlamaModel.permute`): rotate_half row order to interleaved."""
    return (weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


