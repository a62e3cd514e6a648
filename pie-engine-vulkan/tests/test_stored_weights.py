"""Weights in their stored type on the shared-kernel engines: what an upload keeps, and what it refuses.
(The kernels on each type are the conformance kit's ``test_kernel_reads_weights_as_stored``.)"""

from __future__ import annotations

import numpy as np
import pytest
from pie.plugins import EngineRegistry
from pie.shaders.tensor import StoredTensor
from pie.weights import StoredWeight, quantize


@pytest.fixture(scope="module")
def device():
    return EngineRegistry().engine("vulkan").open(0)


@pytest.mark.parametrize("weight_type", ["f16", "q8_0", "q4_0", "q4_1"])
def test_a_stored_weight_keeps_its_bytes_on_the_device(device, weight_type: str) -> None:
    weight = quantize(np.random.default_rng(0).standard_normal((37, 96)).astype(np.float32), weight_type)
    assert isinstance(weight, StoredWeight)
    (tensor,) = device.upload_weights([weight])
    assert isinstance(tensor, StoredTensor) and tensor.type == weight_type and tensor.shape == (37, 96)
    words = device.download(tensor.words)
    assert words.nbytes == -(-weight.nbytes // 4) * 4 + 4, "the stored bytes and one spare word, not float32"
    np.testing.assert_array_equal(words.view(np.uint8)[: weight.nbytes], weight.data.reshape(-1))


def test_a_type_no_kernel_reads_is_refused_by_name(device) -> None:
    bf16 = StoredWeight("bf16", (4, 32), np.zeros((4, 64), np.uint8))
    with pytest.raises(ValueError, match="not bf16"):
        device.upload_weights([bf16])
