"""The real default model, pulled through the store and checked against transformers' own GGUF loader."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pie.model import load_model
from pie.model.store import DEFAULT_MODEL, KNOWN_MODELS

pytestmark = pytest.mark.slow


def test_pulled_file_is_the_recorded_one(smollm2: Path) -> None:
    known = KNOWN_MODELS[DEFAULT_MODEL]
    assert smollm2.name == known.filename and smollm2.stat().st_size == known.size


def test_config_and_tokenizer(smollm2: Path) -> None:
    loaded = load_model(smollm2)
    config = loaded.config
    assert (config.architecture, config.num_layers, config.hidden_size, config.intermediate_size) == ("llama", 30, 576, 1536)
    assert (config.num_heads, config.num_kv_heads, config.head_dim, config.vocab_size) == (9, 3, 64, 49152)
    assert config.tie_word_embeddings and config.rope_theta == 100000.0 and config.rms_norm_eps == 1e-5
    assert (config.bos_token_id, config.eos_token_ids) == (1, (2,))
    tokenizer = loaded.tokenizer
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert prompt.startswith("<|im_start|>system\n") and prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    ids = tokenizer.encode(prompt)
    assert ids[0] == 1 and tokenizer.decode(ids, skip_special_tokens=False) == prompt
    assert tokenizer.encode("2024") == [tokenizer.token_to_id(d) for d in "2024"]  # smollm splits digits


def test_tensors_equal_transformers(smollm2: Path, smollm2_transformers: Any) -> None:
    from transformers import AutoTokenizer

    reference = smollm2_transformers.state_dict()
    loaded = load_model(smollm2)
    names = set()
    for name, array in loaded.tensors():
        names.add(name)
        np.testing.assert_array_equal(array, reference[name].numpy(), err_msg=name)
    assert names == set(reference) - {"lm_head.weight"}  # tied: transformers lists the shared tensor twice

    hf_tokenizer = AutoTokenizer.from_pretrained(smollm2.parent, gguf_file=smollm2.name)
    for text in ["Hello, world!", "The café’s crème brûlée costs 12 euros.", "def f(x):\n    return x * 2", "日本語 😀"]:
        assert loaded.tokenizer.encode(text) == hf_tokenizer(text).input_ids, text
