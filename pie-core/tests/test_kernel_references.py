"""The catalogue's references for the attention options and the per-head norm, against dense formulations."""

from __future__ import annotations

import numpy as np
import pytest
from pie import kernels
from pie.testing.conformance import batch_of


def _dense_attention(q, keys, values, scale, window, softcap):
    """One sequence, one head, every query the last ones of the keys: Hugging Face's masks as written there
    (causal ``kv_idx <= q_idx``, sliding ``kv_idx > q_idx - sliding_window``), soft-capping before them."""
    q_len, kv_len = q.shape[0], keys.shape[0]
    scores = (q.astype(np.float64) @ keys.astype(np.float64).T) * scale
    if softcap:
        scores = softcap * np.tanh(scores / softcap)
    q_idx = np.arange(kv_len - q_len, kv_len)[:, None]
    kv_idx = np.arange(kv_len)[None, :]
    allowed = kv_idx <= q_idx
    if window:
        allowed &= kv_idx > q_idx - window
    scores = np.where(allowed, scores, -np.inf)
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return (weights / weights.sum(axis=-1, keepdims=True)) @ values


@pytest.mark.parametrize(("window", "softcap"), [(0, 0.0), (3, 0.0), (0, 0.9), (5, 2.0), (1, 0.0)])
def test_attention_reference_is_the_masked_dense_softmax(window: int, softcap: float) -> None:
    rng = np.random.default_rng(window * 10 + int(softcap * 10))
    page_size, head_dim = 4, 8
    batch = batch_of(rng, page_size, 16, [(14, 6), (9, 1)])
    pool = rng.standard_normal((1, 16, 2, page_size, 1, head_dim)).astype(np.float32)
    q = rng.standard_normal((7, 2 * head_dim)).astype(np.float32)
    got = kernels.attention(q, pool, **batch, layer=0, num_heads=2, scale=0.4, window=window, softcap=softcap)
    for b, (start, stop) in enumerate([(0, 6), (6, 7)]):
        pages = batch["kv_page_indices"][batch["kv_page_indptr"][b] : batch["kv_page_indptr"][b + 1]]
        kv_len = (len(pages) - 1) * page_size + int(batch["kv_last_page_lens"][b])
        keys = pool[0, pages, 0].reshape(-1, head_dim)[:kv_len]
        values = pool[0, pages, 1].reshape(-1, head_dim)[:kv_len]
        for h in range(2):
            want = _dense_attention(q[start:stop, h * head_dim : (h + 1) * head_dim], keys, values, 0.4, window, softcap)
            np.testing.assert_allclose(got[start:stop, h * head_dim : (h + 1) * head_dim], want, rtol=1e-5, atol=1e-6)


def test_rms_norm_heads_normalizes_each_head_alone() -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 4 * 8)).astype(np.float32)
    x[:, 8:16] *= 100  # one loud head must not change the others
    weight = rng.standard_normal(8).astype(np.float32)
    got = kernels.rms_norm_heads(x, weight, eps=1e-6, head_dim=8)
    for h in range(4):
        np.testing.assert_allclose(
            got[:, h * 8 : (h + 1) * 8], kernels.rms_norm(x[:, h * 8 : (h + 1) * 8], weight, eps=1e-6), rtol=1e-6
        )


def test_rms_norm_heads_names_a_head_dim_that_does_not_divide_the_width() -> None:
    with pytest.raises(ValueError, match="rms_norm_heads: width 32 is not whole heads of 24"):
        kernels.rms_norm_heads(np.zeros((1, 32), np.float32), np.ones(24, np.float32), eps=1e-6, head_dim=24)


@pytest.mark.parametrize(
    ("options", "match"),
    [({"window": -2}, "window must be a non-negative int"), ({"window": 3.0}, "window"),
     ({"softcap": -1.0}, "softcap must be a finite non-negative"), ({"softcap": float("inf")}, "softcap")],
)
def test_attention_options_out_of_range_are_named(options: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        kernels.attention_options(**options)


def test_absent_attention_options_are_off() -> None:
    assert kernels.attention_options() == (0, 0.0)
    assert kernels.attention_options(None, None) == (0, 0.0)
    assert kernels.attention_options(np.int64(4), 30) == (4, 30.0)


def test_the_epilogue_launcher_passes_inputs_in_declared_order_with_its_params_bound() -> None:
    from pie import eta

    program = eta.compile("in x: f32; in b: f32[cols]; param t: f32; out y = x * b / t; out z = x")
    calls = []

    def run(**named: np.ndarray) -> dict[str, np.ndarray]:
        calls.append(named)
        return program.numpy_fn()(**named)

    launch = kernels.epilogue_launcher(program, (("t", 2.0),), run)
    x, b = np.ones((2, 3), np.float32), np.arange(3, dtype=np.float32)
    np.testing.assert_array_equal(launch(x, b), x * b / 2)  # the first output only
    assert list(calls[0]) == ["x", "b", "t"] and calls[0]["b"] is b


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_rotary_tables_take_float32_angles_in_the_asked_type(dtype: type) -> None:
    positions, inv_freq = np.array([0, 3], np.int32), np.array([1.0, 0.1], np.float32)
    cos, signed_sin = kernels.rotary_tables(positions, inv_freq, dtype)
    assert cos.dtype == signed_sin.dtype == dtype and cos.shape == signed_sin.shape == (2, 4)
    angles = (np.float32(3) * inv_freq).astype(dtype)
    np.testing.assert_array_equal(cos[1], np.cos(np.concatenate((angles, angles))))
    np.testing.assert_array_equal(signed_sin[1], np.concatenate((-np.sin(angles), np.sin(angles))))
    assert (cos[0] == 1).all() and (signed_sin[0] == 0).all()
