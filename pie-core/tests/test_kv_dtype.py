"""`--kv-dtype`: the KV pages' element type, asked of the engine (``pie_kv_dtypes``), refused where the engine
does not list it, kept by the host page pool, and counted in the memory `pie run --verbose` and `pie bench` print."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

import fake_engines
from pie import bench
from pie.cli import app
from pie.contract import PageLayout, kv_host_dtype
from pie.plugins import EngineError, EngineRegistry
from pie.runtime.llm import LLM, kv_bytes_per_token
from pie.runtime.model_runner import SequenceWork
from pie.scheduler.offload import HostPagePool
from pie.testing.models import make_gguf_model, tiny_config

runner = CliRunner()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_gguf_model(tmp_path_factory.mktemp("kv") / "tiny.gguf", "F32", tie_word_embeddings=True)


def test_an_engine_without_the_hook_takes_float32_only(install_engine) -> None:
    install_engine("acme", fake_engines.WORKING)
    registry = EngineRegistry(env={})
    assert registry.engine("acme").open(0).kv_dtypes() == ("float32",)
    assert registry.engine("cpu").open(0).kv_dtypes() == ("float32", "float16", "bfloat16")


def test_a_kv_dtype_the_engine_does_not_list_is_refused_before_the_model_loads(install_engine, tmp_path) -> None:
    install_engine("acme", fake_engines.WORKING)
    missing = tmp_path / "no-such-model.gguf"  # never read: the refusal comes first
    with pytest.raises(EngineError, match=r"engine 'acme' keeps KV pages in float32 only, not bfloat16"):
        LLM.load(str(missing), "acme", registry=EngineRegistry(env={}), kv_dtype="bfloat16")


def test_pie_run_names_the_engine_and_the_types_it_takes(install_engine, tiny_model: Path) -> None:
    install_engine("acme", fake_engines.WORKING)
    result = runner.invoke(app, ["run", "Hello", "--model", str(tiny_model), "--engine", "acme", "--kv-dtype", "float16"])
    assert result.exit_code == 1, result.output
    assert "pie: engine 'acme' keeps KV pages in float32 only, not float16" in result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize("command", [["run", "Hello"], ["bench"], ["serve"]])
def test_an_unknown_kv_dtype_is_a_usage_error(command: list[str]) -> None:
    result = runner.invoke(app, [*command, "--kv-dtype", "int8"])
    assert result.exit_code == 2, result.output
    assert "Invalid value for '--kv-dtype'" in result.output and "'float16'" in result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize("kv_dtype", ["float16", "bfloat16"])
def test_pie_run_verbose_prints_the_kv_bytes_of_the_chosen_type(tiny_model: Path, kv_dtype: str) -> None:
    args = ["run", "Hello", "--model", str(tiny_model), "--engine", "cpu", "--max-tokens", "3", "--kv-tokens", "64",
            "--verbose"]
    lines = {}
    for dtype in ("float32", kv_dtype):
        result = runner.invoke(app, [*args, "--kv-dtype", dtype])
        assert result.exit_code == 0, result.output
        lines[dtype] = next(line for line in result.output.splitlines() if "KV cache" in line)
    config = tiny_config()
    per_token = kv_bytes_per_token(config, kv_dtype)
    assert per_token * 2 == kv_bytes_per_token(config, "float32")
    assert f"KV cache {64 * per_token / 1e6:.1f} MB (64 tokens of {kv_dtype})" in lines[kv_dtype]
    assert f"KV cache {64 * 2 * per_token / 1e6:.1f} MB (64 tokens of float32)" in lines["float32"]


def test_pie_bench_reports_the_kv_bytes_of_the_chosen_type(tiny_model: Path, monkeypatch) -> None:
    monkeypatch.setattr(bench, "measure_bandwidth", lambda device: 1e9)
    monkeypatch.setattr(bench, "paired_decode", lambda llm, prompt, tokens, read: ([0.01] * tokens, [1e9] * tokens))
    reports = {
        dtype: bench.run_bench(str(tiny_model), "cpu", prompt_tokens=4, decode_tokens=2, runs=1, concurrency=1,
                               kv_dtype=dtype)
        for dtype in ("float32", "float16")
    }
    assert reports["float16"]["kv_dtype"] == "float16"
    assert reports["float16"]["kv_cache_tokens"] == reports["float32"]["kv_cache_tokens"] == 2048
    assert 2 * reports["float16"]["kv_cache_bytes"] == reports["float32"]["kv_cache_bytes"]
    assert "tokens of float16)" in reports["float16"]["text"]


@pytest.mark.parametrize("kv_dtype", ["float16", "bfloat16"])
def test_the_host_page_pool_and_copy_on_write_keep_the_pools_type(tiny_model: Path, kv_dtype: str) -> None:
    llm = LLM.load(str(tiny_model), "cpu", max_cached_tokens=64, kv_dtype=kv_dtype)
    model = llm.runner
    assert model.pages.handle.dtype == kv_host_dtype(kv_dtype)
    sequence = model.new_sequence()
    model.step([SequenceWork(sequence, list(range(1, 11)))])
    pages = np.asarray(sequence.pages, np.int32)
    before = model.pages.read(pages)
    child = sequence.fork()
    model.step([SequenceWork(child, [12])])  # its last page is shared: copied first (copy-on-write)
    copied = model.pages.read(child.pages[-1:])
    assert copied.dtype == kv_host_dtype(kv_dtype)
    np.testing.assert_array_equal(copied[:, :, :, :2].view(np.uint16), before[:, -1:, :, :2].view(np.uint16))
    host = HostPagePool.for_runner(model, 8)
    assert host.layout.dtype == kv_dtype and host.handle.dtype == kv_host_dtype(kv_dtype)
    stored = host.store(model.pages, sequence)
    assert stored is not None
    sequence.free()
    restored = host.load(model.pages, stored)
    after = model.pages.read(restored.pages)
    np.testing.assert_array_equal(after.view(np.uint16), before.view(np.uint16))
    host.close()
    model.close()


def test_pie_serve_loads_the_model_with_the_kv_dtype_asked_for(tiny_model: Path, monkeypatch) -> None:
    from pie.serve import server

    served = []
    monkeypatch.setattr(server, "run_server", lambda settings, host, port, access_log: served.append(settings) or 0)
    result = runner.invoke(app, ["serve", "--model", str(tiny_model), "--engine", "cpu", "--kv-tokens", "64",
                                 "--kv-dtype", "bfloat16"])
    assert result.exit_code == 0, result.output
    (settings,) = served
    assert settings.kv_dtype == "bfloat16"
    llm = server._load(settings)
    assert llm.runner.layout.dtype == "bfloat16" and llm.runner.pages.handle.dtype == kv_host_dtype("bfloat16")
    llm.runner.close()


def test_copying_pages_through_host_memory_keeps_them_exactly(monkeypatch) -> None:
    """An engine without pie_copy_pages copies a page (copy-on-write) by reading it to the host and writing it back."""
    device = EngineRegistry(env={}).engine("cpu").open(0)
    has_hook = device.engine.has_hook
    monkeypatch.setattr(device.engine, "has_hook", lambda name: name != "pie_copy_pages" and has_hook(name))
    layout = PageLayout(num_layers=2, num_pages=4, page_size=4, num_kv_heads=1, head_dim=8, dtype="bfloat16")
    pool = device.allocate_pages(layout)
    data = np.random.default_rng(2).standard_normal(layout.shape).astype(kv_host_dtype("bfloat16"))
    every = np.arange(4, dtype=np.int32)
    device.write_pages(pool, every, data)
    device.copy_pages(pool, np.array([3], np.int32), np.array([0], np.int32))
    expected = data.copy()
    expected[:, 0] = data[:, 3]
    np.testing.assert_array_equal(device.read_pages(pool, every).view(np.uint16), expected.view(np.uint16))
