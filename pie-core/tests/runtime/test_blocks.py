"""Poem offers each decoder layer to the engine as one block and the run of them as one stack, and runs
the blocks when the stack's launcher declines a pass, the regions when a block's does."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import pytest
from pie import kernels as reference
from pie.contract import RegionRequest
from pie.runtime.model_runner import ModelRunner, SequenceWork
from pie.testing.models import random_weights, tiny_config

pytest.importorskip("pie_engine_cpu")

DECLINE_FROM_ROWS = 3


def interpreting_block(
    block: RegionRequest, counts: Counter[str], decline_from_rows: int = DECLINE_FROM_ROWS
) -> Any:
    """A block (or stack) launcher that runs its ops with the numpy references, declining passes of
    ``decline_from_rows`` rows or more."""

    def launch(*args: Any) -> Any:
        values = dict(zip(block.inputs, args, strict=True))
        unit = "stack" if "-" in block.label else "block"
        if values[block.ops[0].inputs[0]].shape[0] >= decline_from_rows:
            counts[f"{unit} declined"] += 1
            return NotImplemented
        counts[f"{unit} ran"] += 1
        for op in block.ops:
            result = getattr(reference, op.kernel)(*(values.get(n) for n in op.inputs), **dict(op.options))
            if op.output is not None:
                values[op.output] = result.astype(np.float32)
        return tuple(values[name] for name in block.outputs)

    return launch


def runner_with(offer_block: Any, architecture: str = "llama", offer_stack: Any = None) -> ModelRunner:
    from pie.plugins import EngineRegistry

    config = tiny_config(architecture)
    device = EngineRegistry(env={"PIE_ENGINES": "cpu"}).engine("cpu").open(0)
    device.compile_block = offer_block  # type: ignore[method-assign]  # this device only
    device.compile_stack = offer_stack or (lambda stack, blocks: None)  # type: ignore[method-assign]
    return ModelRunner(config, random_weights(config).items(), device, page_size=4, max_cached_tokens=128)


def test_every_decoder_layer_is_offered_as_one_block() -> None:
    offered: list[RegionRequest] = []
    runner = runner_with(lambda block: offered.append(block))
    assert [block.label for block in offered] == ["L0", "L1"]
    first = offered[0]
    layer_ops = [op for region in runner.plan.regions if region.label.startswith("L0.") for op in region.ops]
    assert [op.kernel for op in first.ops] == [op.kind for op in layer_ops]
    assert first.outputs == ("L0.x_out",)
    assert first.inputs[0] == "x.embed" and "w.L0.down" in first.inputs and "kv.pool" in first.inputs
    assert not any(name.startswith("L0.") for name in first.inputs), "the layer's own values stay inside it"
    assert offered[1].inputs[0] == "L0.x_out"
    assert runner.plan.blocks == (), "declined blocks leave the plan to the regions"


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
def test_blocks_and_declined_passes_give_the_regions_logits(architecture: str) -> None:
    counts: Counter[str] = Counter()
    with_blocks = runner_with(lambda block: interpreting_block(block, counts), architecture)
    regions_only = runner_with(lambda block: None, architecture)
    assert [block.label for block in with_blocks.plan.blocks] == ["L0", "L1"]
    assert "L0               block of 5 regions" in with_blocks.plan.describe()
    sequences = {runner: [runner.new_sequence(), runner.new_sequence()] for runner in (with_blocks, regions_only)}
    batches = [
        [[5, 9, 11, 3, 7], [4, 2, 8]],  # prefill, 8 rows: declined
        [[6], [1]],  # decode, 2 rows: the block
        [[12], [3, 14]],  # 3 rows: declined
        [[7], [2]],
    ]
    for tokens in batches:
        got, expected = (
            runner.step([SequenceWork(s, t) for s, t in zip(sequences[runner], tokens, strict=True)])
            for runner in (with_blocks, regions_only)
        )
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
    assert counts == {"block ran": 2 * 2, "block declined": 2 * 2}


def test_the_run_of_blocks_is_offered_as_one_stack() -> None:
    offered: list[tuple[RegionRequest, tuple[RegionRequest, ...]]] = []
    runner = runner_with(lambda block: lambda *args: NotImplemented, offer_stack=lambda *s: offered.append(s))
    [(stack, blocks)] = offered
    assert stack.label == "L0-L1"
    assert blocks == tuple(block.request for block in runner.plan.blocks)
    assert [op.kernel for op in stack.ops] == [op.kernel for block in blocks for op in block.ops]
    assert stack.outputs == ("L1.x_out",)
    assert "L0.x_out" not in stack.inputs, "what a block passes the next stays inside the stack"
    assert {"x.embed", "w.L0.qkv", "w.L1.down", "kv.pool"} <= set(stack.inputs)
    assert runner.plan.stacks == (), "a declined stack leaves the plan to the blocks"
    assert runner_with(lambda block: None, offer_stack=lambda *s: offered.append(s)).plan.blocks == ()
    assert len(offered) == 1, "no stack is offered where the engine compiled no blocks"


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
def test_a_stack_and_its_declined_passes_give_the_regions_logits(architecture: str) -> None:
    counts: Counter[str] = Counter()
    stacked = runner_with(
        lambda block: interpreting_block(block, counts),
        architecture,
        offer_stack=lambda stack, blocks: interpreting_block(stack, counts, decline_from_rows=2),
    )
    regions_only = runner_with(lambda block: None, architecture)
    assert [stack.label for stack in stacked.plan.stacks] == ["L0-L1"]
    assert "L0-L1            stack of 2 blocks -> one launch" in stacked.plan.describe()
    sequences = {runner: [runner.new_sequence(), runner.new_sequence()] for runner in (stacked, regions_only)}
    for tokens, work in [
        ([[5, 9, 11, 3, 7], [4, 2, 8]], {"stack declined": 1, "block declined": 2}),
        ([[6]], {"stack ran": 1}),
        ([[12], [3]], {"stack declined": 1, "block ran": 2}),
        ([[7], [2]], {"stack declined": 1, "block ran": 2}),
    ]:
        counts.clear()
        got, expected = (
            runner.step([SequenceWork(s, t) for s, t in zip(sequences[runner], tokens)])
            for runner in (stacked, regions_only)
        )
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
        assert counts == work
