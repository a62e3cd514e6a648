"""What a WebGPU device bounds, met when the model loads rather than at its first step: one layer of the KV pages
is bound as one storage range (``maxStorageBufferBindingSize``, 128 MiB by default and on lavapipe), the whole pool
is one buffer (``maxBufferSize``), and the attention kernels hold a row of at most 256 dims (``head_dim``)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from browser_device import browser_registry
from pie.cli import app
from pie.contract import PageLayout
from pie.plugins import EngineError, EngineRegistry
from pie.runtime.llm import LLM
from pie.serve.app import ServerState, ServeSettings, create_app
from pie.testing.device_memory import exhaust_device_memory
from pie.testing.models import make_gguf_model
from starlette.testclient import TestClient
from typer.testing import CliRunner


@pytest.fixture(scope="module")
def llama3_kv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One layer with Llama 3's KV shape (8 KV heads of 128 dims): 128 KiB a page of 16 tokens, so a layer of 65536
    tokens (what `pie serve` sized here) is 512 MiB."""
    return make_gguf_model(tmp_path_factory.mktemp("limits") / "kv8x128.gguf", "F32", hidden_size=1024, num_heads=8,
                           num_kv_heads=8, head_dim=128, intermediate_size=64, num_layers=1)


@pytest.fixture(scope="module")
def deep_kv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """24 layers of Llama 3's KV shape: 3 GiB of pages hold 16384 tokens, 128 MiB a layer."""
    return make_gguf_model(tmp_path_factory.mktemp("limits") / "deep.gguf", "F32", hidden_size=64, num_heads=8,
                           num_kv_heads=8, head_dim=128, intermediate_size=64, num_layers=24,
                           max_position_embeddings=65536)


@pytest.fixture(scope="module")
def wide_heads(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_gguf_model(tmp_path_factory.mktemp("limits") / "hd512.gguf", "F32", hidden_size=64, num_heads=2,
                           num_kv_heads=1, head_dim=512, intermediate_size=64, num_layers=1)


def test_a_served_kv_cache_fits_one_binding_a_layer_and_requests_are_answered(llama3_kv: Path) -> None:
    """`pie serve` said it was ready with 65536 tokens of KV cache, then answered every request with a 500."""
    llm = LLM.load(str(llama3_kv), "wgpu", kv_memory_share=0.25)  # as `pie serve` loads it
    with TestClient(create_app(ServerState(ServeSettings(served_model_name="kv8x128"), llm))) as client:
        reply = client.post("/v1/completions", json={"model": "kv8x128", "prompt": "hi", "max_tokens": 3})
    assert reply.status_code == 200, reply.text
    bound = llm.device.max_page_pool_layer_bytes()
    assert bound is not None and llm.runner.layout.layer_bytes <= bound
    assert llm.kv_capacity_tokens == bound // (128 << 10) * 16
    assert llm.kv_cap == f"capped so that one layer of its pages fits the {bound} bytes wgpu:0 binds at once"


def test_kv_tokens_one_binding_cannot_hold_are_refused_before_the_weights_load(llama3_kv: Path) -> None:
    with pytest.raises(ValueError, match=r"^a KV cache of 65536 tokens of float32 does not fit engine 'wgpu' on wgpu:0 "
                                         r"\(.*\), which binds at most \d+ bytes of one layer's pages: at most \d+ "
                                         r"tokens fit$"):
        LLM.load(str(llama3_kv), "wgpu", max_cached_tokens=65536)


def test_kv_tokens_one_buffer_cannot_hold_are_refused_in_one_line(deep_kv: Path) -> None:
    """Each layer's pages fit a binding, but the pool is one buffer, which wgpu bounds (2 GiB on lavapipe): it was
    allocated after the weights loaded and failed with a validation error, which `pie run` called an internal error
    (exit 70); `pie serve`, which caps each layer to the binding, failed so for any model of 17 such layers or more."""
    result = CliRunner().invoke(app, ["run", "Hi", "--model", str(deep_kv), "--engine", "wgpu", "--kv-tokens", "16000"])
    assert result.exit_code == 1, result.output
    assert re.fullmatch(r"pie: a KV cache of 16000 tokens of float32 does not fit engine 'wgpu' on wgpu:0 \(.*\), "
                        r"which holds at most \d+ bytes of pages in one buffer: at most \d+ tokens fit\n",
                        result.output), result.output


def test_a_head_dim_beyond_the_attention_kernels_fails_the_load_and_the_plan(wide_heads: Path) -> None:
    """The model loaded whole and `pie plan` printed a normal plan; the first step failed."""
    message = "engine 'wgpu' runs attention with head_dim up to 256; this model's is 512 (use --engine cpu or xla)"
    with pytest.raises(EngineError, match=r"^" + message.replace("(", r"\(").replace(")", r"\)") + "$"):
        LLM.load(str(wide_heads), "wgpu", registry=EngineRegistry(), max_cached_tokens=64)
    result = CliRunner().invoke(app, ["plan", str(wide_heads), "--engine", "wgpu"])
    assert result.exit_code == 1 and result.output == f"pie: {message}\n", result.output


def test_the_browser_device_bounds_a_layer_by_its_storage_binding_too() -> None:
    """The same kit's answer from the page's WebGPU limits; a layout beyond it is refused before anything is
    allocated."""
    registry, engine = browser_registry()
    device = registry.engine("wgpu").open(0)
    try:
        backend = engine.backend(device.info)
        bound = device.max_page_pool_layer_bytes()
        assert bound == backend.max_binding_bytes - max(backend.storage_alignment, 16)  # type: ignore[attr-defined]
        page = PageLayout(num_layers=2, num_pages=1, page_size=16, num_kv_heads=8, head_dim=128)
        with pytest.raises(EngineError, match=rf"^the wgpu engine binds at most {bound} bytes of one layer's KV pages"):
            device.allocate_pages(PageLayout(2, bound // page.layer_bytes + 1, 16, 8, 128))
    finally:
        engine.close(device.info)


def test_a_page_pool_the_device_has_no_memory_for_is_a_memory_error_and_the_device_goes_on() -> None:
    """It was a bare GPUValidationError: `pie run` called it an internal error (exit 70), the buffer pool did not give
    up its kept buffers and retry, and `pie serve` answered a request with it where the CPU engine names a
    MemoryError."""
    found = exhaust_device_memory("wgpu")
    assert found["raised"] == "OutOfDeviceMemory" and found["after"] == "usable", found  # the kit's MemoryError
    said = "wgpu says 'Not enough memory left.'"
    assert found["message"].endswith(f" could not allocate 512.0 MiB of device memory: {said}"), found
