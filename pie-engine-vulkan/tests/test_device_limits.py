"""What a Vulkan device bounds, met when the model loads rather than at its first step: one layer of the KV pages
is bound as one storage range (``maxStorageBufferRange``, 128 MiB on lavapipe), and the attention kernels hold a
row of at most 256 dims (``head_dim``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from pie.cli import app
from pie.plugins import EngineError, EngineRegistry
from pie.runtime.llm import LLM
from pie.testing.device_memory import exhaust_device_memory, read_beyond_device_memory
from pie.testing.models import make_gguf_model
from typer.testing import CliRunner


@pytest.fixture(scope="module")
def llama3_kv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One layer with Llama 3's KV shape (8 KV heads of 128 dims): 128 KiB a page of 16 tokens."""
    return make_gguf_model(tmp_path_factory.mktemp("limits") / "kv8x128.gguf", "F32", hidden_size=1024, num_heads=8,
                           num_kv_heads=8, head_dim=128, intermediate_size=64, num_layers=1)


def test_a_served_kv_cache_fits_one_binding_a_layer_and_runs(llama3_kv: Path) -> None:
    llm = LLM.load(str(llama3_kv), "vulkan", kv_memory_share=0.25)  # as `pie serve` loads it
    assert len(list(llm.generate_tokens([5, 6, 7], max_tokens=3, stop_token_ids=()))) == 3
    bound = llm.device.max_page_pool_layer_bytes()
    assert bound is not None and llm.kv_capacity_tokens == bound // (128 << 10) * 16
    assert llm.kv_cap == f"capped so that one layer of its pages fits the {bound} bytes vulkan:0 binds at once"
    with pytest.raises(ValueError, match=r"^a KV cache of 65536 tokens .* at most \d+ tokens fit$"):
        LLM.load(str(llama3_kv), "vulkan", max_cached_tokens=65536)


def test_pie_plan_refuses_a_head_dim_beyond_the_attention_kernels(tmp_path: Path) -> None:
    """The model loaded whole and `pie plan` printed a normal plan; the first step failed."""
    model = make_gguf_model(tmp_path / "hd512.gguf", "F32", hidden_size=64, num_heads=2, num_kv_heads=1, head_dim=512,
                            intermediate_size=64, num_layers=1)
    result = CliRunner().invoke(app, ["plan", str(model), "--engine", "vulkan"])
    assert result.exit_code == 1, result.output
    assert result.output == ("pie: engine 'vulkan' runs attention with head_dim up to 256; this model's is 512 "
                             "(use --engine cpu or xla)\n")


def test_a_page_pool_the_device_has_no_memory_for_is_a_memory_error_and_the_device_goes_on() -> None:
    """It was a bare VkErrorOutOfDeviceMemory: `pie run` called it an internal error (exit 70), the buffer pool did not
    give up its kept buffers and retry, and `pie serve` answered a request with it where the CPU engine names a
    MemoryError; the VkBuffer made before the memory was left behind."""
    found = exhaust_device_memory("vulkan")
    assert found["raised"] == "OutOfDeviceMemory" and found["after"] == "usable", found  # the kit's MemoryError
    said = "VK_ERROR_OUT_OF_DEVICE_MEMORY"
    assert found["message"].endswith(f" could not allocate 512.0 MiB of device memory: {said}"), found


def test_a_weight_whose_row_is_larger_than_one_storage_binding_is_refused_when_it_is_uploaded() -> None:
    """lavapipe binds 128 MiB: a projection or an embedding binds a larger weight in chunks of rows, but no launch
    binds a row past it; such a weight was uploaded, and every step that read it failed."""
    device = EngineRegistry().engine("vulkan").open(0)
    limit = int(dict(device.info.extra)["max_storage_binding_bytes"])
    with pytest.raises(EngineError, match=rf"^the vulkan engine binds at most {limit} bytes of one weight on vulkan:0: "
                                          rf"a 2x{limit // 4 + 1} weight of float32 takes "):
        device.upload_weights([np.zeros((2, limit // 4 + 1), np.float32)])  # not touched: refused first


def test_a_page_read_the_device_has_no_memory_for_is_a_memory_error_and_the_device_goes_on() -> None:
    """The larger readback buffer did not fit, and the old one, already retired, stayed in use: the next flush
    destroyed it, the next read retired it again, and the process died ('free(): double free detected')."""
    found = read_beyond_device_memory("vulkan")
    assert found["raised"] == "OutOfDeviceMemory" and found["after"] == "usable", found  # the kit's MemoryError
    said = "VK_ERROR_OUT_OF_DEVICE_MEMORY"
    assert found["message"].endswith(f" could not allocate 64.0 MiB of device memory: {said}"), found
