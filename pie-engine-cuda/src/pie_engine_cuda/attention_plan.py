"""Host-side planning of attention work (FlashInfer's "plan" step), from the batch description.

The batch arrays are uploaded from host arrays every step, so their host copies
are at hand: the launcher plans once per forward pass (the plan is cached on the
``qo_indptr`` tensor and reused by every layer) and uploads a small item list.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

I32 = np.int32


def kv_lengths(page_indptr: np.ndarray, last_lens: np.ndarray, page_size: int) -> np.ndarray:
    pages = np.diff(page_indptr.astype(np.int64))
    return np.where(pages > 0, (pages - 1) * page_size + last_lens.astype(np.int64), 0)


def prefill_items(qo_indptr: np.ndarray, block_q: int) -> np.ndarray:
    """[items, 3] = (sequence, first token, token count <= block_q): each sequence's new tokens in tiles."""
    items: list[tuple[int, int, int]] = []
    for b in range(len(qo_indptr) - 1):
        start, stop = int(qo_indptr[b]), int(qo_indptr[b + 1])
        items.extend((b, first, min(block_q, stop - first)) for first in range(start, stop, block_q))
    return np.asarray(items, dtype=I32).reshape(-1, 3)


def split_items(
    qo_indptr: np.ndarray, kv_lens: np.ndarray, chunk: int, window: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Each token's visible keys (the last ``window`` of them, with a window) cut into chunks:
    ([items, 3] = (token, first key, end key), item_ptr [T+1])."""
    items: list[tuple[int, int, int]] = []
    item_ptr = [0]
    for b in range(len(qo_indptr) - 1):
        start, stop = int(qo_indptr[b]), int(qo_indptr[b + 1])
        q_len, kv_len = stop - start, int(kv_lens[b])
        for t in range(start, stop):
            visible = kv_len - q_len + (t - start) + 1
            first = visible - window if 0 < window < visible else 0
            items.extend((t, k, min(k + chunk, visible)) for k in range(first, visible, chunk))
            item_ptr.append(len(items))
    return np.asarray(items, dtype=I32).reshape(-1, 3), np.asarray(item_ptr, dtype=I32)


@dataclass(frozen=True)
class BatchStats:
    max_q_len: int
    max_kv_len: int


def batch_stats(qo_indptr: np.ndarray, kv_lens: np.ndarray) -> BatchStats:
    q = np.diff(qo_indptr.astype(np.int64))
    return BatchStats(int(q.max(initial=0)), int(kv_lens.max(initial=0)))


SPLIT_CHUNK = 256
"""Keys per split-KV item."""

SPLIT_MIN_KV = 1024
"""The automatic choice splits only sequences at least this long..."""

SPLIT_MAX_BLOCKS_PER_SM = 4
"""...and only when decode would give each multiprocessor fewer blocks than this."""


def choose_attention(stats: BatchStats, tokens: int, num_heads: int, multiprocessors: int) -> str:
    """The variant ``auto`` runs: prefill tiles when any sequence brings several tokens, split-KV
    for long contexts that leave the GPU idle, the per-token decode kernel otherwise."""
    if stats.max_q_len > 1:
        return "prefill"
    if stats.max_kv_len >= SPLIT_MIN_KV and tokens * num_heads < SPLIT_MAX_BLOCKS_PER_SM * multiprocessors:
        return "split_kv"
    return "decode"
