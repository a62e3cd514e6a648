"""Attention is timed both as one prompt and as a decode batch, and a variant replaces the default
in a bucket only if it wins on both."""

from __future__ import annotations

import numpy as np
from pie import kernels
from pie.profiles.tuner import Cell, CellResult, _kernel_tuning
from pie.profiles.workloads import (
    CACHED_TOKENS,
    DECODE_ATTENTION,
    LONG_CACHED_TOKENS,
    PAGE_SIZE,
    Dims,
    launch_inputs,
    sites,
)

DIMS = Dims(hidden=64, intermediate=128, heads=4, kv_heads=2, head_dim=16, vocab=400)


def _attention_sites() -> dict[str, object]:
    return {site.label: site for site in sites(DIMS) if site.kernel == "attention"}


def test_both_attention_sites_share_their_buckets() -> None:
    found = _attention_sites()
    long = f"_kv{LONG_CACHED_TOKENS}"
    assert set(found) == {"attention", DECODE_ATTENTION, "attention" + long, DECODE_ATTENTION + long}
    assert len({site.size for site in found.values()}) == 1
    assert found["attention"].min_kv_tokens == found[DECODE_ATTENTION].min_kv_tokens == 0
    assert found["attention" + long].min_kv_tokens == found[DECODE_ATTENTION + long].min_kv_tokens == 4096


def test_the_decode_site_is_a_batch_of_one_new_token_each_after_the_cached_ones() -> None:
    rows = 5
    launch = launch_inputs(_attention_sites()[DECODE_ATTENTION], rows, DIMS, np.random.default_rng(0))
    q, pool, qo_indptr, page_indices, page_indptr, last_lens = launch.args
    assert pool is None and launch.pool_index == 1 and q.shape == (rows, DIMS.heads * DIMS.head_dim)
    assert qo_indptr.tolist() == list(range(rows + 1))
    lengths = (np.diff(page_indptr) - 1) * PAGE_SIZE + last_lens
    assert lengths.tolist() == [CACHED_TOKENS + 1] * rows
    assert sorted(page_indices.tolist()) == list(range(launch.layout.num_pages))
    # The batch runs through the reference kernel: every sequence attends its own pages.
    pages = np.random.default_rng(1).standard_normal(launch.layout.shape[1:], dtype=np.float32)
    out = kernels.attention(q, pages[None], qo_indptr, page_indices, page_indptr, last_lens,
                            num_heads=DIMS.heads, scale=0.25, layer=0)
    assert out.shape == q.shape and np.isfinite(out).all()


def _result(default_us: float, variant_us: float) -> CellResult:
    jitter = np.linspace(0.99, 1.01, 9)
    return CellResult({"auto": [int(default_us * 1e3 * j) for j in jitter],
                       "split": [int(variant_us * 1e3 * j) for j in jitter]})


def test_a_variant_that_loses_on_decode_batches_keeps_the_default() -> None:
    found = _attention_sites()
    prompt, decode = found["attention"], found[DECODE_ATTENTION]
    measured = [
        (Cell(prompt, 4), _result(default_us=90.0, variant_us=15.0)),  # one 4-token prompt: split wins
        (Cell(decode, 4), _result(default_us=15.0, variant_us=20.0)),  # four decodes: split loses
        (Cell(prompt, 8), _result(default_us=90.0, variant_us=15.0)),
        (Cell(decode, 8), _result(default_us=30.0, variant_us=12.0)),  # wins on both at 8 rows
    ]
    tuning = _kernel_tuning("attention", ("auto", "split"), measured, margin=0.05)
    assert tuning is not None
    assert {bucket.rows: bucket.variant for bucket in tuning.buckets} == {4: "auto", 8: "split"}
