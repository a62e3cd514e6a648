"""Poem offers each decoder layer to the engine as one block, and runs its regions when the block's
launcher declines a pass."""

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


def interpreting_block(block: RegionRequest, counts: Counter[str]) -> Any:
    """A block launcher that runs the block's ops with the numpy references, declining passes of
    DECLINE_FROM_ROWS rows or more."""

    def launch(*args: Any) -> Any:
        values = dict(zip(block.inputs, args, strict=True))
        if values[block.ops[0].inputs[0]].shape[0] >= DECLINE_FROM_ROWS:
            counts["declined"] += 1
            return NotImplemented
        counts["ran"] += 1
        for op in block.ops:
            result = getattr(reference, op.kernel)(*(values.get(n) for n in op.inputs), **dict(op.options))
            if op.output is not None:
                values[op.output] = result.astype(np.float32)
        return tuple(values[name] for name in block.outputs)

    return launch


def runner_with(offer_block: Any, architecture: str = "llama") -> ModelRunner:
    from pie.plugins import EngineRegistry

    config = tiny_config(architecture)
    device = EngineRegistry(env={"PIE_ENGINES": "cpu"}).engine("cpu").open(0)
    device.compile_block = offer_block  # type: ignore[method-assign]  # this device only
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
    assert counts == {"ran": 2 * 2, "declined": 2 * 2}
