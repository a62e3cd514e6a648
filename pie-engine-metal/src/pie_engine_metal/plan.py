"""Dispatch sizes: threadgroups and threads per threadgroup for each kernel and shape.

Pure functions of shapes and the pipeline's simdgroup width, so they are tested
directly. Every dispatch uses whole threadgroups (``dispatchThreadgroups``), which
every Metal GPU supports; kernels check their own bounds.
"""

from __future__ import annotations

from typing import Literal

Size = tuple[int, int, int]

MAX_THREADS = 256
"""Threads per threadgroup for the simple kernels: safe for any pipeline's register use."""
TILE = 32
GEMV_SIMDGROUPS = 4
DECODE_SIMDGROUPS = 4
PREFILL_MAX_QUERIES = 8
DIMS_PER_LANE = 8
MAX_WIDTH = 64
ROWS_MAX_SIMDGROUPS = 32
DECODE_MAX_HEAD_DIM = 256
PREFILL_MAX_HEAD_DIM = 128

LinearStrategy = Literal["gemv", "tiled", "simdgroup"]
AttentionKind = Literal["decode", "prefill"]
ATTENTION_KINDS: tuple[AttentionKind, ...] = ("decode", "prefill")


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def grid_1d(count: int) -> tuple[Size, Size]:
    threads = min(MAX_THREADS, next_pow2(count))
    return (ceil_div(count, threads), 1, 1), (threads, 1, 1)


def grid_2d(cols: int, rows: int) -> tuple[Size, Size]:
    """Thread (x, y) = (column, row): a threadgroup covers a block of whole rows when they are short."""
    tx = min(MAX_THREADS, next_pow2(cols))
    ty = min(MAX_THREADS // tx, next_pow2(rows))
    return (ceil_div(cols, tx), ceil_div(rows, ty), 1), (tx, ty, 1)


def grid_rope(half_dim: int, heads: int, tokens: int) -> tuple[Size, Size]:
    tx = min(MAX_THREADS, next_pow2(half_dim))
    ty = min(MAX_THREADS // tx, next_pow2(heads))
    return (ceil_div(half_dim, tx), ceil_div(heads, ty), tokens), (tx, ty, 1)


def row_threads(cols: int, simd_width: int, max_threads: int) -> int:
    """Threads for one row reduction: enough to cover the row, at most 1024 and 32 simdgroups."""
    limit = min(max_threads, 1024, ROWS_MAX_SIMDGROUPS * simd_width)
    return max(min(simd_width, limit), min(limit, next_pow2(cols)))


def grid_rows(rows: int, cols: int, simd_width: int, max_threads: int) -> tuple[Size, Size]:
    return (rows, 1, 1), (row_threads(cols, simd_width, max_threads), 1, 1)


def grid_linear(strategy: LinearStrategy, tokens: int, out_features: int, simd_width: int) -> tuple[Size, Size]:
    if strategy == "gemv":
        return (ceil_div(out_features, GEMV_SIMDGROUPS), 1, 1), (GEMV_SIMDGROUPS * simd_width, 1, 1)
    groups = (ceil_div(out_features, TILE), ceil_div(tokens, TILE), 1)
    if strategy == "tiled":
        return groups, (16, 16, 1)
    if simd_width != 32:
        raise ValueError(f"simdgroup matrices need 32-lane simdgroups, this pipeline has {simd_width}")
    return groups, (128, 1, 1)


def prefill_queries(simd_width: int) -> int:
    """Query tokens per prefill threadgroup: one simdgroup each, at most 256 threads."""
    return max(1, min(PREFILL_MAX_QUERIES, MAX_THREADS // simd_width))


def grid_attention(
    kind: AttentionKind, tokens: int, num_heads: int, head_dim: int, simd_width: int
) -> tuple[Size, Size]:
    if simd_width > MAX_WIDTH:
        raise ValueError(f"attention supports simdgroups of up to {MAX_WIDTH} lanes, not {simd_width}")
    limit = min(DIMS_PER_LANE * simd_width, DECODE_MAX_HEAD_DIM if kind == "decode" else PREFILL_MAX_HEAD_DIM)
    if head_dim > limit:
        raise ValueError(
            f"{kind} attention supports head_dim up to {limit} with {simd_width}-lane simdgroups, not {head_dim}"
        )
    if kind == "decode":
        return (num_heads, tokens, 1), (DECODE_SIMDGROUPS * simd_width, 1, 1)
    queries = prefill_queries(simd_width)
    return (num_heads, ceil_div(tokens, queries), 1), (queries * simd_width, 1, 1)
