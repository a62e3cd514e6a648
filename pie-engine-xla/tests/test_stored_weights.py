"""Weights kept on the XLA engine in their stored types: the same logits as their float32 copies, and the
device holding the stored bytes, not float32 (one device, in process; the kit checks every kernel and type)."""

from __future__ import annotations

import numpy as np
import pytest
from xla_helpers import compare_engines, sharding_config

TOLERANCE = 1e-4


@pytest.mark.parametrize("weight_type", ["f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0"])
def test_stored_model_matches_its_float32_copy_on_the_cpu_engine(weight_type: str) -> None:
    result = compare_engines(sharding_config(), prompt_lengths=(7, 3), decode_steps=4, fork=True,
                             weight_type=weight_type)
    try:
        xla = result.runners["xla"]
        assert not [c for c in xla.weight_choices.values() if c.converted]
        as_stored = [c for c in xla.weight_choices.values() if c.stored == weight_type]
        assert len(as_stored) >= 5, "the matrices should be stored in the type under test"
        assert result.max_error < TOLERANCE
    finally:
        result.close()


@pytest.mark.parametrize("weight_type", ["bf16", "q4_1"])
def test_device_holds_the_stored_bytes(weight_type: str) -> None:
    result = compare_engines(sharding_config(), prompt_lengths=(5,), decode_steps=1, weight_type=weight_type)
    try:
        xla = result.runners["xla"]
        stored = [c.name for c in xla.weight_choices.values() if c.stored == weight_type]
        for name in stored:
            tensor = xla._env[xla.plan.slots[name]]
            rows, cols = tensor.shape
            expected = rows * cols * 2 if weight_type == "bf16" else rows * (cols // 32) * 20
            assert tensor.weight_type == weight_type
            assert tensor.array.nbytes == expected, (name, tensor.array.dtype, tensor.array.shape)
            assert tensor.array.dtype == (np.uint8 if weight_type == "q4_1" else "bfloat16")
    finally:
        result.close()

