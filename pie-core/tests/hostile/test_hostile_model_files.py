"""Hostile model files: claimed sizes, contradictions, damage and bad text, through the real `pie`.

Every case must end in a clear error naming the file and the field or tensor, within bounded time,
and (where the file claims sizes) bounded memory: nothing is built from a claim before the tensors
present back it.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from pie.testing.models import make_gguf_model, make_hf_model, rewrite_gguf
from memory_bound import max_rss_mb
from pie_process import assert_ok, assert_user_error, run_pie

MAX_RSS_MB = 600
"""What `pie` may grow by, in MB, while it refuses a file that claims sizes."""
MAX_SECONDS = 60


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("transformers")
    return make_hf_model(tmp_path_factory.mktemp("hf") / "model")


@pytest.fixture(scope="module")
def gguf_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_gguf_model(tmp_path_factory.mktemp("gguf") / "tiny.gguf", "F32")


def _hf_copy(source: Path, target: Path, **config: object) -> Path:
    folder = Path(shutil.copytree(source, target))
    data = json.loads((folder / "config.json").read_text())
    data.update(config)
    (folder / "config.json").write_text(json.dumps(data))
    return folder


def _patched(source: Path, target: Path, after: bytes, skip: int, layout: str, value: int) -> Path:
    data = bytearray(source.read_bytes())
    struct.pack_into(layout, data, data.index(after) + len(after) + skip, value)
    target.write_bytes(bytes(data))
    return target


def test_the_model_files_used_here_work(pie_env: dict[str, str], hf_model: Path, gguf_model: Path) -> None:
    for model in (hf_model, gguf_model):
        assert_ok(run_pie("run", "--model", str(model), "--max-tokens", "2", "hi", env=pie_env),
                  max_seconds=MAX_SECONDS)


@pytest.mark.parametrize("config,needles", [
    ({"num_hidden_layers": 10**7}, ["'num_hidden_layers' is 10000000", "tensors for 2 layers"]),
    ({"num_hidden_layers": 0}, ["'num_hidden_layers' must be an integer from 1"]),
    ({"num_hidden_layers": -3}, ["'num_hidden_layers' must be an integer from 1", "got -3"]),
    ({"num_hidden_layers": 2.5}, ["'num_hidden_layers' has invalid value 2.5"]),
    ({"hidden_size": 10**12}, ["'hidden_size' must be an integer from 1 to 2147483647"]),
    ({"vocab_size": 10**9}, ["has shape [400, 64], expected [1000000000, 64]", "[vocab_size, hidden_size]"]),
    ({"intermediate_size": 10**9}, ["mlp.down_proj.weight' has shape [64, 128], expected [64, 1000000000]", "[hidden_size, intermediate_size]"]),
    ({"max_position_embeddings": 10**15}, ["'max_position_embeddings' must be an integer from 1"]),
    ({"num_attention_heads": 5, "head_dim": None}, ["'hidden_size' (64) is not a multiple of 'num_attention_heads' (5)"]),
    ({"num_key_value_heads": 3}, ["'num_attention_heads' (4) is not a multiple of 'num_key_value_heads' (3)"]),
    ({"head_dim": 32}, ["has shape [32, 64], expected [64, 64]", "num_key_value_heads × head_dim"]),
    ({"rms_norm_eps": -1.0}, ["'rms_norm_eps' must be a positive number"]),
    ({"bos_token_id": 10**9}, ["'bos_token_id' is 1000000000, outside the vocabulary"]),
], ids=lambda value: "-".join(f"{k}={v}" for k, v in value.items()) if isinstance(value, dict) else None)
def test_hugging_face_config_that_lies(pie_env: dict[str, str], hf_model: Path, tmp_path: Path, config: dict,
                                       needles: list[str]) -> None:
    folder = _hf_copy(hf_model, tmp_path / "model", **config)
    result = run_pie("run", "--model", str(folder), "hi", env=pie_env, timeout=MAX_SECONDS * 2)
    assert_user_error(result, str(folder), *needles, max_seconds=MAX_SECONDS, max_rss_mb=max_rss_mb(MAX_RSS_MB))


def test_a_tokenizer_larger_than_the_vocabulary(pie_env: dict[str, str], tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    folder = make_hf_model(tmp_path / "model", vocab_size=300)
    assert_user_error(run_pie("plan", str(folder), env=pie_env), "tokenizer.json", "token ids up to 399",
                      "config.json: 'vocab_size') is 300", max_seconds=MAX_SECONDS)


def _truncate_weights(folder: Path) -> None:
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])


def _fifo_config(folder: Path) -> None:
    (folder / "config.json").unlink()
    os.mkfifo(folder / "config.json")


def _binary_template(folder: Path) -> None:
    (folder / "chat_template.jinja").write_bytes(b"{{ bos_token }}\xc3\x28")


def _shard_outside(folder: Path) -> None:
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"model.norm.weight": "/etc/passwd"}}))


@pytest.mark.parametrize("damage,needles", [
    (_truncate_weights, ["model.safetensors", "not a readable safetensors file"]),
    (_fifo_config, ["config.json", "not a regular file"]),
    (_binary_template, ["chat_template.jinja", "not UTF-8 text"]),
    (_shard_outside, ["model.safetensors.index.json", "'/etc/passwd', not a file in this folder"]),
], ids=["truncated-safetensors", "config-is-a-fifo", "template-not-utf8", "shard-outside-the-folder"])
def test_damaged_hugging_face_folder(pie_env: dict[str, str], hf_model: Path, tmp_path: Path,
                                     damage: Callable[[Path], None], needles: list[str]) -> None:
    folder = _hf_copy(hf_model, tmp_path / "model")
    damage(folder)
    assert_user_error(run_pie("plan", str(folder), env=pie_env, timeout=MAX_SECONDS * 2), *needles,
                      max_seconds=MAX_SECONDS, max_rss_mb=max_rss_mb(MAX_RSS_MB))


@pytest.mark.parametrize("metadata,needles", [
    ({"llama.block_count": 10**6}, ["'llama.block_count' is 1000000", "tensors for 2 layers"]),
    ({"llama.block_count": 0}, ["'llama.block_count' must be an integer from 1"]),
    ({"llama.embedding_length": 10**9}, ["'token_embd.weight'", "expected [400, 1000000000]", "llama.embedding_length"]),
    ({"llama.context_length": 2**32 - 1}, ["'llama.context_length' must be an integer from 1 to 2147483647"]),
    ({"llama.attention.head_count": 0}, ["'llama.attention.head_count' must be an integer from 1"]),
    ({"llama.attention.head_count_kv": 3}, ["'llama.attention.head_count' (4) is not a multiple of "
                                            "'llama.attention.head_count_kv' (3)"]),
    ({"llama.vocab_size": 300}, ["'token_embd.weight' has shape [400, 64], expected [300, 64]"]),
], ids=lambda value: "-".join(f"{k}={v}" for k, v in value.items()) if isinstance(value, dict) else None)
def test_gguf_metadata_that_lies(pie_env: dict[str, str], gguf_model: Path, tmp_path: Path, metadata: dict,
                                 needles: list[str]) -> None:
    target = rewrite_gguf(gguf_model, tmp_path / "lies.gguf", metadata=metadata)
    result = run_pie("run", "--model", str(target), "hi", env=pie_env, timeout=MAX_SECONDS * 2)
    assert_user_error(result, "lies.gguf", *needles, max_seconds=MAX_SECONDS, max_rss_mb=max_rss_mb(MAX_RSS_MB))


def test_gguf_tokenizer_larger_than_the_vocabulary(pie_env: dict[str, str], gguf_model: Path, tmp_path: Path) -> None:
    rows = np.zeros((300, 64), np.float32)
    target = rewrite_gguf(gguf_model, tmp_path / "m.gguf", metadata={"llama.vocab_size": 300},
                          tensors={"token_embd.weight": (rows, None), "output.weight": (rows, None)})
    assert_user_error(run_pie("run", "--model", str(target), "hi", env=pie_env), "m.gguf",
                      "'tokenizer.ggml.tokens' holds 400 tokens, but tensor 'token_embd.weight' has 300 rows",
                      max_seconds=MAX_SECONDS)


def test_gguf_tokenizer_claiming_millions_of_tokens(pie_env: dict[str, str], gguf_model: Path, tmp_path: Path) -> None:
    """Refused before any tokenizer is built from them."""
    tokens = [f"t{i}" for i in range(2_000_000)]
    target = rewrite_gguf(gguf_model, tmp_path / "m.gguf",
                          metadata={"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": [1] * len(tokens)})
    assert_user_error(run_pie("run", "--model", str(target), "hi", env=pie_env), "m.gguf",
                      "'tokenizer.ggml.tokens' holds 2000000 tokens, but tensor 'token_embd.weight' has 400 rows",
                      max_seconds=MAX_SECONDS, max_rss_mb=max_rss_mb(MAX_RSS_MB))


_OUTPUT = struct.pack("<Q", len("output.weight")) + b"output.weight"


@pytest.mark.parametrize("after,skip,layout,value,needles", [
    (b"GGUF", 0, "<I", 99, ["not a readable GGUF file", "version 99"]),
    (b"GGUF", 4, "<Q", 10**9, ["the tensor count is 1000000000"]),
    (b"GGUF", 12, "<Q", 10**15, ["the metadata key count is 1000000000000000"]),
    (b"tokenizer.ggml.tokens", 8, "<Q", 10**12, ["'tokenizer.ggml.tokens' claims 1000000000000 strings"]),
    (b"tokenizer.ggml.merges", 8, "<Q", 10**12, ["'tokenizer.ggml.merges' claims 1000000000000 strings"]),
    (b"tokenizer.ggml.token_type", 8, "<Q", 10**12, ["'tokenizer.ggml.token_type'", "runs past the end of the file"]),
    (b"tokenizer.ggml.tokens", 16, "<Q", 2**62, ["'tokenizer.ggml.tokens' entry 0 runs past the end"]),
    (_OUTPUT, 4, "<Q", 2**40, ["tensor 'output.weight' cannot be read", "truncated?"]),  # first dimension
    (_OUTPUT, 4 + 16 + 4, "<Q", 2**50, ["tensor 'output.weight' cannot be read: its data ends at byte"]),  # offset
    (b"blk.0.attn_q.weight", 0, "<I", 9, ["tensor 'blk.0.attn_q.weight' has 9 dimensions"]),
    (b"tokenizer.ggml.tokens", 0, "<I", 1234, ["'tokenizer.ggml.tokens' has unknown value type 1234"]),
], ids=["version", "tensor-count", "key-count", "tokens-count", "merges-count", "token-type-count", "string-length",
        "tensor-dimension", "tensor-offset", "tensor-rank", "value-type"])
def test_gguf_header_that_lies(pie_env: dict[str, str], gguf_model: Path, tmp_path: Path, after: bytes, skip: int,
                               layout: str, value: int, needles: list[str]) -> None:
    target = _patched(gguf_model, tmp_path / "bad.gguf", after, skip, layout, value)
    result = run_pie("run", "--model", str(target), "hi", env=pie_env, timeout=MAX_SECONDS * 2)
    assert_user_error(result, "bad.gguf", *needles, max_seconds=MAX_SECONDS, max_rss_mb=max_rss_mb(MAX_RSS_MB))


def _wrong_magic(source: Path, target: Path) -> None:
    target.write_bytes(b"GGML" + source.read_bytes()[4:])


def _truncated(source: Path, target: Path) -> None:
    target.write_bytes(source.read_bytes()[:-4096])


def _cut_in_the_header(source: Path, target: Path) -> None:
    target.write_bytes(source.read_bytes()[:3000])


def _not_utf8_key(source: Path, target: Path) -> None:
    _patched(source, target, b"llama.", 0, "<B", 0xFF)


def _not_utf8_token(source: Path, target: Path) -> None:
    _patched(source, target, b"<|endoftext|"[:-1], 0, "<B", 0xC3)


def _empty(source: Path, target: Path) -> None:
    target.write_bytes(b"")


@pytest.mark.parametrize("damage,needles", [
    (_wrong_magic, ["not a readable GGUF file: it starts with b'GGML', not b'GGUF'"]),
    (_truncated, ["tensor 'output.weight' cannot be read", "truncated?"]),
    (_cut_in_the_header, ["not a readable GGUF file", "truncated?"]),
    (_not_utf8_key, ["a metadata key at offset", "is not UTF-8"]),
    (_not_utf8_token, ["metadata key 'tokenizer.ggml.tokens' entry 0 is not UTF-8 text"]),
    (_empty, ["the file is 0 bytes, too short for a GGUF header"]),
], ids=["wrong-magic", "truncated", "cut-in-the-header", "key-not-utf8", "token-not-utf8", "empty"])
def test_damaged_gguf_file(pie_env: dict[str, str], gguf_model: Path, tmp_path: Path,
                           damage: Callable[[Path, Path], None], needles: list[str]) -> None:
    target = tmp_path / "bad.gguf"
    damage(gguf_model, target)
    assert_user_error(run_pie("plan", str(target), env=pie_env), "bad.gguf", *needles, max_seconds=MAX_SECONDS,
                      max_rss_mb=max_rss_mb(MAX_RSS_MB))


def test_a_model_path_that_is_a_device(pie_env: dict[str, str]) -> None:
    assert_user_error(run_pie("run", "--model", "/dev/zero", "hi", env=pie_env), "/dev/zero",
                      "neither a regular file nor a folder", max_seconds=MAX_SECONDS, max_rss_mb=max_rss_mb(MAX_RSS_MB))


@pytest.mark.parametrize("args", [("model", "import", "{folder}"), ("run", "--model", "{folder}", "hi")], ids=" ".join)
def test_a_folder_holding_a_gguf_file_says_to_pass_the_file(pie_env: dict[str, str], gguf_model: Path, tmp_path: Path,
                                                            args: tuple[str, ...]) -> None:
    """It said only '<folder>/config.json: file not found'."""
    folder = tmp_path / "downloads"
    folder.mkdir()
    shutil.copyfile(gguf_model, folder / "tiny.gguf")
    result = run_pie(*(arg.format(folder=folder) for arg in args), env=pie_env)
    assert_user_error(result, f"{folder}: a folder with no config.json", "it holds the GGUF file tiny.gguf: pass the "
                      f"file itself ({folder / 'tiny.gguf'})", max_seconds=MAX_SECONDS)
