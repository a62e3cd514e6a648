"""The architecture registry (pie.models): which module reads a file, what each refuses, the layer
descriptions it gives Poem, and the tuning sites read off its graph."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from pie.model import ModelLoadError, load_model, weight_shapes
from pie.models import ARCHITECTURES, architecture_of, for_gguf, for_hf
from pie.poem import build_decoder_graph
from pie.profiles.workloads import DECODE_ATTENTION, Dims, sites
from pie.testing.models import TINY_WINDOW, make_gguf_model, make_hf_model, random_weights, tiny_config


def _edit(folder: Path, **changes: object) -> Path:
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    return folder


def test_the_registry_finds_each_family_by_model_type_architectures_and_gguf_name() -> None:
    assert for_hf({"model_type": "gemma3_text"}) is ARCHITECTURES["gemma3"]
    assert for_hf({"architectures": ["Phi3ForCausalLM"]}) is ARCHITECTURES["phi3"]
    assert for_hf({"model_type": "mamba", "architectures": ["LlamaForCausalLM"]}) is None, "model_type decides"
    assert for_gguf("qwen2") is ARCHITECTURES["qwen2"] and for_gguf("gpt2") is None
    assert architecture_of(tiny_config("mistral")) is ARCHITECTURES["mistral"]


@pytest.mark.parametrize("architecture", list(ARCHITECTURES))
def test_each_architecture_loads_its_own_folder_with_every_weight_it_names(tmp_path: Path, architecture: str) -> None:
    loaded = load_model(make_hf_model(tmp_path / architecture, architecture=architecture))
    assert loaded.config.architecture == architecture
    assert [name for name, _ in loaded.tensors()] == list(weight_shapes(loaded.config))


def test_phi3_long_context_rope_is_refused_by_name(tmp_path: Path) -> None:
    folder = make_hf_model(tmp_path / "phi3", architecture="phi3")
    _edit(folder, rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8,
                                   "long_factor": [1.0] * 8})
    with pytest.raises(ModelLoadError, match=r"'rope_parameters.rope_type' is 'longrope': Phi-3's long-context"):
        load_model(folder)
    _edit(folder, rope_parameters=None, rope_scaling={"type": "su", "short_factor": [1.0], "long_factor": [1.0]})
    with pytest.raises(ModelLoadError, match=r"'rope_scaling.rope_type' is 'su'"):
        load_model(folder)


def test_a_phi3_rope_transformers_refuses_is_refused(tmp_path: Path) -> None:
    """transformers' Phi-3 takes only default and LongRoPE rope; Pie ran a Phi-3 file with Llama 3 scaling."""
    transformers = pytest.importorskip("transformers")
    folder = _edit(make_hf_model(tmp_path / "phi3", architecture="phi3"), rope_parameters={
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64})
    with pytest.raises(Exception, match="llama3"):  # huggingface_hub's strict validation error
        transformers.AutoConfig.from_pretrained(folder)
    with pytest.raises(ModelLoadError, match=r"'rope_parameters.rope_type' is 'llama3'; a Phi-3 model's rope is"):
        load_model(folder)


@pytest.mark.parametrize(("architecture", "changes", "fragment"), [
    ("phi3", {"partial_rotary_factor": 0.5}, "'partial_rotary_factor' is 0.5; partial rotary embeddings"),
    # transformers' Llama-family default rope ignores the factor (rotating the whole head) and its Llama 3 rope fails
    # on it: Pie refuses it rather than guess which the checkpoint was trained with.
    ("llama", {"partial_rotary_factor": 0.5}, "'partial_rotary_factor' is 0.5; partial rotary embeddings"),
    ("qwen2", {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}},
     "'partial_rotary_factor' is 0.25"),
    ("mistral", {"partial_rotary_factor": 0.5}, "'partial_rotary_factor' is 0.5"),
    ("qwen3", {"use_sliding_window": True, "layer_types": ["sliding_attention"]},
     "'layer_types' is ['sliding_attention']; expected 2 of"),
    ("gemma2", {"hidden_activation": "relu"}, "'hidden_activation' is 'relu'"),
    ("gemma2", {"layer_types": ["sliding_attention"]},
     "'layer_types' is ['sliding_attention']; expected 2 of 'sliding_attention', 'full_attention'"),
    ("gemma3", {"rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0}}},
     "'rope_parameters.full_attention.rope_type' is 'linear'"),
    # transformers reads a "type" as the rope_type, where Pie took it for default rope
    ("gemma3", {"rope_parameters": {"full_attention": {"type": "linear", "factor": 8.0}}},
     "'rope_parameters.full_attention.rope_type' is 'linear'"),
    ("mistral", {"layer_types": ["full_attention", "sliding_attention"]}, "'layer_types' is set"),
])
def test_what_an_architecture_cannot_run_is_named(tmp_path: Path, architecture: str, changes: dict,
                                                   fragment: str) -> None:
    folder = _edit(make_hf_model(tmp_path / architecture, architecture=architecture), **changes)
    with pytest.raises(ModelLoadError, match=re.escape(f"config.json: field {fragment}")):
        load_model(folder)


def _folder_as_transformers_derives(tmp_path: Path, architecture: str, heads: int, **fields: object) -> Path:
    """A tiny folder of ``heads`` heads whose head size and KV head count are what transformers' config of this
    family makes of ``fields`` (None: a null field) and the rest of its defaults."""
    transformers = pytest.importorskip("transformers")
    sizes = {"hidden_size": 64, "num_attention_heads": heads}
    hf = transformers.AutoConfig.for_model(ARCHITECTURES[architecture].hf_model_types[0], **sizes, **fields)
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    return make_hf_model(tmp_path / architecture, architecture=architecture, **sizes, head_dim=head_dim,
                         num_key_value_heads=hf.num_key_value_heads)


LEFT_OUT = ("head_dim", "num_key_value_heads", "rms_norm_eps", "tie_word_embeddings", "max_position_embeddings",
            "rope_theta", "rope_parameters", "sliding_window", "query_pre_attn_scalar", "attn_logit_softcapping",
            "final_logit_softcapping")
"""The config.json fields Pie reads whose absence means a default."""


@pytest.mark.parametrize("architecture", list(ARCHITECTURES))
def test_fields_left_out_of_config_json_mean_what_transformers_takes_them_to(tmp_path: Path, architecture: str) -> None:
    """Each family's transformers config has its own defaults (Qwen3's heads of 128, Gemma's of 256 with 4 KV heads,
    its head tied, query scalar 256 and soft-caps, Qwen's 32 and Mistral's 8 KV heads, Mistral's window of 4096,
    Phi-3's epsilon of 1e-5, each family's context length and rope bases); a config.json that leaves a field out
    means that, for the weights transformers writes under it."""
    transformers = pytest.importorskip("transformers")
    folder = _folder_as_transformers_derives(tmp_path, architecture, heads=32)  # Qwen's 32 KV heads divide them
    path = folder / "config.json"
    path.write_text(json.dumps({k: v for k, v in json.loads(path.read_text()).items() if k not in LEFT_OUT}))
    hf = transformers.AutoConfig.from_pretrained(folder)
    config = load_model(folder).config
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    assert (config.head_dim, config.num_kv_heads) == (head_dim, hf.num_key_value_heads)
    assert (config.rms_norm_eps, config.tie_word_embeddings) == (hf.rms_norm_eps, hf.tie_word_embeddings)
    assert config.max_position_embeddings == hf.max_position_embeddings
    rope = hf.rope_parameters
    assert config.rope_theta == rope.get("full_attention", rope)["rope_theta"]
    if "sliding_attention" in rope:
        assert config.rope_local_theta == rope["sliding_attention"]["rope_theta"]
    window = getattr(hf, "sliding_window", None) if getattr(hf, "use_sliding_window", True) else None
    assert max(config.layer_windows, default=0) == (window or 0)
    assert config.query_pre_attn_scalar == getattr(hf, "query_pre_attn_scalar", None)
    assert config.final_softcap == (getattr(hf, "final_logit_softcapping", None) or 0.0)
    if architecture == "gemma2":  # transformers caps no other family's attention scores
        assert config.attn_softcap == hf.attn_logit_softcapping


@pytest.mark.parametrize("field", ["head_dim", "num_key_value_heads"])
@pytest.mark.parametrize("architecture", list(ARCHITECTURES))
def test_a_null_head_size_or_kv_head_count_is_derived_as_transformers_derives_it(
    tmp_path: Path, architecture: str, field: str
) -> None:
    """Null is not left out: Qwen's config makes 32 KV heads of a file without the field, but as many as there are
    heads of a null one (as Llama's does of both). Where transformers refuses a null field, Pie derives it too."""
    transformers = pytest.importorskip("transformers")
    try:
        transformers.AutoConfig.for_model(ARCHITECTURES[architecture].hf_model_types[0], **{field: None})
    except Exception:  # noqa: BLE001 (strict validation: transformers takes no null here)
        # Pie derives it as for a family that takes the null: the head size from the hidden size, a KV head a head.
        folder = _folder_as_transformers_derives(tmp_path, architecture, heads=8, head_dim=8, num_key_value_heads=8)
        hf = transformers.AutoConfig.from_pretrained(folder)
        config = load_model(_edit(folder, **{field: None})).config
        derived = (hf.hidden_size // hf.num_attention_heads, hf.num_attention_heads)
        assert derived == (8, 8) and (config.head_dim, config.num_kv_heads) == derived
        return
    fields = {"head_dim": 8, "num_key_value_heads": 4, field: None}
    folder = _edit(_folder_as_transformers_derives(tmp_path, architecture, heads=8, **fields), **{field: None})
    hf = transformers.AutoConfig.from_pretrained(folder)
    config = load_model(folder).config
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    assert (config.head_dim, config.num_kv_heads) == (head_dim, hf.num_key_value_heads)


@pytest.mark.parametrize("architecture", ["llama", "qwen2", "phi3"])
def test_rope_parameters_rope_theta_wins_over_the_top_level_field(tmp_path: Path, architecture: str) -> None:
    """transformers takes a top-level ``rope_theta`` only where ``rope_parameters`` holds none."""
    transformers = pytest.importorskip("transformers")
    folder = _edit(make_hf_model(tmp_path / architecture, architecture=architecture),
                   rope_theta=10_000.0, rope_parameters={"rope_type": "default", "rope_theta": 500_000.0})
    hf = transformers.AutoConfig.from_pretrained(folder)
    assert load_model(folder).config.rope_theta == hf.rope_parameters["rope_theta"] == 500_000.0


def test_a_gemma3_layer_kind_with_null_rope_parameters_has_default_rope(tmp_path: Path) -> None:
    """transformers gives a layer kind whose rope_parameters are null default rope of the top-level base (Pie
    refused the file)."""
    transformers = pytest.importorskip("transformers")
    folder = _edit(make_hf_model(tmp_path / "gemma3", architecture="gemma3"), rope_theta=500_000.0, rope_parameters={
        "full_attention": None, "sliding_attention": {"rope_type": "default", "rope_theta": 20_000.0}})
    rope = transformers.AutoConfig.from_pretrained(folder).rope_parameters
    config = load_model(folder).config
    assert (config.rope_theta, config.rope_local_theta) == (rope["full_attention"]["rope_theta"], 20_000.0)
    assert config.rope_theta == 500_000.0


@pytest.mark.parametrize("architecture", ["gemma2", "gemma3"])
def test_gemma_reads_its_activation_from_hidden_activation_only(tmp_path: Path, architecture: str) -> None:
    """transformers' Gemma 2/3 MLP is ``hidden_activation``'s (tanh GELU where left out); ``hidden_act`` means
    nothing to it."""
    transformers = pytest.importorskip("transformers")
    folder = make_hf_model(tmp_path / architecture, architecture=architecture)
    path = folder / "config.json"
    data = {k: v for k, v in json.loads(path.read_text()).items() if k != "hidden_activation"}
    path.write_text(json.dumps({**data, "hidden_act": "gelu"}))
    assert transformers.AutoConfig.from_pretrained(folder).hidden_activation == "gelu_pytorch_tanh"
    assert build_decoder_graph(load_model(folder).config).layers["L0"].activation == "gelu_tanh"


@pytest.mark.parametrize("changes", [
    {"use_sliding_window": True, "sliding_window": TINY_WINDOW, "max_window_layers": 1},
    {"use_sliding_window": True, "max_window_layers": 0},  # transformers' window of 4096
    {"use_sliding_window": True, "sliding_window": TINY_WINDOW},  # from layer 28 on: none of 2
    {"use_sliding_window": True, "sliding_window": TINY_WINDOW, "layer_types": ["sliding_attention", "full_attention"]},
    {"use_sliding_window": False, "sliding_window": TINY_WINDOW, "max_window_layers": 0,
     "layer_types": ["sliding_attention", "sliding_attention"]},
    {"use_sliding_window": True, "sliding_window": None, "max_window_layers": 0},
])
@pytest.mark.parametrize("architecture", ["qwen2", "qwen3"])
def test_qwen_layers_slide_where_transformers_slides_them(tmp_path: Path, architecture: str, changes: dict) -> None:
    """Qwen2 and Qwen3 slide only with ``use_sliding_window``, on the layers ``layer_types`` names, else on those
    from ``max_window_layers`` (28) on: Pie refused every file with ``use_sliding_window``, which transformers runs."""
    transformers = pytest.importorskip("transformers")
    folder = make_hf_model(tmp_path / architecture, architecture=architecture)
    path = folder / "config.json"
    data = {k: v for k, v in json.loads(path.read_text()).items()
            if k not in ("use_sliding_window", "sliding_window", "max_window_layers", "layer_types")}
    path.write_text(json.dumps({**data, **changes}))
    hf = transformers.AutoConfig.from_pretrained(folder)
    expected = tuple((hf.sliding_window or 0) if t == "sliding_attention" else 0 for t in hf.layer_types)
    config = load_model(folder).config
    assert (config.layer_windows or (0,) * config.num_layers) == expected
    assert build_decoder_graph(config).layers["L1"].window == expected[1]


def test_an_unknown_model_type_lists_every_supported_one(tmp_path: Path) -> None:
    folder = _edit(make_hf_model(tmp_path / "m"), model_type="mamba")
    with pytest.raises(ModelLoadError, match="'model_type' is 'mamba'; supported: 'llama', 'qwen2', 'qwen3'"):
        load_model(folder)


def test_a_phi3_gguf_file_reads_its_fused_tensors(tmp_path: Path) -> None:
    path = make_gguf_model(tmp_path / "phi3.gguf", architecture="phi3")
    loaded = load_model(path)
    assert loaded.config.architecture == "phi3"
    expected = random_weights(tiny_config("phi3"))
    for name, array in loaded.tensors():
        np.testing.assert_array_equal(array, expected[name], err_msg=name)
    assert weight_shapes(loaded.config)["model.layers.0.self_attn.qkv_proj.weight"] == (64 + 2 * 32, 64)


def test_gemma_norm_offsets_are_folded_at_load() -> None:
    config = tiny_config("gemma2")
    weights = random_weights(config)
    poem = dict(architecture_of(config).poem_weights(config, weights.items()))
    np.testing.assert_array_equal(poem["w.L0.ln1"], weights["model.layers.0.input_layernorm.weight"] + 1)
    np.testing.assert_array_equal(poem["w.L1.ln2_post"], weights["model.layers.1.post_feedforward_layernorm.weight"] + 1)
    np.testing.assert_array_equal(poem["w.norm"], weights["model.norm.weight"] + 1)
    assert poem["w.L0.gate_up"].shape == (2 * config.intermediate_size, config.hidden_size)


def test_each_layer_describes_its_options_and_the_graph_keeps_the_description() -> None:
    config = tiny_config("gemma3", num_layers=3)
    graph = build_decoder_graph(config)
    layers = [graph.layers[f"L{i}"] for i in range(3)]
    assert [layer.window for layer in layers] == [TINY_WINDOW, 0, TINY_WINDOW]
    assert [layer.inv_freq for layer in layers] == ["w.inv_freq_local", "w.inv_freq", "w.inv_freq_local"]
    first = layers[0]
    assert first.qk_norm and first.post_norms and first.activation == "gelu_tanh" and not first.softcap
    assert first.scale == 24.0**-0.5 and first.weight("q_norm") == "w.L0.q_norm" and first.weight("qkv_bias") is None
    attention = [op for op in graph.ops if op.kind == "attention"]
    assert [op.option_dict.get("window") for op in attention] == [TINY_WINDOW, None, TINY_WINDOW], "only when set"
    gemma2 = build_decoder_graph(tiny_config("gemma2")).layers["L1"]
    assert (gemma2.softcap, gemma2.window, gemma2.qk_norm) == (2.0, 0, False)
    llama = build_decoder_graph(tiny_config("llama", attention_bias=True)).layers["L0"]
    assert llama.weight("o_bias") == "w.L0.o_bias" and not (llama.qk_norm or llama.post_norms or llama.window)


def test_tuning_sites_follow_the_graph_of_the_architecture() -> None:
    llama = {(s.kernel, s.label): s for s in sites(Dims(64, 128, 4, 2, 16, 400))}
    assert llama[("linear", "qkv")].shape == (128, 64) and llama[("linear", "lm_head")].max_rows == 64
    assert llama[("rms_norm_gate_up_silu", "gate_up")].shape == (256, 64)
    assert ("attention", DECODE_ATTENTION) in llama and ("rms_norm_heads", "q_normed") not in llama
    qwen3 = {(s.kernel, s.label): s for s in sites(Dims(64, 128, 4, 2, 16, 400, architecture="qwen3"))}
    assert qwen3[("rms_norm_heads", "q_normed")].shape == (64,) and qwen3[("rms_norm_heads", "k_normed")].shape == (32,)


@pytest.mark.parametrize("architecture", ["gemma2", "gemma3", "mistral"])
def test_the_test_gguf_writer_refuses_the_families_whose_files_it_cannot_write_as_llama_cpp(
    tmp_path: Path, architecture: str
) -> None:
    with pytest.raises(ValueError, match=f"not '{architecture}'"):
        make_gguf_model(tmp_path / "m.gguf", architecture=architecture)
    assert not (tmp_path / "m.gguf").exists()
