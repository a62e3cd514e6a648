"""Grid and block of every kernel, computed from the shapes of one call.

The constants mirror the ``#define``s of the kernels (threads per block, tiles);
each function returns a :class:`LaunchConfig` that a bound launch takes as
``launch(*config)``.
"""

from __future__ import annotations

from typing import NamedTuple

MAX_GRID_X = 2**31 - 1
MAX_GRID_YZ = 65535

ELEMENTWISE_THREADS = 256
ROW_THREADS = 256
ROPE_THREADS = 128
APPEND_THREADS = 128
PAGE_THREADS = 256
GEMV_THREADS = 128
GEMV_ROWS = 8
TILE_M = 64
TILE_N = 64
SIMT_THREADS = 256
TC_THREADS = 256
TC_ROUND_K = 64
"""k a round of the tensor-core GEMM covers (its two warp groups, a k-step of 32 each)."""
SPLIT_SLOT_FLOATS = TILE_M * TILE_N + TILE_M
"""Floats of one block's slot when a tensor-core GEMM is split along k: its tile and row sums of squares."""
SPLIT_BLOCKS_PER_MULTIPROCESSOR = 2
ATTENTION_THREADS = 128
MAX_HEAD_DIM = 256
PREFILL_SLOTS = 16


class LaunchConfig(NamedTuple):
    grid_x: int
    grid_y: int
    grid_z: int
    block_x: int
    block_y: int
    block_z: int
    shared: int = 0


class LaunchError(ValueError):
    """A call whose shapes no grid can cover."""


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _config(grid: tuple[int, int, int], threads: int, shared: int = 0) -> LaunchConfig:
    gx, gy, gz = grid
    if not (1 <= gx <= MAX_GRID_X and 1 <= gy <= MAX_GRID_YZ and 1 <= gz <= MAX_GRID_YZ):
        raise LaunchError(f"grid {grid} is empty or exceeds the limits ({MAX_GRID_X}, {MAX_GRID_YZ}, {MAX_GRID_YZ})")
    return LaunchConfig(gx, gy, gz, threads, 1, 1, shared)


def elementwise(n: int) -> LaunchConfig:
    """One thread per element (add, silu_mul, slice_columns, gathers, conversions)."""
    return _config((_ceil(n, ELEMENTWISE_THREADS), 1, 1), ELEMENTWISE_THREADS)


def grid_stride(items: int, max_blocks: int) -> LaunchConfig:
    """ELEMENTWISE_THREADS threads a block, at most ``max_blocks`` blocks: each thread loops over items."""
    return _config((max(1, min(max_blocks, _ceil(items, ELEMENTWISE_THREADS))), 1, 1), ELEMENTWISE_THREADS)


def per_row(rows: int) -> LaunchConfig:
    """One block per row (rms_norm, argmax, softmax)."""
    return _config((rows, 1, 1), ROW_THREADS)


def rope(tokens: int, heads: int, head_dim: int) -> LaunchConfig:
    return _config((tokens, _ceil(heads * (head_dim // 2), ROPE_THREADS), 1), ROPE_THREADS)


def qkv_rope(tokens: int, items: int) -> LaunchConfig:
    """A thread per rotated pair of q and k and per value of v, token by token along x."""
    return _config((tokens, _ceil(items, ROPE_THREADS), 1), ROPE_THREADS)


def append_kv(tokens: int, width: int) -> LaunchConfig:
    return _config((tokens, _ceil(width, APPEND_THREADS), 1), APPEND_THREADS)


def copy_pages(page_elems: int, count: int, layers: int) -> list[tuple[int, LaunchConfig]]:
    """(first page index, config) per chunk: grid.y counts pages and stops at 65535."""
    chunks = []
    for first in range(0, count, MAX_GRID_YZ):
        pages = min(MAX_GRID_YZ, count - first)
        chunks.append((first, _config((_ceil(page_elems, PAGE_THREADS), pages, layers), PAGE_THREADS)))
    return chunks


def gemv(out_cols: int, rows: int, warp_size: int) -> LaunchConfig:
    """A warp per output column, GEMV_ROWS rows per block along y."""
    return _config((_ceil(out_cols, GEMV_THREADS // warp_size), _ceil(rows, GEMV_ROWS), 1), GEMV_THREADS)


def gemm(out_cols: int, rows: int, paired: bool, tensor_cores: bool, splits: int = 1) -> LaunchConfig:
    """64x64 tiles; a paired (gate/up) tile yields 32 output columns; ``splits`` blocks along k
    (tensor cores only, see :func:`gemm_splits`)."""
    cols_per_block = TILE_N // 2 if paired else TILE_N
    threads = TC_THREADS if tensor_cores else SIMT_THREADS
    return _config((_ceil(out_cols, cols_per_block), _ceil(rows, TILE_M), splits), threads)


def gemm_splits(tiles: int, k: int, multiprocessors: int) -> int:
    """Blocks along k per output tile of a tensor-core GEMM: enough for SPLIT_BLOCKS_PER_MULTIPROCESSOR
    blocks on every multiprocessor, at most one per round of k. A decode batch's grid is a few dozen
    tiles (15 for a 960-column QKV at 32 rows, on 132 multiprocessors); a prompt's fills the GPU (1)."""
    wanted = _ceil(SPLIT_BLOCKS_PER_MULTIPROCESSOR * multiprocessors, tiles)
    return max(1, min(wanted, _ceil(k, TC_ROUND_K), MAX_GRID_YZ))


def attention_per_token(tokens: int, num_heads: int) -> LaunchConfig:
    """Decode and the split-KV merge: a block per (token, query head)."""
    return _config((tokens, num_heads, 1), ATTENTION_THREADS)


def attention_items(items: int, num_heads: int, shared: int = 0) -> LaunchConfig:
    """Split-KV chunks and prefill tiles: a block per (planned item, query head)."""
    return _config((items, num_heads, 1), ATTENTION_THREADS, shared)


def prefill_tiles(head_dim: int) -> tuple[int, int, int]:
    """(block_q, block_k, shared bytes) for the prefill kernel: each thread keeps at most
    PREFILL_SLOTS output values, and shared memory stays under the 48 KiB every GPU offers."""
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise LaunchError(f"head_dim {head_dim} is outside 1..{MAX_HEAD_DIM}")
    block_q = min(32, ATTENTION_THREADS * PREFILL_SLOTS // head_dim)
    block_k = 32 if head_dim <= 128 else 16
    floats = block_q * head_dim + block_k * (head_dim + 1) + block_k * head_dim + block_q * block_k + 3 * block_q
    return block_q, block_k, 4 * floats
