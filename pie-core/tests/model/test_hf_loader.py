from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pie.model import Llama3RopeScaling, LoadedModel, ModelLoadError, load_model, weight_shapes
from pie.testing.models import BOS_TOKEN_ID, EOS_TOKEN_ID, make_hf_model

pytest.importorskip("transformers")


def _reference(directory: Path) -> dict[str, np.ndarray]:
    """transformers' own float32 state dict for the folder."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    return {name: tensor.numpy() for name, tensor in model.state_dict().items()}


def _assert_matches_transformers(loaded: LoadedModel, directory: Path) -> None:
    reference = _reference(directory)
    names = []
    for name, array in loaded.tensors():
        names.append(name)
        assert array.dtype == np.float32 and array.flags.c_contiguous and array.flags.writeable
        np.testing.assert_array_equal(array, reference[name], err_msg=name)
    assert names == list(weight_shapes(loaded.config))
    expected = {n for n in reference if not n.endswith("inv_freq")}
    if loaded.config.tie_word_embeddings:
        expected.discard("lm_head.weight")
    assert set(names) == expected


def test_single_file_untied(tiny_hf_model: Path) -> None:
    loaded = load_model(tiny_hf_model)
    config = loaded.config
    assert (config.architecture, config.vocab_size, config.hidden_size, config.intermediate_size) == ("llama", 400, 64, 128)
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (2, 4, 2, 16)
    assert not config.tie_word_embeddings and not config.attention_bias and config.rope_scaling is None
    assert (config.bos_token_id, config.eos_token_ids) == (BOS_TOKEN_ID, (EOS_TOKEN_ID,))
    assert loaded.source == str(tiny_hf_model)
    _assert_matches_transformers(loaded, tiny_hf_model)


def test_tensors_are_yielded_lazily(tiny_hf_model: Path) -> None:
    stream = load_model(tiny_hf_model).tensors()
    name, array = next(stream)
    assert name == "model.embed_tokens.weight" and array.shape == (400, 64)
    stream.close()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_sharded_half_precision_tied(tmp_path: Path, dtype: str) -> None:
    directory = make_hf_model(tmp_path, dtype=dtype, max_shard_size="60KB", tie_word_embeddings=True)
    assert (directory / "model.safetensors.index.json").exists()
    assert len(list(directory.glob("*.safetensors"))) > 2
    loaded = load_model(directory)
    assert loaded.config.tie_word_embeddings
    _assert_matches_transformers(loaded, directory)


def test_qwen2_qkv_bias(tmp_path: Path) -> None:
    directory = make_hf_model(tmp_path, architecture="qwen2")
    loaded = load_model(directory)
    assert loaded.config.architecture == "qwen2" and loaded.config.attention_bias
    assert "model.layers.1.self_attn.v_proj.bias" in weight_shapes(loaded.config)
    _assert_matches_transformers(loaded, directory)


def test_llama_attention_bias_covers_all_four_projections(tmp_path: Path) -> None:
    directory = make_hf_model(tmp_path, attention_bias=True)
    loaded = load_model(directory)
    assert loaded.config.attention_bias and "model.layers.0.self_attn.o_proj.bias" in weight_shapes(loaded.config)
    _assert_matches_transformers(loaded, directory)


def test_llama3_rope_scaling_and_eos_list(tmp_path: Path) -> None:
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 128}
    directory = make_hf_model(tmp_path, rope_parameters=rope, eos_token_id=[EOS_TOKEN_ID, 0])
    config = load_model(directory).config
    assert config.rope_theta == 500000.0
    assert config.rope_scaling == Llama3RopeScaling(8.0, 1.0, 4.0, 128)
    assert config.eos_token_ids == (EOS_TOKEN_ID, 0)


def test_llama3_rope_without_an_original_context_takes_max_position_embeddings(tmp_path: Path) -> None:
    """transformers gives Llama 3 scaling that states no ``original_max_position_embeddings`` the model's context."""
    from transformers import AutoConfig

    directory = make_hf_model(tmp_path)
    config_path = directory / "config.json"
    data = json.loads(config_path.read_text())
    data["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0}
    config_path.write_text(json.dumps(data))
    original = AutoConfig.from_pretrained(directory).rope_parameters["original_max_position_embeddings"]
    config = load_model(directory).config
    assert config.rope_scaling == Llama3RopeScaling(8.0, 1.0, 4.0, original)
    assert original == config.max_position_embeddings == 256


def test_rope_scaling_stands_in_for_rope_parameters_as_in_transformers(tmp_path: Path) -> None:
    """transformers reads a config.json's ``rope_scaling``, base included, in place of its ``rope_parameters``: Pie
    took rope_parameters' base, which transformers ignores, and now refuses rope_parameters that disagree."""
    from transformers import AutoConfig

    directory = make_hf_model(tmp_path)
    config_path = directory / "config.json"
    data = json.loads(config_path.read_text())
    data.update(rope_scaling={"rope_type": "default"}, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    config_path.write_text(json.dumps(data))
    assert AutoConfig.from_pretrained(directory).rope_parameters["rope_theta"] == 10000.0
    with pytest.raises(ModelLoadError, match=r"'rope_scaling' is \{'rope_type': 'default'\}, which rope_parameters"):
        load_model(directory)
    data["rope_scaling"]["rope_theta"] = 1e6
    config_path.write_text(json.dumps(data))
    expected = AutoConfig.from_pretrained(directory).rope_parameters["rope_theta"]
    assert load_model(directory).config.rope_theta == expected == 1e6


def test_legacy_rope_fields_and_generation_config(tmp_path: Path) -> None:
    """Configs written before transformers 5 keep `rope_theta` and `rope_scaling` apart."""
    directory = make_hf_model(tmp_path)
    config_path = directory / "config.json"
    data = json.loads(config_path.read_text())
    del data["rope_parameters"]
    data["rope_theta"] = 500000.0
    data["rope_scaling"] = {"type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 8192}
    config_path.write_text(json.dumps(data))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [EOS_TOKEN_ID, 1]}))
    config = load_model(directory).config
    assert config.rope_theta == 500000.0 and config.rope_scaling is not None and config.rope_scaling.factor == 32.0
    assert config.eos_token_ids == (EOS_TOKEN_ID, 1)


def test_chat_template_from_jinja_file(tmp_path: Path) -> None:
    directory = make_hf_model(tmp_path, template_file=True)
    tokenizer = load_model(directory).tokenizer
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<|endoftext|><|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
