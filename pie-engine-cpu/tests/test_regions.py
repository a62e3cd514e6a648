"""The attention-input region as one native call equals its kernels run one by one."""

from __future__ import annotations

import numpy as np
import pytest
from pie import kernels as reference
from pie.contract import RegionOp, RegionRequest
from pie.testing.regions import attention_input_arguments, attention_input_region
from pie_engine_cpu import native
from pie_engine_cpu.regions import compile_region

Q, KV, HEAD_DIM, HIDDEN = 96, 32, 16, 48


def _region(bias: bool) -> RegionRequest:
    return attention_input_region(Q, KV, HEAD_DIM, bias)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("tokens", [1, 5, 16, 17, 32, 33, 40])
def test_the_fused_region_equals_its_kernels(tokens: int, bias: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native.load(), "max_rows", 32)  # read as the region compiles: 33 and 40 rows go to BLAS
    args = attention_input_arguments(Q, KV, HEAD_DIM, HIDDEN, tokens, bias)
    x, ln, w, positions, inv_freq = *args[:3], *args[-2:]
    launcher = compile_region(_region(bias))
    assert launcher is not None
    v, q_rot, k_rot = launcher(*args)
    qkv = reference.linear(reference.rms_norm(x, ln, eps=1e-5), w, args[3] if bias else None)
    expected_q = reference.rope(qkv[:, :Q], positions, inv_freq, head_dim=HEAD_DIM)
    expected_k = reference.rope(np.ascontiguousarray(qkv[:, Q : Q + KV]), positions, inv_freq, head_dim=HEAD_DIM)
    for got, expected in ((q_rot, expected_q), (k_rot, expected_k), (v, qkv[:, Q + KV :])):
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


def test_other_regions_are_lowered_kernel_by_kernel() -> None:
    region = _region(False)
    assert compile_region(RegionRequest("L0.attention", region.ops[:2], region.inputs, ("qkv",))) is None
    swapped = list(region.ops)
    swapped[5] = RegionOp("rope", ("k", "positions", "inv_freq"), "q_rot", (("head_dim", HEAD_DIM),))
    assert compile_region(RegionRequest("L0.attn_in", tuple(swapped), region.inputs, region.outputs)) is None
    overlapping = list(region.ops)
    overlapping[3] = RegionOp("slice_columns", ("qkv",), "k", (("start", Q - 8), ("stop", Q + KV - 8)))
    assert compile_region(RegionRequest("L0.attn_in", tuple(overlapping), region.inputs, region.outputs)) is None


@pytest.mark.parametrize("options", [(), (("window", 6), ("softcap", 2.0))], ids=["plain", "window-softcap"])
@pytest.mark.parametrize(("lengths", "new"), [([37, 5, 64], [1, 1, 1]), ([30, 8], [3, 1])], ids=["decode", "prefill"])
def test_append_and_attend_as_one_launch_equals_the_two_kernels(lengths: list[int], new: list[int], options: tuple) -> None:
    from pie_engine_cpu import kernels
    from test_native import _paged_batch

    q, pool, qo, indices, indptr, last = _paged_batch(lengths, new, seed=7)
    rng = np.random.default_rng(8)
    k = rng.standard_normal((q.shape[0], 2 * 16), dtype=np.float32)
    v = rng.standard_normal((q.shape[0], 2 * 16), dtype=np.float32)
    slots = np.array([int(indices[indptr[b + 1] - 1]) * 4 + int(last[b]) - 1 - j for b in range(len(new)) for j in reversed(range(new[b]))], np.int32)
    ops = (
        RegionOp("append_kv", ("pool", "k", "v", "slots"), None, (("layer", 1),)),
        RegionOp("attention", ("q", "pool", "qo", "indices", "indptr", "last"), "out", (("layer", 1), ("num_heads", 6), ("scale", 0.25), *options)),
    )
    region = RegionRequest("L1.attention", ops, ("pool", "k", "v", "slots", "q", "qo", "indices", "indptr", "last"), ("out",))
    launcher = compile_region(region)
    assert launcher is not None
    expected_pool = pool.copy()
    kernels.make_append_kv(1)(expected_pool, k, v, slots)
    expected = kernels.make_attention(1, 6, 0.25, **dict(options))(q, expected_pool, qo, indices, indptr, last)
    (got,) = launcher(pool, k, v, slots, q, qo, indices, indptr, last)
    np.testing.assert_array_equal(pool, expected_pool)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
