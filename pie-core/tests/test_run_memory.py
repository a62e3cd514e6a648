"""What a loaded model holds (weights, KV cache) as `pie run --verbose` and `pie bench` print it, and
`pie run`'s KV cache sized to its one sequence."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

from pie import bench
from pie.cli import app
from pie.model import load_model, weight_shapes
from pie.model.gguf_header import GGUFHeader
from pie.models import ARCHITECTURES
from pie.plugins import Device
from pie.runtime.llm import LLM, encode_prompt
from pie.testing.models import make_gguf_model, make_hf_model
from pie.weights import StoredWeight

runner = CliRunner()


@pytest.fixture(scope="module")
def q8_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_gguf_model(tmp_path_factory.mktemp("q8") / "tiny.gguf", "Q8_0", tie_word_embeddings=True)


def _file_weight_bytes(path: Path) -> int:
    return sum(tensor.nbytes for tensor in GGUFHeader(path).tensors.values())


def test_the_weight_bytes_are_what_the_engine_was_given_and_the_files_own(q8_model: Path, monkeypatch) -> None:
    uploaded: list[Any] = []
    upload = Device.upload_weights

    def recording(self: Device, arrays: Any) -> list[Any]:
        tensors = upload(self, arrays)
        uploaded.extend(tensors)
        return tensors

    monkeypatch.setattr(Device, "upload_weights", recording)
    llm = LLM.load(str(q8_model), "cpu", max_cached_tokens=64)
    assert llm.memory is not None
    held = sum(t.nbytes if isinstance(t, StoredWeight) else np.asarray(t).nbytes for t in uploaded)
    assert llm.memory.weight_bytes == held
    # On the CPU engine every weight stays as the file stores it: the same bytes, the tied head once.
    assert llm.memory.loaded_weight_bytes == _file_weight_bytes(q8_model)
    assert abs(llm.memory.weight_bytes - _file_weight_bytes(q8_model)) <= 0.05 * _file_weight_bytes(q8_model)
    layout = llm.runner.layout
    assert llm.memory.kv_tokens == 64 and llm.memory.kv_bytes == layout.num_pages * layout.page_bytes
    assert llm.memory.kv_bytes == 2 * layout.num_layers * 64 * layout.num_kv_heads * layout.head_dim * 4


@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
def test_every_architecture_loads_and_counts_its_weights(architecture: str, tmp_path: Path) -> None:
    """Counting the weights named them by a table of Llama's own names: Qwen3 (q/k norms) and Phi-3 (fused QKV)
    failed every load with an internal error (KeyError), in `pie run`, `pie serve` and `pie bench` alike."""
    model = make_hf_model(tmp_path / architecture, architecture=architecture)
    llm = LLM.load(str(model), "cpu", max_cached_tokens=64)
    assert llm.runner.config.architecture == architecture and llm.memory is not None
    stored = sum(int(np.prod(shape)) for shape in weight_shapes(llm.runner.config).values()) * 4
    assert llm.memory.weight_bytes == llm.memory.loaded_weight_bytes == stored, "float32, each weight once"
    assert len(list(llm.generate("Hi", max_tokens=3))) >= 1


def test_a_converted_weight_counts_in_its_new_type(q8_model: Path, monkeypatch) -> None:
    monkeypatch.setattr(Device, "weight_types", lambda self: {})  # an engine whose kernels take float32 only
    llm = LLM.load(str(q8_model), "cpu", max_cached_tokens=16)
    assert llm.memory is not None and any(c.converted for c in llm.runner.weight_choices.values())
    config = llm.runner.config
    # Every matrix as float32; the tied LM head is the embedding's float32 copy, uploaded once.
    elements = sum(int(np.prod(shape)) for shape in weight_shapes(config).values())
    assert llm.memory.weight_bytes == 4 * elements


def test_pie_run_sizes_the_kv_cache_to_its_prompt_and_max_tokens(q8_model: Path) -> None:
    asked: list[Any] = []

    def needs(tokenizer: Any) -> int:
        asked.append(tokenizer)
        return 40

    llm = LLM.load(str(q8_model), "cpu", sequence_tokens=needs)
    assert len(asked) == 1 and asked[0] is llm.tokenizer
    assert 40 <= llm.kv_capacity_tokens < 40 + llm.runner.page_size
    whole = LLM.load(str(q8_model), "cpu")
    assert whole.kv_capacity_tokens == whole.context_length


def test_pie_run_verbose_prints_the_weight_and_kv_memory(q8_model: Path) -> None:
    args = ["run", "Hello", "--model", str(q8_model), "--engine", "cpu", "--max-tokens", "3"]
    quiet = runner.invoke(app, args)
    assert quiet.exit_code == 0, quiet.output
    assert "memory:" not in quiet.output
    result = runner.invoke(app, [*args, "--verbose"])
    assert result.exit_code == 0, result.output
    megabytes = f"{_file_weight_bytes(q8_model) / 1e6:.1f} MB"
    assert f"memory: weights {megabytes} ({megabytes} in the model's files); KV cache" in result.output
    # The KV cache holds the prompt and the three tokens asked for, in whole pages of 16 tokens.
    needed = len(encode_prompt(load_model(q8_model).tokenizer, "Hello", chat=True)) + 3
    assert f"({-(-needed // 16) * 16} tokens of float32)" in result.output


def test_pie_run_verbose_is_refused_with_an_inferlet(tmp_path: Path) -> None:
    result = runner.invoke(app, ["run", "--inferlet", str(tmp_path / "x.py"), "--verbose"])
    assert result.exit_code == 2 and "--verbose" in result.output


def test_pie_bench_reports_the_weight_and_kv_memory(q8_model: Path, monkeypatch) -> None:
    monkeypatch.setattr(bench, "measure_bandwidth", lambda device: 1e9)
    monkeypatch.setattr(bench, "paired_decode", lambda llm, prompt, tokens, read: ([0.01] * tokens, [1e9] * tokens))
    report = bench.run_bench(str(q8_model), "cpu", prompt_tokens=4, decode_tokens=2, runs=1, concurrency=1)
    assert report["weight_bytes"] == report["loaded_weight_bytes"] == _file_weight_bytes(q8_model)
    assert report["kv_cache_tokens"] == 2048 and report["kv_cache_bytes"] > 0
    assert f"memory: weights {_file_weight_bytes(q8_model) / 1e6:.1f} MB" in report["text"]
