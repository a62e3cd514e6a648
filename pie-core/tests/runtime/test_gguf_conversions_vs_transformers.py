"""GGUF files of the Mistral, Gemma 2 and Gemma 3 architectures, converted from a Hugging Face folder the way
llama.cpp's ``convert_hf_to_gguf.py`` converts them, read as the folder reads and run as transformers runs it.

`convert_like_llama_cpp` is that converter, cut down to these families and written with the gguf library:
the metadata keys each family's converter class writes, tensor names from gguf's own name map, Q/K rows
permuted for the Llama-family rope, Gemma's norms with their 1 added, Gemma 2's ``lm_head`` left out."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from safetensors.numpy import load_file

from pie.model import ModelLoadError, load_model
from pie.models import ARCHITECTURES, architecture_of
from pie.plugins import EngineRegistry
from pie.runtime.model_runner import ModelRunner, SequenceWork
from pie.testing.models import (
    TINY_WINDOW,
    add_tiny_vocabulary,
    make_hf_model,
    rewrite_gguf,
)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    # MistralForCausalLM becomes a `llama` file, Mistral3ForConditionalGeneration's text model a `mistral3` one;
    # neither keeps a sliding window, so these Mistrals have none (as Mistral 7B v0.2 and later have none).
    "mistral-as-llama": ("llama", dict(architecture="mistral", sliding_window=None)),
    "mistral-as-mistral3": ("mistral3", dict(architecture="mistral", sliding_window=None)),
    "mistral3-tied-mha": ("mistral3", dict(architecture="mistral", sliding_window=None, tie_word_embeddings=True,
                                           num_key_value_heads=4)),
    # The converters store no query_pre_attn_scalar: llama.cpp scales by head_dim below 27B.
    "gemma2-softcaps-window-5": ("gemma2", dict(architecture="gemma2", tie_word_embeddings=True,
                                                query_pre_attn_scalar=16)),
    # Six layers: llama.cpp's Gemma 3 pattern, five sliding then a global one with its own rope base.
    "gemma3-six-layers-untied": ("gemma3", dict(architecture="gemma3", num_hidden_layers=6, layer_types=None,
                                                query_pre_attn_scalar=16)),
    "gemma3-tied": ("gemma3", dict(architecture="gemma3", num_hidden_layers=6, layer_types=None,
                                   query_pre_attn_scalar=16, tie_word_embeddings=True)),
}
"""Each case: the GGUF architecture llama.cpp writes, and `make_hf_model`'s arguments for the checkpoint."""


def convert_like_llama_cpp(folder: Path, path: Path, arch: str, extra: dict[str, float] | None = None) -> Path:
    """Write the Hugging Face ``folder`` as a GGUF file of ``arch`` (f32 tensors), as llama.cpp's converter
    classes for it do: ``LlamaModel`` (``llama``, ``mistral3``), ``Gemma2Model``, ``Gemma3Model``; ``extra``
    adds float32 metadata keys."""
    config = json.loads((folder / "config.json").read_text())
    rope = config.get("rope_parameters") or {}
    rope_theta = rope.get("full_attention", rope).get("rope_theta", config.get("rope_theta"))
    writer = gguf.GGUFWriter(path, arch)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    if arch in ("llama", "mistral3"):
        writer.add_rope_freq_base(rope_theta)
        writer.add_vocab_size(config["vocab_size"])
        writer.add_rope_dimension_count(config["head_dim"])
    elif arch == "gemma2":  # Gemma2Model writes no rope base: llama.cpp's default, 10000, is Gemma 2's
        writer.add_attn_logit_softcapping(config["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(config["final_logit_softcapping"])
        writer.add_sliding_window(config["sliding_window"])
    else:
        writer.add_rope_freq_base(rope_theta)  # the global layers'; llama.cpp gives the local ones 10000
        writer.add_sliding_window(config["sliding_window"])
    for key, value in (extra or {}).items():
        writer.add_float32(key, value)
    add_tiny_vocabulary(writer, config["vocab_size"])

    model_arch = next(key for key, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)
    names = gguf.get_tensor_name_map(model_arch, config["num_hidden_layers"])
    for name, data in load_file(folder / "model.safetensors").items():
        if arch == "gemma2" and name == "lm_head.weight":
            continue  # Gemma2Model skips it: llama.cpp ties Gemma 2's head to the embedding
        if arch in ("llama", "mistral3") and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config["num_attention_heads" if "q_proj" in name else "num_key_value_heads"]
            data = _permute(data, heads)
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            data = data + np.float32(1)
        writer.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), np.ascontiguousarray(data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """``LlamaModel.permute``: each head's rows from rotate_half pairs to interleaved ones."""
    rows = weight.shape[0] // heads // 2
    return weight.reshape(heads, 2, rows, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


@pytest.fixture(scope="module")
def cpu():
    return EngineRegistry().select("cpu")[0]


@pytest.fixture(scope="module", params=sorted(MODELS))
def converted(request, tmp_path_factory) -> tuple[Path, Path]:
    """A case's Hugging Face folder and the GGUF file converted from it."""
    arch, settings = MODELS[request.param]
    folder = make_hf_model(tmp_path_factory.mktemp(request.param), **settings)
    return folder, convert_like_llama_cpp(folder, folder.parent / f"{request.param}.gguf", arch)


def test_a_converted_file_reads_as_its_folder(converted: tuple[Path, Path]) -> None:
    """The same config (but for ``query_pre_attn_scalar``, which the file has not: its default means the same
    here), and the same weights as Poem takes them, bit for bit."""
    folder, path = converted
    hf, from_gguf = load_model(folder), load_model(path)
    expected = hf.config
    if expected.query_pre_attn_scalar == expected.head_dim:
        expected = replace(expected, query_pre_attn_scalar=None)
    if path.stem.startswith("mistral-as-llama"):
        expected = replace(expected, architecture="llama")  # a Mistral without a window is a Llama
    assert from_gguf.config == expected
    architecture = architecture_of(expected)
    want = dict(architecture.poem_weights(hf.config, hf.tensors()))
    got = dict(architecture.poem_weights(from_gguf.config, from_gguf.tensors()))
    assert list(got) == list(want)
    for name, weight in want.items():
        np.testing.assert_array_equal(got[name], weight, err_msg=name)


def test_a_converted_file_gives_transformers_logits_through_prefill_and_decode(cpu, converted) -> None:
    folder, path = converted
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    loaded = load_model(path)
    runner = ModelRunner(loaded.config, loaded.tensors(), cpu, page_size=4, max_cached_tokens=128)
    prompt = loaded.tokenizer.encode("The quick brown fox jumps over the lazy dog.")
    assert len(prompt) > TINY_WINDOW + runner.page_size, "the prompt outruns the sliding window and spans pages"
    sequence = runner.new_sequence()
    tokens = list(prompt)
    logits = runner.step([SequenceWork(sequence, prompt)])[0]
    for step in range(9):
        with torch.no_grad():
            expected = reference(torch.tensor([tokens])).logits[0, -1].numpy()
        np.testing.assert_allclose(logits, expected, rtol=0, atol=1e-4, err_msg=f"{path.name}, step {step}")
        tokens.append(int(np.argmax(expected)))
        logits = runner.step([SequenceWork(sequence, [tokens[-1]])])[0]
    sequence.free()


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_the_27b_layer_count_scales_queries_by_hidden_size_per_head(arch: str) -> None:
    """llama.cpp's rule for the one Gemma size whose ``query_pre_attn_scalar`` is not ``head_dim``."""
    architecture = ARCHITECTURES[arch]
    layers = architecture.gguf_hidden_per_head_layers
    sizes = {f"{arch}.embedding_length": 4608, f"{arch}.attention.head_count": 32}
    assert architecture.gguf_config(_Metadata({f"{arch}.block_count": layers, **sizes}), ())[
        "query_pre_attn_scalar"] == 144.0
    assert "query_pre_attn_scalar" not in architecture.gguf_config(
        _Metadata({f"{arch}.block_count": layers - 1, **sizes}), ())


def test_what_a_gemma_file_leaves_out_takes_llama_cpp_defaults() -> None:
    """Gemma 2: a window of 4096 on even layers, soft-caps 50 and 30; Gemma 3: no window, so no local layers."""
    gemma2 = ARCHITECTURES["gemma2"].gguf_config(_Metadata({"gemma2.block_count": 4}), ())
    assert gemma2["layer_windows"] == (4096, 0, 4096, 0)
    assert (gemma2["attn_softcap"], gemma2["final_softcap"]) == (50.0, 30.0)
    gemma3 = ARCHITECTURES["gemma3"].gguf_config(_Metadata({"gemma3.block_count": 7}), ())
    assert (gemma3["layer_windows"], gemma3["rope_local_theta"], gemma3["final_softcap"]) == ((), None, 0.0)
    windowed = ARCHITECTURES["gemma3"].gguf_config(
        _Metadata({"gemma3.block_count": 7, "gemma3.attention.sliding_window": 512}), ())
    assert windowed["layer_windows"] == (512,) * 5 + (0, 512) and windowed["rope_local_theta"] == 10_000.0


class _Metadata:
    """GGUF metadata as `pie.models.base.GGUFConfigReader` reads it, from a dict."""

    def __init__(self, values: dict[str, Any]) -> None:
        self.values = values

    def get(self, name: str, kind: Any, default: Any = None) -> Any:
        return self.values.get(name, default)

    def error(self, key: str, problem: str) -> Exception:
        return ModelLoadError(f"{key} {problem}")


@pytest.fixture(scope="module")
def mistral3_folder(tmp_path_factory) -> Path:
    return make_hf_model(tmp_path_factory.mktemp("mistral3"), **MODELS["mistral-as-mistral3"][1])


@pytest.mark.parametrize("arch", ["gemma", "gemma3n", "mistral4"])
def test_an_unsupported_architecture_is_named_with_those_supported(mistral3_folder: Path, tmp_path: Path,
                                                                    arch: str) -> None:
    source = convert_like_llama_cpp(mistral3_folder, tmp_path / "source.gguf", "mistral3")
    target = rewrite_gguf(source, tmp_path / "m.gguf", architecture=arch)
    with pytest.raises(ModelLoadError, match=re.escape(
            f"m.gguf: unsupported architecture {arch!r} (general.architecture); supported: ")) as info:
        load_model(target)
    assert all(name in str(info.value) for name in ("llama", "mistral3", "gemma2", "gemma3"))


def test_ministral3_attention_temperature_is_refused_by_key(mistral3_folder: Path, tmp_path: Path) -> None:
    key = "mistral3.attention.temperature_scale"
    path = convert_like_llama_cpp(mistral3_folder, tmp_path / "m.gguf", "mistral3", extra={key: 0.1})
    with pytest.raises(ModelLoadError, match=re.escape(
            f"m.gguf: metadata key {key!r} is set; Ministral 3's position-dependent attention temperature")):
        load_model(path)
