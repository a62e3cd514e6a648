"""KV pages in float32, float16 and bfloat16: append rounds to the pool's type, attention reads the rounded
values widened to float32, host copies are arrays of the pool's type."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from pie import kernels
from pie.contract import PageLayout
from pie.plugins import Device, EngineRegistry

from pie_engine_xla.plugin import pie_kv_dtypes

HOST_TYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
LAYER, HEADS, KV_HEADS, HEAD_DIM, PAGE_SIZE = 1, 4, 2, 16, 4


@pytest.fixture(scope="module")
def xla() -> Device:
    return EngineRegistry().engine("xla").open(0)


def _layout(dtype: str) -> PageLayout:
    return PageLayout(num_layers=2, num_pages=8, page_size=PAGE_SIZE, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                      dtype=dtype)


def test_the_engine_lists_its_kv_types(xla: Device) -> None:
    assert tuple(pie_kv_dtypes(xla.info)) == tuple(HOST_TYPES)


@pytest.mark.parametrize("dtype", list(HOST_TYPES))
def test_append_and_attention_match_numpy_on_rounded_pages(xla: Device, dtype: str) -> None:
    rng = np.random.default_rng(7)
    layout = _layout(dtype)
    # Two sequences: 7 tokens on pages 3 and 1, then 5 tokens on pages 0 and 5; all of them new in this pass.
    pages, lengths = [[3, 1], [0, 5]], [7, 5]
    slots = np.array([p[t // PAGE_SIZE] * PAGE_SIZE + t % PAGE_SIZE for p, n in zip(pages, lengths) for t in range(n)],
                     np.int32)
    tokens = len(slots)
    k, v = (rng.standard_normal((tokens, KV_HEADS * HEAD_DIM)).astype(np.float32) for _ in range(2))
    q = rng.standard_normal((tokens, HEADS * HEAD_DIM)).astype(np.float32)
    qo_indptr = np.array([0, 7, 12], np.int32)
    kv_page_indices = np.array([3, 1, 0, 5], np.int32)
    kv_page_indptr = np.array([0, 2, 4], np.int32)
    kv_last_page_lens = np.array([3, 1], np.int32)
    scale = HEAD_DIM**-0.5

    reference = np.zeros(layout.shape, HOST_TYPES[dtype])
    kernels.append_kv(reference, k, v, slots, layer=LAYER)  # numpy rounds as it assigns
    expected = kernels.attention(q, reference, qo_indptr, kv_page_indices, kv_page_indptr, kv_last_page_lens,
                                 layer=LAYER, num_heads=HEADS, scale=scale)

    pool = xla.allocate_pages(layout)
    try:
        xla.compile("append_kv", layer=LAYER)(pool, xla.upload(k), xla.upload(v), xla.upload(slots))
        stored = xla.read_pages(pool, np.arange(layout.num_pages, dtype=np.int32))
        assert stored.dtype == HOST_TYPES[dtype]
        np.testing.assert_array_equal(stored, reference)
        if dtype != "float32":
            assert not np.array_equal(stored[LAYER, 3, 0, :PAGE_SIZE].astype(np.float32).reshape(PAGE_SIZE, -1),
                                      k[:PAGE_SIZE]), "16-bit pages should hold rounded keys"
        attention = xla.compile("attention", layer=LAYER, num_heads=HEADS, scale=scale)
        inputs = (q, qo_indptr, kv_page_indices, kv_page_indptr, kv_last_page_lens)
        q_t, *index = (xla.upload(a) for a in inputs)
        got = xla.download(attention(q_t, pool, *index))
        assert got.dtype == np.float32
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    finally:
        xla.free_pages(pool)


@pytest.mark.parametrize("dtype", list(HOST_TYPES))
def test_pages_round_trip_through_the_host_in_the_pool_type(xla: Device, dtype: str) -> None:
    rng = np.random.default_rng(11)
    layout = _layout(dtype)
    pool = xla.allocate_pages(layout)
    try:
        ids = np.array([2, 5, 6], np.int32)
        shape = (layout.num_layers, len(ids), *layout.shape[2:])
        data = rng.standard_normal(shape).astype(HOST_TYPES[dtype])
        xla.write_pages(pool, ids, data)
        back = xla.read_pages(pool, ids)
        assert back.dtype == HOST_TYPES[dtype]
        np.testing.assert_array_equal(back, data)

        xla.copy_pages(pool, np.array([5], np.int32), np.array([0], np.int32))
        np.testing.assert_array_equal(xla.read_pages(pool, np.array([0], np.int32)), data[:, 1:2])

        # float32 pages written to a narrower pool are rounded to it (to nearest even, as numpy casts).
        wide = rng.standard_normal((layout.num_layers, 1, *layout.shape[2:])).astype(np.float32)
        xla.write_pages(pool, np.array([7], np.int32), wide)
        np.testing.assert_array_equal(xla.read_pages(pool, np.array([7], np.int32)), wide.astype(HOST_TYPES[dtype]))
        assert xla.read_pages(pool, np.zeros(0, np.int32)).dtype == HOST_TYPES[dtype]
    finally:
        xla.free_pages(pool)


def test_an_unlisted_kv_type_is_refused(xla: Device) -> None:
    with pytest.raises(ValueError, match="XLA engine keeps KV pages in float32, float16, bfloat16, not int8"):
        xla.allocate_pages(_layout("int8"))


@pytest.mark.parametrize("dtype", list(HOST_TYPES))
def test_empty_page_lists_read_as_empty_arrays_of_the_pool_type(xla: Device, dtype: str) -> None:
    layout = _layout(dtype)
    pool = xla.allocate_pages(layout)
    try:
        none = np.zeros(0, np.int32)
        read = xla.read_pages(pool, none)
        assert read.shape == (layout.num_layers, 0, *layout.shape[2:]) and read.dtype == HOST_TYPES[dtype]
        xla.write_pages(pool, none, read)
        xla.copy_pages(pool, none, none)
        assert not xla.read_pages(pool, np.arange(layout.num_pages, dtype=np.int32)).astype(np.float32).any()
    finally:
        xla.free_pages(pool)


def test_synchronize_waits_for_a_launch_that_only_writes_the_pool(xla: Device, monkeypatch: pytest.MonkeyPatch) -> None:
    """``append_kv`` returns nothing but the pool it updates in place, and page writes and copies return
    nothing: pie_synchronize must still wait for the pool each of them leaves."""
    import jax

    waited: list[object] = []
    block = jax.block_until_ready
    monkeypatch.setattr(jax, "block_until_ready", lambda x: waited.append(x) or block(x))
    layout = _layout("float32")
    pool = xla.allocate_pages(layout)
    k = np.ones((2, KV_HEADS * HEAD_DIM), np.float32)

    def pool_awaited() -> bool:
        xla.synchronize()
        return any(leaf is pool.array for leaf in jax.tree_util.tree_leaves(waited.pop()))

    try:
        xla.compile("append_kv", layer=LAYER)(pool, xla.upload(k), xla.upload(k), xla.upload(np.array([0, 5], np.int32)))
        assert pool_awaited()
        xla.write_pages(pool, np.array([2], np.int32), np.zeros((2, 1, *layout.shape[2:]), np.float32))
        assert pool_awaited()
        xla.copy_pages(pool, np.array([2], np.int32), np.array([3], np.int32))
        assert pool_awaited()
    finally:
        xla.free_pages(pool)
