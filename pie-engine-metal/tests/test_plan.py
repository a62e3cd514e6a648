"""Dispatch sizes per kernel and shape (pure functions of pie_engine_metal.plan)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pie_engine_metal import plan


def _covers(groups: plan.Size, threads: plan.Size, domain: tuple[int, int, int]) -> bool:
    return all(g * t >= d and (g - 1) * t < d for g, t, d in zip(groups, threads, domain, strict=True))


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 5000), st.integers(1, 600))
def test_elementwise_grids_cover_the_domain_with_at_most_one_partial_group(cols: int, rows: int) -> None:
    groups, threads = plan.grid_2d(cols, rows)
    assert threads[0] * threads[1] * threads[2] <= plan.MAX_THREADS
    assert _covers(groups, threads, (cols, rows, 1))
    groups, threads = plan.grid_1d(cols * rows)
    assert _covers(groups, threads, (cols * rows, 1, 1))
    groups, threads = plan.grid_rope(cols % 128 + 1, rows % 40 + 1, rows)
    assert groups[2] == rows and _covers(groups, threads, (cols % 128 + 1, rows % 40 + 1, rows))


def test_small_rows_share_a_threadgroup() -> None:
    assert plan.grid_2d(64, 3) == ((1, 1, 1), (64, 4, 1))
    assert plan.grid_2d(1000, 1) == ((4, 1, 1), (256, 1, 1))
    assert plan.grid_1d(5) == ((1, 1, 1), (8, 1, 1))
    assert plan.grid_1d(1000) == ((4, 1, 1), (256, 1, 1))


@pytest.mark.parametrize(
    ("cols", "width", "max_threads", "expected"),
    [
        (3, 32, 1024, 32),  # at least one simdgroup
        (64, 32, 1024, 64),
        (576, 32, 1024, 1024),
        (49152, 32, 1024, 1024),
        (49152, 32, 512, 512),  # the pipeline's own limit
        (49152, 8, 1024, 256),  # at most 32 simdgroups meet in threadgroup memory
    ],
)
def test_row_reductions(cols: int, width: int, max_threads: int, expected: int) -> None:
    assert plan.row_threads(cols, width, max_threads) == expected
    assert plan.grid_rows(7, cols, width, max_threads) == ((7, 1, 1), (expected, 1, 1))


def test_projection_grids() -> None:
    # GEMV: one simdgroup per output feature, four per threadgroup.
    assert plan.grid_linear("gemv", 1, 576, 32) == ((144, 1, 1), (128, 1, 1))
    assert plan.grid_linear("gemv", 3, 49152, 64) == ((12288, 1, 1), (256, 1, 1))
    # GEMM: 32 x 32 output tiles, columns on x.
    assert plan.grid_linear("tiled", 17, 160, 32) == ((5, 1, 1), (16, 16, 1))
    assert plan.grid_linear("simdgroup", 100, 1536, 32) == ((48, 4, 1), (128, 1, 1))
    with pytest.raises(ValueError, match="32-lane"):
        plan.grid_linear("simdgroup", 100, 1536, 64)


def test_attention_grids() -> None:
    assert plan.grid_attention("decode", 5, 9, 64, 32) == ((9, 5, 1), (128, 1, 1))
    assert plan.grid_attention("prefill", 17, 9, 64, 32) == ((9, 3, 1), (256, 1, 1))
    assert plan.grid_attention("prefill", 17, 9, 64, 64) == ((9, 5, 1), (256, 1, 1))
    assert plan.grid_attention("prefill", 17, 9, 64, 16) == ((9, 3, 1), (128, 1, 1))
    assert plan.grid_attention("decode", 1, 32, 256, 32)[1] == (128, 1, 1)


@pytest.mark.parametrize(
    ("kind", "head_dim", "width", "message"),
    [
        ("decode", 264, 64, "up to 256"),
        ("decode", 256, 16, "up to 128"),
        ("prefill", 192, 32, "up to 128"),
        ("decode", 64, 128, "up to 64 lanes"),
    ],
)
def test_attention_limits_are_clear_errors(kind: plan.AttentionKind, head_dim: int, width: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        plan.grid_attention(kind, 4, 8, head_dim, width)
