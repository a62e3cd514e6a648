"""Poem offers each described layer's attention-input and attention regions with their descriptions
(`AttentionInputRegion`, `AttentionRegion`)."""

from __future__ import annotations

import pytest
from pie.contract import RegionRequest
from pie.model.config import ModelConfig
from pie.runtime.model_runner import ModelRunner
from pie.testing.models import random_weights, tiny_config

pytest.importorskip("pie_engine_cpu")


def _offered_regions(config: ModelConfig) -> tuple[ModelRunner, list[RegionRequest]]:
    """A runner of ``config`` on the CPU engine, and every region Poem offered it whole (all declined)."""
    from pie.plugins import EngineRegistry

    device = EngineRegistry(env={"PIE_ENGINES": "cpu"}).engine("cpu").open(0)
    offered: list[RegionRequest] = []
    device.compile_region = lambda region: offered.append(region)  # type: ignore[method-assign]  # this device only
    device.compile_block = lambda block: None  # type: ignore[method-assign]
    return ModelRunner(config, random_weights(config).items(), device, page_size=4, max_cached_tokens=64), offered


# Gemma's post-norms finish the previous layer's regions, so every layer's attention input is a region of its own.
@pytest.mark.parametrize("architecture", ["llama", "qwen3", "gemma2", "gemma3"])
def test_each_layers_attention_input_region_comes_with_its_layer_and_outputs(architecture: str) -> None:
    config = tiny_config(architecture)
    runner, offered = _offered_regions(config)
    try:
        layers = list(runner.plan.graph.layers.values())
        described = {region.label: region.attention_input for region in offered if region.attention_input}
        assert sorted(described) == [f"L{i}.attn_in" for i in range(config.num_layers)]
        for region in offered:
            found = region.attention_input
            if found is None:
                continue
            assert found.layer in layers and region.label == f"L{found.layer.layer}.attn_in"
            assert found.layer.qk_norm == (architecture in ("qwen3", "gemma3"))
            assert set(region.outputs) == {found.q, found.k, found.v}, "q, k and v are what the region exports"
            rotated = {op.output: op.inputs for op in region.ops if op.kernel == "rope"}
            assert set(rotated) == {found.q, found.k} and found.v not in rotated, "q and k rotated, v not"
            norm = next(op for op in region.ops if op.kernel == "rms_norm")
            assert norm.inputs == (found.layer.x, found.layer.weight("attn_norm"))
    finally:
        runner.close()


@pytest.mark.parametrize("architecture", ["llama", "gemma3"])
def test_each_layers_attention_region_comes_with_its_layer_and_values(architecture: str) -> None:
    """The append_kv-and-attention region of every layer is offered with `AttentionRegion`: its q, k and v
    are the attention input's, its output the one the region exports."""
    config = tiny_config(architecture)
    runner, offered = _offered_regions(config)
    try:
        graph = runner.plan.graph
        described = {region.label: region for region in offered if region.attention}
        assert sorted(described) == sorted(f"L{i}.attention" for i in range(config.num_layers))
        assert all(region.attention is None for region in offered if region.label not in described)
        for label, region in described.items():
            found = region.attention
            assert found is not None and found.layer is graph.layers[label.split(".")[0]]
            append, attend = region.ops
            assert append.inputs == (found.layer.pool, found.k, found.v, found.layer.slots)
            assert attend.inputs[:2] == (found.q, found.layer.pool) and region.outputs == (found.output,)
            attention_input = graph.attention_inputs[f"L{found.layer.layer}.attn_in"]
            assert (found.q, found.k, found.v) == (attention_input.q, attention_input.k, attention_input.v)
    finally:
        runner.close()


def test_a_region_with_only_some_of_its_tags_ops_comes_without_a_description() -> None:
    from pie.plugins import EngineRegistry
    from pie.poem.graph import build_decoder_graph
    from pie.poem.lower import lower

    graph = build_decoder_graph(tiny_config("llama"))
    graph.add("add", (graph.output, graph.output), "logits.twice", "L0.attention")  # a third op of L0's attention
    graph.output = "logits.twice"
    device = EngineRegistry(env={"PIE_ENGINES": "cpu"}).engine("cpu").open(0)
    offered: list[RegionRequest] = []
    device.compile_region = lambda region: offered.append(region)  # type: ignore[method-assign]  # this device only
    device.compile_block = lambda block: None  # type: ignore[method-assign]
    lower(graph, device)
    described = {region.label for region in offered if region.attention}
    assert "L0.attention" in {region.label for region in offered} and "L0.attention" not in described
    assert described == {f"L{i}.attention" for i in range(1, len(graph.layers))}
