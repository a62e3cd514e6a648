"""Weights kept on the XLA engine in their stored types: the same logits as their float32 copies, and the
device holding the stored bytes, not float32 (one device, in process).

One 16-bit type and one block type: they take the two paths a stored weight has through a model (widened
as it is read; its blocks decoded inside the region). Every declared type's decoder, in every kernel that
reads a weight, is checked against ``gguf`` by the conformance kit (``test_conformance.py``).
"""

from __future__ import annotations

import numpy as np
import pytest
from xla_helpers import compare_engines, sharding_config

TOLERANCE = 1e-4


@pytest.mark.parametrize("weight_type", ["bf16", "q4_1"])
def test_stored_model_matches_its_float32_copy_and_the_device_holds_the_stored_bytes(weight_type: str) -> None:
    result = compare_engines(sharding_config(), prompt_lengths=(7, 3), decode_steps=4, fork=True,
                             weight_type=weight_type)
    try:
        xla = result.runners["xla"]
        assert not [c for c in xla.weight_choices.values() if c.converted]
        stored = [c.name for c in xla.weight_choices.values() if c.stored == weight_type]
        assert len(stored) >= 5, "the matrices should be stored in the type under test"
        assert result.max_error < TOLERANCE
        for name in stored:
            tensor = xla._env[xla.plan.slots[name]]
            rows, cols = tensor.shape
            expected = rows * cols * 2 if weight_type == "bf16" else rows * (cols // 32) * 20
            assert tensor.weight_type == weight_type
            assert tensor.array.nbytes == expected, (name, tensor.array.dtype, tensor.array.shape)
            assert tensor.array.dtype == (np.uint8 if weight_type == "q4_1" else "bfloat16")
    finally:
        result.close()
