"""The attention-input region in two launches equals its kernels run one by one on the same device."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from pie.contract import RegionRequest
from pie.plugins import Device
from pie.testing.regions import attention_input_arguments, described_attention_input_region

Q, KV, HEAD_DIM, HIDDEN = 96, 32, 16, 48


def _region(bias: bool, **options: object) -> RegionRequest:
    return described_attention_input_region(Q, KV, HEAD_DIM, HIDDEN, bias, **options)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("tokens", [0, 1, 5, 40])
def test_the_fused_region_equals_its_kernels(emulated_device: Device, tokens: int, bias: bool) -> None:
    device = emulated_device
    values = [device.upload(a) for a in attention_input_arguments(Q, KV, HEAD_DIM, HIDDEN, tokens, bias)]
    launcher = device.compile_region(_region(bias))
    assert launcher is not None
    v, q_rot, k_rot = (device.download(t) for t in launcher(*values))

    x_, ln_, w_ = values[:3]
    b_ = values[3] if bias else None
    # The region's projection runs the variant the default profile gives rms_norm_linear: GEMV up to 16 rows.
    variant = "gemv" if tokens <= 16 else device.kernels()["rms_norm_linear"][0]
    qkv = device.compile("rms_norm_linear", variant, eps=1e-5)(x_, ln_, w_, b_)
    on_device_positions, on_device_inv_freq = values[-2], values[-1]
    expected = []
    for start, stop, rotate in ((0, Q, True), (Q, Q + KV, True), (Q + KV, Q + 2 * KV, False)):
        part = device.compile("slice_columns", None, start=start, stop=stop)(qkv)
        if rotate:
            part = device.compile("rope", None, head_dim=HEAD_DIM)(part, on_device_positions, on_device_inv_freq)
        expected.append(device.download(part))
    for got, want in zip((q_rot, k_rot, v), expected):
        assert got.shape == want.shape
        np.testing.assert_array_equal(got, want)


def test_other_regions_are_lowered_kernel_by_kernel(emulated_device: Device) -> None:
    compile_region = emulated_device.compile_region
    region = _region(False)
    assert compile_region(RegionRequest("L0.x", region.ops[:2], region.inputs, ("qkv",))) is None
    assert compile_region(replace(region, attention_input=None)) is None, "the same ops without a description"
    assert compile_region(_region(False, qk_norm=True)) is None, "per-head Q/K norms: not in pie_qkv_rope"
    odd = described_attention_input_region(90, 30, 15, HIDDEN, False)
    assert compile_region(odd) is None, "pie_qkv_rope rotates heads of even size"
    assert compile_region(replace(region, outputs=("q_rot", "k_rot"))) is None, "not exactly q, k and v"
