"""Weights in their stored type on the shared-kernel engines: what an upload keeps, and what it refuses.
(The kernels on each type are the conformance kit's ``test_kernels_read_weights_as_stored``; here, random
blocks, every bit of their scales and quants set some time, which a quantizer's output may not reach.)"""

from __future__ import annotations

import numpy as np
import pytest
from pie.enginekit.shaders.launch import LINEAR_VARIANTS, STORED_TYPES
from pie.enginekit.tensor import StoredTensor
from pie.plugins import EngineRegistry
from pie.testing.kquants import random_blocks
from pie.weights import WEIGHT_TYPES, StoredWeight, quantize

BLOCK_TYPES = [t for t in STORED_TYPES if WEIGHT_TYPES[t][1] > 1]


@pytest.fixture(scope="module")
def device():
    return EngineRegistry().engine("vulkan").open(0)


@pytest.mark.parametrize("weight_type", STORED_TYPES)
def test_a_stored_weight_keeps_its_bytes_on_the_device(device, weight_type: str) -> None:
    rng = np.random.default_rng(0)
    cols = 256 if WEIGHT_TYPES[weight_type][1] == 256 else 96
    if weight_type == "f16":
        weight = quantize(rng.standard_normal((37, cols)).astype(np.float32), weight_type)
    else:
        weight = random_blocks(rng, weight_type, 37, cols)
    assert isinstance(weight, StoredWeight)
    (tensor,) = device.upload_weights([weight])
    assert isinstance(tensor, StoredTensor) and tensor.type == weight_type and tensor.shape == (37, cols)
    words = device.download(tensor.words)
    assert words.nbytes == -(-weight.nbytes // 4) * 4 + 4, "the stored bytes and one spare word, not float32"
    np.testing.assert_array_equal(words.view(np.uint8)[: weight.nbytes], weight.data.reshape(-1))


def test_a_type_no_kernel_reads_is_refused_by_name(device) -> None:
    bf16 = StoredWeight("bf16", (4, 32), np.zeros((4, 64), np.uint8))
    with pytest.raises(ValueError, match="not bf16"):
        device.upload_weights([bf16])


@pytest.mark.parametrize("weight_type", BLOCK_TYPES)
def test_random_blocks_read_as_the_gguf_library_dequantizes_them(device, weight_type: str) -> None:
    rng = np.random.default_rng(len(weight_type) + WEIGHT_TYPES[weight_type][2])
    cols = 512
    weight = random_blocks(rng, weight_type, 7, cols)
    dense = weight.dequantize()
    (stored,) = device.upload_weights([weight])
    x = rng.standard_normal((9, cols)).astype(np.float32)
    for variant in LINEAR_VARIANTS:
        got = device.download(device.compile("linear", variant)(device.upload(x), stored))
        np.testing.assert_allclose(got, x @ dense.T, rtol=1e-4, atol=1e-4 * np.abs(x @ dense.T).max(),
                                   err_msg=f"linear[{variant}] on {weight_type}")
    ids = np.array([6, 0, 3, 6], np.int32)
    rows = device.download(device.compile("embedding")(device.upload(ids), stored))
    np.testing.assert_allclose(rows, dense[ids], rtol=1e-6, atol=1e-7, err_msg=f"embedding on {weight_type}")
