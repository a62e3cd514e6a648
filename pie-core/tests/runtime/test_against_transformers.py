"""Logits and greedy tokens against transformers (torch CPU) on the same weights."""

from __future__ import annotations

import json

import numpy as np
import pytest
from pie.model.loader import load_model
from pie.plugins import EngineRegistry
from pie.runtime.model_runner import ModelRunner, SequenceWork
from pie.testing.models import make_hf_model

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

CONFIGS = {
    "llama-gqa": dict(architecture="llama"),
    "llama-tied-llama3-rope": dict(
        architecture="llama",
        tie_word_embeddings=True,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        rope_theta=500000.0,
    ),
    "qwen2-qkv-bias": dict(architecture="qwen2"),
    "llama-mha-all-bias": dict(architecture="llama", attention_bias=True, num_key_value_heads=4),
    "phi3-fused-qkv-gate-up": dict(architecture="phi3"),
    "phi3-tied-mha": dict(architecture="phi3", tie_word_embeddings=True, num_key_value_heads=4),
    "qwen2-window-5-from-layer-1": dict(architecture="qwen2", use_sliding_window=True, sliding_window=5,
                                        max_window_layers=1),
    "qwen3-qk-norm": dict(architecture="qwen3"),
    "qwen3-window-5-by-layer-types": dict(architecture="qwen3", use_sliding_window=True, sliding_window=5,
                                          layer_types=["sliding_attention", "full_attention"]),
    "qwen3-tied-biased": dict(architecture="qwen3", tie_word_embeddings=True, attention_bias=True),
    "mistral-window-5": dict(architecture="mistral"),
    "gemma2-softcaps-alternating-windows": dict(architecture="gemma2"),
    "gemma2-tied-mha": dict(architecture="gemma2", tie_word_embeddings=True, num_key_value_heads=4),
    "gemma3-qk-norm-two-rope-bases": dict(architecture="gemma3", num_hidden_layers=3,
                                          layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    "gemma3-tied": dict(architecture="gemma3", tie_word_embeddings=True),
    "gemma3-final-softcap": dict(architecture="gemma3", final_logit_softcapping=3.0),
}
"""Each architecture (`pie.models`): GQA and MHA, tied and untied heads, sliding windows (`TINY_WINDOW`, 5)
shorter than the prompt, soft-capped logits."""


@pytest.fixture(scope="module")
def cpu():
    return EngineRegistry().select("cpu")[0]


PROMPT = "The quick brown fox jumps over the lazy dog."


def _assert_prefill_matches(loaded, reference, cpu) -> None:
    """The logits after PROMPT's prefill (on 4-token pages) are ``reference``'s within 1e-4."""
    runner = ModelRunner(loaded.config, loaded.tensors(), cpu, page_size=4, max_cached_tokens=128)
    prompt = loaded.tokenizer.encode(PROMPT)
    logits = runner.step([SequenceWork(runner.new_sequence(), prompt)])[0]
    with torch.no_grad():
        expected = reference(torch.tensor([prompt])).logits[0, -1].numpy()
    np.testing.assert_allclose(logits, expected, rtol=0, atol=1e-4)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_match_transformers_through_prefill_and_32_decode_steps(tmp_path, cpu, name: str) -> None:
    folder = make_hf_model(tmp_path / name, **CONFIGS[name])
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    loaded = load_model(folder)
    runner = ModelRunner(loaded.config, loaded.tensors(), cpu, page_size=4, max_cached_tokens=128)
    prompt = loaded.tokenizer.encode(PROMPT)
    assert len(prompt) > 2 * runner.page_size, "the prompt must span several pages"
    sequence = runner.new_sequence()
    tokens = list(prompt)
    logits = runner.step([SequenceWork(sequence, prompt)])[0]
    for step in range(33):
        with torch.no_grad():
            expected = reference(torch.tensor([tokens])).logits[0, -1].numpy()
        np.testing.assert_allclose(logits, expected, rtol=0, atol=1e-4, err_msg=f"{name}, step {step}")
        token = int(np.argmax(logits))
        assert token == int(np.argmax(expected))
        tokens.append(token)
        logits = runner.step([SequenceWork(sequence, [token])])[0]
    assert len(sequence.pages) == -(-sequence.length // runner.page_size)
    sequence.free()
    assert runner.pages.used_count == 0


@pytest.mark.parametrize("architecture", ["gemma2", "gemma3"])
def test_gemma_fields_left_out_of_config_json_mean_what_transformers_takes(tmp_path, cpu, architecture: str) -> None:
    """transformers saves a tied Gemma's config.json without ``tie_word_embeddings``, and Gemma's defaults for the
    query scalar, window and soft-caps are not another family's: a field left out means transformers' default."""
    folder = make_hf_model(tmp_path / architecture, architecture=architecture, tie_word_embeddings=True)
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())
    for name in ("tie_word_embeddings", "query_pre_attn_scalar", "sliding_window", "attn_logit_softcapping",
                 "final_logit_softcapping"):
        config.pop(name, None)
    config_path.write_text(json.dumps(config))
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    loaded = load_model(folder)
    assert set(loaded.config.layer_windows) == {4096, 0}
    _assert_prefill_matches(loaded, reference, cpu)


def test_ragged_batch_equals_sequences_run_alone(tmp_path, cpu) -> None:
    folder = make_hf_model(tmp_path / "m")
    loaded = load_model(folder)
    runner = ModelRunner(loaded.config, loaded.tensors(), cpu, page_size=4, max_cached_tokens=256)
    rng = np.random.default_rng(1)
    prompts = [list(rng.integers(3, 300, n)) for n in (9, 1, 5)]
    alone = []
    for prompt in prompts:
        sequence = runner.new_sequence()
        alone.append(runner.step([SequenceWork(sequence, prompt)])[0])
        sequence.free()
    sequences = [runner.new_sequence() for _ in prompts]
    together = runner.step([SequenceWork(s, p) for s, p in zip(sequences, prompts, strict=True)])
    np.testing.assert_allclose(together, np.stack(alone), atol=1e-5)


@pytest.mark.slow
def test_smollm2_gguf_greedy_tokens_match_transformers_for_64_tokens(cpu, smollm2, smollm2_transformers) -> None:
    reference = smollm2_transformers
    loaded = load_model(smollm2)
    runner = ModelRunner(loaded.config, loaded.tensors(), cpu, page_size=16, max_cached_tokens=256)
    text = loaded.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    prompt = loaded.tokenizer.encode(text, add_special_tokens=False)
    with torch.no_grad():
        expected = reference.generate(torch.tensor([prompt]), max_new_tokens=64, min_new_tokens=64, do_sample=False)[
            0, len(prompt) :
        ].tolist()
    sequence = runner.new_sequence()
    logits = runner.step([SequenceWork(sequence, prompt)])[0]
    got = []
    for _ in range(64):
        logits[list(loaded.config.eos_token_ids)] = -np.inf  # as min_new_tokens does in transformers
        token = int(np.argmax(logits))
        got.append(token)
        logits = runner.step([SequenceWork(sequence, [token])])[0]
    assert got == expected


@pytest.mark.parametrize(("architecture", "overrides"), [("qwen3", {"head_dim": 16}), ("phi3", {"pad_token_id": 2})])
def test_gguf_files_of_each_architecture_give_the_logits_transformers_reads_from_them(
    tmp_path, cpu, architecture: str, overrides: dict
) -> None:
    """Our writer uses llama.cpp's tensor names (fused ``attn_qkv`` and ``ffn_up`` for Phi-3, ``attn_q_norm``
    for Qwen3); transformers' own GGUF reader maps them back. ``overrides`` are what its reader does not
    take from the file's metadata."""
    from pie.testing.models import make_gguf_model

    path = make_gguf_model(tmp_path / f"{architecture}.gguf", architecture=architecture)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=path.name, dtype=torch.float32, **overrides
    ).eval()
    loaded = load_model(path)
    assert loaded.config.architecture == architecture
    _assert_prefill_matches(loaded, reference, cpu)
