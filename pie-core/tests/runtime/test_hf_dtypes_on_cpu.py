"""bf16/f16 Hugging Face folders on the CPU engine: the types reaching it, logits against the float32 copy and
transformers, and ``--dtype`` on `pie plan`, `pie run`, `pie bench` and `pie serve`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

from pie import bench
from pie.cli import app
from pie.model import load_model, weight_shapes
from pie.plugins import Device, EngineRegistry
from pie.runtime.llm import LLM
from pie.runtime.model_runner import ModelRunner, SequenceWork
from pie.testing.model_parity import greedy_tokens
from pie.testing.models import make_gguf_model, make_hf_model
from pie.weights import StoredWeight, weight_type

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

cli = CliRunner()
HALF = {"bfloat16": "bf16", "float16": "f16"}


@pytest.fixture(scope="module")
def cpu() -> Device:
    return EngineRegistry().select("cpu")[0]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The same random Llama (seed 0) stored in float32, bfloat16 and float16."""
    root = tmp_path_factory.mktemp("dtypes")
    return {dtype: make_hf_model(root / dtype, dtype=dtype) for dtype in ("float32", *HALF)}


def _taken(device: Device, weight_type_name: str) -> str:
    """The type the CPU engine's projections get a weight stored as ``weight_type_name`` in."""
    return weight_type_name if weight_type_name in device.weight_types().get("linear", ()) else "f32"


def _recorded_uploads(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    uploaded: list[Any] = []
    upload = Device.upload_weights

    def recording(self: Device, weights: Any) -> list[Any]:
        uploaded.extend(weights)
        return upload(self, weights)

    monkeypatch.setattr(Device, "upload_weights", recording)
    return uploaded


@pytest.mark.parametrize("dtype", sorted(HALF))
def test_the_engine_gets_the_matrices_in_the_stored_type_where_it_takes_it(
    folders: dict[str, Path], cpu: Device, dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if "f16" not in cpu.weight_types().get("linear", ()):
        pytest.skip("the CPU engine's native kernels do not build here")
    uploaded = _recorded_uploads(monkeypatch)
    llm = LLM.load(str(folders[dtype]), "cpu", max_cached_tokens=32)
    want = _taken(llm.device, HALF[dtype])
    matrices = [c for c in llm.runner.weight_choices.values() if not c.name.endswith(("ln1", "ln2", "norm"))]
    assert {c.stored for c in matrices} == {HALF[dtype]}
    assert {c.uploaded for c in matrices} == {want}
    given = {weight_type(w) for w in uploaded if len(w.shape) == 2 and w.shape[0] > 1}
    assert given == {want}
    if want != "f32":
        assert all(isinstance(w, StoredWeight) for w in uploaded if len(w.shape) == 2 and w.shape[0] > 1)


def test_dtype_float16_on_a_float32_folder_gives_the_engine_float16(
    folders: dict[str, Path], cpu: Device, monkeypatch: pytest.MonkeyPatch
) -> None:
    if "f16" not in cpu.weight_types().get("linear", ()):
        pytest.skip("the CPU engine's native kernels do not build here")
    uploaded = _recorded_uploads(monkeypatch)
    llm = LLM.load(str(folders["float32"]), "cpu", max_cached_tokens=32, dtype="float16")
    assert {weight_type(w) for w in uploaded if isinstance(w, StoredWeight)} == {"f16"}
    assert sum(isinstance(w, StoredWeight) for w in uploaded) == 10  # embedding, head, per layer qkv, o, gate_up, down
    assert set(llm.dtype_conversions.values()) == {("f32", "f16")}
    assert len(llm.dtype_conversions) == sum(len(s) == 2 for s in weight_shapes(llm.runner.config).values())


def _logits_through_decode(runner: ModelRunner, prompt: list[int], tokens: list[int]) -> list[np.ndarray]:
    sequence = runner.new_sequence()
    rows = [runner.step([SequenceWork(sequence, prompt)])[0]]
    rows += [runner.step([SequenceWork(sequence, [token])])[0] for token in tokens]
    sequence.free()
    return rows


@pytest.mark.parametrize(("dtype", "architecture"), [("bfloat16", "llama"), ("float16", "llama"), ("float16", "qwen2")])
def test_logits_and_greedy_tokens_equal_the_float32_copy(folders: dict[str, Path], cpu: Device, dtype: str,
                                                         architecture: str, tmp_path: Path) -> None:
    """Llama in both types; Qwen2 (Q/K/V biases, stored in f16 but loaded as float32 vectors) with a tied head."""
    folder = folders[dtype] if architecture == "llama" else make_hf_model(
        tmp_path, architecture=architecture, dtype=dtype, tie_word_embeddings=True)
    loaded = load_model(folder)
    stored = ModelRunner(loaded.config, loaded.stored_tensors(), cpu, page_size=4, max_cached_tokens=128)
    dense = ModelRunner(loaded.config, loaded.tensors(), cpu, page_size=4, max_cached_tokens=128)
    prompt = loaded.tokenizer.encode("The quick brown fox jumps over the lazy dog.")
    want = greedy_tokens(dense, [prompt], 12)[0]
    assert greedy_tokens(stored, [prompt], 12)[0] == want
    for step, (got, expected) in enumerate(zip(_logits_through_decode(stored, prompt, want),
                                               _logits_through_decode(dense, prompt, want), strict=True)):
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-4 * np.abs(expected).max(), err_msg=f"step {step}")


def test_a_bf16_folder_gives_transformers_logits_on_the_same_weights(folders: dict[str, Path], cpu: Device) -> None:
    """The anchor: transformers runs the bf16 weights widened to float32 (exactly), as pie's float kernels do."""
    folder = folders["bfloat16"]
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    loaded = load_model(folder)
    runner = ModelRunner(loaded.config, loaded.stored_tensors(), cpu, page_size=4, max_cached_tokens=128)
    tokens = loaded.tokenizer.encode("Pie serves language models on every kind of hardware.")
    sequence = runner.new_sequence()
    logits = runner.step([SequenceWork(sequence, tokens)])[0]
    for step in range(9):
        with torch.no_grad():
            expected = reference(torch.tensor([tokens])).logits[0, -1].numpy()
        np.testing.assert_allclose(logits, expected, rtol=0, atol=1e-4, err_msg=f"step {step}")
        tokens.append(int(np.argmax(expected)))
        logits = runner.step([SequenceWork(sequence, [tokens[-1]])])[0]
    sequence.free()
    # transformers computing in bf16 itself rounds every activation to bf16 (8 bits): close, not equal.
    in_bf16 = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        rounded = in_bf16(torch.tensor([tokens])).logits[0, -1].float().numpy()
    assert np.abs(rounded - logits).max() < 0.02 * np.abs(logits).max()
    assert int(np.argmax(rounded)) == int(np.argmax(logits))


def test_pie_plan_lists_the_stored_types_and_each_conversion(folders: dict[str, Path], cpu: Device) -> None:
    result = cli.invoke(app, ["plan", str(folders["bfloat16"]), "--engine", "cpu"])
    assert result.exit_code == 0, result.output
    bf16 = _taken(cpu, "bf16")
    if bf16 == "bf16":
        assert "as stored: 10 bf16, 5 f32; converted at load: 0" in result.output
    else:  # bf16 goes to exact float32 on an engine that does not take it, and the plan says which
        assert "as stored: 5 f32; converted at load: 10" in result.output
        assert "bf16 -> f32: w.L0.qkv, w.L1.qkv (read by linear)" in result.output
    assert "--dtype" not in result.output
    converted = cli.invoke(app, ["plan", str(folders["bfloat16"]), "--engine", "cpu", "--dtype", "float32"])
    assert converted.exit_code == 0, converted.output
    assert "--dtype float32: 16 matrices converted while loading\n  bf16 -> f32: model.embed_tokens.weight" \
        in converted.output
    assert "as stored: 15 f32; converted at load: 0" in converted.output


def test_bad_dtype_values_and_impossible_conversions_are_one_line_errors(tmp_path: Path,
                                                                         folders: dict[str, Path]) -> None:
    for command in (["plan", str(folders["float16"])], ["run", "Hi", "--model", str(folders["float16"])],
                    ["bench", "--model", str(folders["float16"])], ["serve", "--model", str(folders["float16"])]):
        result = cli.invoke(app, [*command, "--engine", "cpu", "--dtype", "int8"])
        assert result.exit_code == 2, (command, result.output)
        assert "Invalid value for '--dtype'" in result.output and "'int8' is not one of" in result.output
    quantized = make_gguf_model(tmp_path / "q8.gguf", "Q8_0")
    result = cli.invoke(app, ["run", "Hi", "--model", str(quantized), "--engine", "cpu", "--dtype", "bfloat16"])
    assert result.exit_code == 1, result.output
    assert (f"pie: {quantized}: tensor 'model.embed_tokens.weight' cannot be loaded as dtype bfloat16: it is stored "
            "as q8_0, and bf16 would round its dequantized values a second time") in result.output
    assert "Traceback" not in result.output


def test_pie_run_verbose_memory_reflects_the_stored_type(folders: dict[str, Path], cpu: Device) -> None:
    config = load_model(folders["float32"]).config
    shapes = weight_shapes(config).values()
    matrices = sum(int(np.prod(s)) for s in shapes if len(s) == 2)
    vectors = sum(int(np.prod(s)) for s in shapes if len(s) == 1)
    cases = [  # folder, --dtype, the weights' bytes as uploaded, as the files store them
        ("float16", "auto", 2 * matrices + 4 * vectors, 2 * (matrices + vectors)),
        ("bfloat16", "auto", (2 if _taken(cpu, "bf16") == "bf16" else 4) * matrices + 4 * vectors,
         2 * (matrices + vectors)),
        ("float32", "float16", 2 * matrices + 4 * vectors, 4 * (matrices + vectors)),
        ("float16", "float32", 4 * (matrices + vectors), 2 * (matrices + vectors)),
    ]
    if "f16" not in cpu.weight_types().get("linear", ()):
        pytest.skip("the CPU engine's native kernels do not build here")
    for folder, dtype, uploaded, files in cases:
        result = cli.invoke(app, ["run", "Hi", "--model", str(folders[folder]), "--engine", "cpu", "--max-tokens", "2",
                                  "--verbose", "--dtype", dtype])
        assert result.exit_code == 0, result.output
        assert f"memory: weights {uploaded / 1e6:.1f} MB ({files / 1e6:.1f} MB in the model's files)" in result.output
        llm = LLM.load(str(folders[folder]), "cpu", max_cached_tokens=16, dtype=dtype)  # the exact bytes
        assert llm.memory is not None and (llm.memory.weight_bytes, llm.memory.loaded_weight_bytes) == (uploaded, files)


def test_pie_bench_and_serve_load_in_the_asked_dtype(folders: dict[str, Path], monkeypatch) -> None:
    monkeypatch.setattr(bench, "measure_bandwidth", lambda device: 1e9)
    monkeypatch.setattr(bench, "paired_decode", lambda llm, prompt, tokens, read: ([0.01] * tokens, [1e9] * tokens))
    report = bench.run_bench(str(folders["float16"]), "cpu", prompt_tokens=4, decode_tokens=2, runs=1, concurrency=1,
                             dtype="float32")
    assert report["dtype"] == "float32" and "weights loaded as float32" in report["text"]
    assert report["weight_bytes"] == 2 * report["loaded_weight_bytes"]
    pytest.importorskip("fastapi")
    from pie.serve.app import ServeSettings
    from pie.serve.server import _load

    llm = _load(ServeSettings(model=str(folders["float16"]), engine="cpu", kv_tokens=32, dtype="bfloat16"))
    assert {c.stored for c in llm.runner.weight_choices.values()} == {"bf16", "f32"}
    assert set(llm.dtype_conversions.values()) == {("f16", "bf16")}
