"""An engine that binds one layer of its KV pages as one buffer range of bounded size (Vulkan, WebGPU:
``pie_max_page_pool_layer_bytes``) gets a KV cache whose layer fits: the runtime caps the size it chooses, and
says so, and refuses one asked for that does not fit, naming the most that does. `pie serve` said it was ready
and then answered every request with a kernel's failure. The same for one that holds the whole pool in one buffer
of bounded size (``pie_max_page_pool_bytes``), where the pool's allocation failed."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from typer.testing import CliRunner

import fake_engines
from pie.cli import app
from pie.plugins import EngineRegistry
from pie.runtime.llm import LLM, kv_tokens_bindable
from pie.serve.app import ServerState, ServeSettings
from pie.serve.server import _attach
from pie.testing.models import make_gguf_model, tiny_config

runner = CliRunner()
BINDABLE = 64
"""Tokens `fake_engines.BINDS_LITTLE` binds one layer of: four pages of 16."""


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_gguf_model(tmp_path_factory.mktemp("bind") / "tiny.gguf", "F32")  # a context of 256 tokens


@pytest.fixture
def little(install_engine) -> EngineRegistry:
    install_engine("little", fake_engines.BINDS_LITTLE)
    return EngineRegistry(env={})


def test_whole_pages_of_one_layer_within_the_bound_are_what_fits() -> None:
    config = tiny_config()  # a page of 16 tokens takes 16 * 2 * 2 heads * 16 * 4 bytes = 4096 bytes a layer
    assert kv_tokens_bindable(config, 4 * 4096 + 100, 16) == BINDABLE
    assert kv_tokens_bindable(config, 4 * 4096 + 100, 16, "float16") == 2 * BINDABLE
    assert kv_tokens_bindable(config, 4095, 16) == 0


@pytest.mark.parametrize("sizing", [{"kv_memory_share": 0.25}, {}, {"sequence_tokens": lambda tokenizer: 200}])
def test_a_kv_cache_the_runtime_sizes_is_capped_to_what_one_layer_binds_and_runs(
    little: EngineRegistry, tiny_model: Path, sizing: dict[str, object]
) -> None:
    """As `pie serve` sizes it (a share of memory), as `pie run` does (one sequence), or the whole context."""
    llm = LLM.load(str(tiny_model), "little", registry=little, **sizing)  # type: ignore[arg-type]
    assert llm.kv_capacity_tokens == BINDABLE
    assert llm.kv_cap == "capped so that one layer of its pages fits the 16484 bytes little:0 binds at once"
    assert len(list(llm.generate_tokens([5, 6, 7], max_tokens=3, stop_token_ids=()))) == 3


def test_a_kv_cache_within_the_bound_is_left_as_it_is(little: EngineRegistry, tiny_model: Path) -> None:
    llm = LLM.load(str(tiny_model), "little", registry=little, sequence_tokens=lambda tokenizer: 20)
    assert (llm.kv_capacity_tokens, llm.kv_cap) == (32, "")  # 20 tokens in whole pages of 16


def test_a_kv_cache_asked_for_that_does_not_fit_is_refused_naming_the_most_that_does(
    little: EngineRegistry, tiny_model: Path
) -> None:
    assert LLM.load(str(tiny_model), "little", registry=little, max_cached_tokens=BINDABLE).kv_capacity_tokens == 64
    with pytest.raises(ValueError) as refused:
        LLM.load(str(tiny_model), "little", registry=little, max_cached_tokens=BINDABLE + 1)
    message = str(refused.value)
    assert message.startswith("a KV cache of 65 tokens of float32 does not fit engine 'little' on little:0 (")
    assert message.endswith("which binds at most 16484 bytes of one layer's pages: at most 64 tokens fit")


def test_pie_run_says_what_fits_in_one_line(little: EngineRegistry, tiny_model: Path) -> None:
    args = ["run", "Hello", "--model", str(tiny_model), "--engine", "little", "--kv-tokens", "100"]
    result = runner.invoke(app, args)
    assert result.exit_code == 1, result.output
    assert "pie: a KV cache of 100 tokens of float32 does not fit engine 'little'" in result.output
    assert "at most 64 tokens fit" in result.output and "Traceback" not in result.output


def test_the_servers_ready_line_says_the_kv_cache_was_capped_and_why(
    little: EngineRegistry, tiny_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    llm = LLM.load(str(tiny_model), "little", registry=little, kv_memory_share=0.25)
    state = ServerState(ServeSettings(served_model_name="tiny"))
    loop = asyncio.new_event_loop()
    try:
        loaded = loop.create_future()
        loaded.set_result(llm)
        _attach(state, None, loaded, loop, "http://127.0.0.1:1")  # type: ignore[arg-type]  # no server is failed
    finally:
        state.close()
        loop.close()
    ready = next(line for line in capsys.readouterr().err.splitlines() if "ready:" in line)
    assert "KV cache 64 tokens (4 pages of 16, capped so that one layer of its pages fits the 16484 bytes little:0 " \
           "binds at once)" in ready


@pytest.mark.parametrize("sizing", [{"kv_memory_share": 0.25}, {}])
def test_a_kv_cache_the_runtime_sizes_is_capped_to_what_one_buffer_holds_where_that_is_tighter(
    install_engine, tiny_model: Path, sizing: dict[str, object]
) -> None:
    """`pie serve --engine wgpu` of a model of 24 layers capped each layer to WebGPU's binding (128 MiB), and the
    pool of 3 GiB failed in its allocation (more than the 2 GiB wgpu's largest buffer takes), an internal error."""
    install_engine("holds", fake_engines.HOLDS_LITTLE)
    llm = LLM.load(str(tiny_model), "holds", registry=EngineRegistry(env={}), **sizing)  # type: ignore[arg-type]
    assert llm.kv_capacity_tokens == 48, "three pages of 16: the pool's bound is tighter than the layer's"
    assert llm.kv_cap == "capped so that its pages fit the 24676 bytes of one buffer of holds:0"
    assert len(list(llm.generate_tokens([5, 6, 7], max_tokens=3, stop_token_ids=()))) == 3


def test_a_kv_cache_asked_for_that_one_buffer_cannot_hold_is_refused_naming_the_most_that_does(
    install_engine, tiny_model: Path
) -> None:
    install_engine("holds", fake_engines.HOLDS_LITTLE)
    registry = EngineRegistry(env={})
    assert LLM.load(str(tiny_model), "holds", registry=registry, max_cached_tokens=48).kv_capacity_tokens == 48
    result = runner.invoke(app, ["run", "Hello", "--model", str(tiny_model), "--engine", "holds", "--kv-tokens", "49"])
    assert result.exit_code == 1, result.output
    assert result.output.startswith("pie: a KV cache of 49 tokens of float32 does not fit engine 'holds' on holds:0 (")
    assert result.output.endswith("which holds at most 24676 bytes of pages in one buffer: at most 48 tokens fit\n")
