"""CPU kernels beyond the conformance kit: column-major projections, long prefills in query blocks."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from pie import kernels as reference
from pie_engine_cpu import kernels


@pytest.mark.parametrize("tokens", [1, 3, 17])
def test_rope_matches_the_reference_in_either_layout(tokens: int) -> None:
    rng = np.random.default_rng(tokens)
    qkv = kernels.project(
        rng.standard_normal((tokens, 32), dtype=np.float32), rng.standard_normal((96, 32), dtype=np.float32)
    )
    positions = rng.integers(0, 500, tokens).astype(np.int32)
    inv_freq = (1.0 / 10000 ** (np.arange(0, 16, 2) / 16)).astype(np.float32)
    rope = kernels.make_rope(16)
    for x in (qkv[:, :64], np.ascontiguousarray(qkv[:, :64]), qkv[:, 64:]):
        expected = reference.rope(np.ascontiguousarray(x), positions, inv_freq, head_dim=16)
        np.testing.assert_allclose(rope(x, positions, inv_freq), expected, rtol=1e-5, atol=1e-5)


def test_projection_is_column_major_and_equals_the_product() -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 12), dtype=np.float32)
    weight = rng.standard_normal((7, 12), dtype=np.float32)
    y = kernels.project(x, weight)
    assert y.flags.f_contiguous and not y.flags.c_contiguous
    np.testing.assert_allclose(y, x @ weight.T, rtol=1e-5, atol=1e-5)


def test_long_prefills_attend_in_query_blocks_like_the_reference() -> None:
    # Two sequences: 300 new tokens after 50 cached (a chunked prefill) and 140 from scratch, so
    # both span several query blocks and the block boundaries fall inside pages.
    rng = np.random.default_rng(3)
    page_size, kv_heads, head_dim, num_heads, layer = 16, 2, 8, 6, 1
    pool = rng.standard_normal((2, 40, 2, page_size, kv_heads, head_dim), dtype=np.float32)
    lengths, new = [350, 140], [300, 140]
    pages = rng.permutation(40)[: sum(-(-n // page_size) for n in lengths)].astype(np.int32)
    counts = [-(-n // page_size) for n in lengths]
    batch = {
        "qo_indptr": np.array([0, new[0], new[0] + new[1]], np.int32),
        "kv_page_indices": pages,
        "kv_page_indptr": np.array([0, counts[0], counts[0] + counts[1]], np.int32),
        "kv_last_page_lens": np.array([n - (c - 1) * page_size for n, c in zip(lengths, counts)], np.int32),
    }
    q = rng.standard_normal((sum(new), num_heads * head_dim), dtype=np.float32)
    expected = reference.attention(q, pool, **batch, layer=layer, num_heads=num_heads, scale=0.3)
    got = kernels.make_attention(layer, num_heads, 0.3)(q, pool, *batch.values())
    assert sum(new) > 2 * kernels.QUERY_BLOCK
    np.testing.assert_allclose(got, expected, rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("new", [[1, 1, 1], [3, 0, 2], [2, 0, 1]], ids=["decode", "ragged", "ragged-as-many-rows-as-sequences"])
def test_attention_in_a_pass_reads_the_plans_lengths(new: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside a pass the numpy attention takes each sequence's lengths from the plan, outside it from its arrays;
    both give the reference's result."""
    from pie.contract import PassPlan

    rng = np.random.default_rng(7)
    page_size, lengths = 4, [6, 9, 3]
    pool = rng.standard_normal((1, 8, 2, page_size, 2, 8), dtype=np.float32)
    counts = [-(-n // page_size) for n in lengths]
    i32 = np.int32
    qo_indptr = np.concatenate(([0], np.cumsum(new))).astype(i32)
    batch = (qo_indptr, np.arange(sum(counts), dtype=i32), np.concatenate(([0], np.cumsum(counts))).astype(i32),
             np.array([n - (c - 1) * page_size for n, c in zip(lengths, counts, strict=True)], i32))
    tokens = int(qo_indptr[-1])
    plan = PassPlan.from_batch(ids=np.zeros(tokens, i32), positions=np.zeros(tokens, i32), slots=np.zeros(tokens, i32),
                               qo_indptr=batch[0], kv_page_indices=batch[1], kv_page_indptr=batch[2],
                               kv_last_page_lens=batch[3], sample_rows=np.zeros(1, i32), page_size=page_size)
    q = rng.standard_normal((tokens, 32), dtype=np.float32)
    expected = reference.attention(q, pool, *batch, layer=0, num_heads=4, scale=0.3)
    attention = kernels.make_attention(0, 4, 0.3)
    np.testing.assert_allclose(attention(q, pool, *batch), expected, rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(kernels, "check_page_table_values", lambda *a, **k: pytest.fail("recomputed the plan's lengths"))
    kernels.begin_pass(plan)
    try:
        np.testing.assert_allclose(attention(q, pool, *batch), expected, rtol=1e-5, atol=1e-5)
    finally:
        kernels.end_pass()


def test_each_thread_launches_from_the_pass_it_began() -> None:
    """A replicated group's leader and follower in one process run passes at once, on two threads: with one running
    pass a process, a launch of one read the other's page tables and slots (the follower's pool missed KV writes the
    leader's had: CI at a41b6b4)."""
    plans, seen = [object(), object()], []
    both_began = threading.Barrier(2, timeout=30)

    def run(plan: object) -> None:
        kernels.begin_pass(plan)  # type: ignore[arg-type]  # the facts hold the plan as given
        both_began.wait()
        running = kernels.running_pass()
        seen.append((plan, None if running is None else running.plan))
        both_began.wait()
        kernels.end_pass()

    threads = [threading.Thread(target=run, args=(plan,)) for plan in plans]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert len(seen) == 2 and all(began is running for began, running in seen), seen
    assert kernels.running_pass() is None, "a pass another thread began is not this thread's"


def test_silu_mul_of_large_negative_gates_is_zero_without_an_overflow_warning() -> None:
    gate_up = np.array([[-100.0, -1000.0, 0.5, 3.0, 2.0, 4.0]], dtype=np.float32)
    with np.errstate(all="raise"):
        got = kernels.silu_mul(gate_up)
    np.testing.assert_allclose(got, reference.silu_mul(gate_up), rtol=1e-6, atol=0)
    assert got.dtype == np.float32 and got[0, 0] == 0 and got[0, 1] == 0
