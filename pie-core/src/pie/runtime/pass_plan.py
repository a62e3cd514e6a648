"""The plan of one forward pass: what the runtime knows about a batch, computed once on the host.

FlashInfer's plan/run split: the runtime describes the pass (its index arrays, each sequence's query
and KV lengths, their maxima, whether it is a decode pass) and derives the attention work items from
those numbers, so engines never rediscover them from device tensors. The runtime hands the plan to
the engine before the pass's first launch (``pie_begin_pass``); :mod:`pie.contract` re-exports it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

I32 = np.int32


@dataclass(frozen=True, eq=False)
class PassPlan:
    """One ragged forward pass (the FlashInfer-style arrays of ``ForwardBatch``, int32 host arrays) and
    the numbers derived from it. :meth:`from_batch` derives them (and checks the arrays);
    ``ModelRunner.prepare`` fills them in from what it already knows."""

    ids: np.ndarray
    positions: np.ndarray
    slots: np.ndarray
    qo_indptr: np.ndarray
    kv_page_indices: np.ndarray
    kv_page_indptr: np.ndarray
    kv_last_page_lens: np.ndarray
    sample_rows: np.ndarray
    page_size: int
    q_lens: np.ndarray
    """New tokens of each sequence, ``[num_sequences]``."""
    kv_lens: np.ndarray
    """Tokens each sequence's attention reads (cached and new), ``[num_sequences]``."""
    max_q_len: int
    max_kv_len: int
    num_tokens: int
    decode_only: bool
    """Every sequence brings exactly one new token (and there is at least one)."""

    @property
    def num_sequences(self) -> int:
        return len(self.q_lens)

    @classmethod
    def from_batch(
        cls,
        *,
        ids: np.ndarray,
        positions: np.ndarray,
        slots: np.ndarray,
        qo_indptr: np.ndarray,
        kv_page_indices: np.ndarray,
        kv_page_indptr: np.ndarray,
        kv_last_page_lens: np.ndarray,
        sample_rows: np.ndarray,
        page_size: int,
        num_pages: int | None = None,
    ) -> PassPlan:
        """The plan of a batch given as its arrays alone; ValueError naming the first inconsistency (with
        ``num_pages``, the pool's, a page index or KV slot outside the pool too: a plan whose kernels follow its
        tables unchecked would read another sequence's KV)."""
        if page_size < 1:
            raise ValueError(f"page_size must be at least 1, got {page_size}")
        arrays = {
            "ids": ids, "positions": positions, "slots": slots, "qo_indptr": qo_indptr,
            "kv_page_indices": kv_page_indices, "kv_page_indptr": kv_page_indptr,
            "kv_last_page_lens": kv_last_page_lens, "sample_rows": sample_rows,
        }
        for name, array in arrays.items():
            if not isinstance(array, np.ndarray):
                raise ValueError(f"{name} must be a one-dimensional int32 array, not {type(array).__name__}")
            if array.ndim != 1 or array.dtype != I32:
                raise ValueError(f"{name} must be a one-dimensional int32 array, not {array.ndim}-D {array.dtype}")
        q_lens, kv_lens = check_page_table_values(
            "the batch", qo_indptr, kv_page_indices, kv_page_indptr, kv_last_page_lens, page_size, num_pages=num_pages
        )
        if num_pages is not None:
            check_slot_values("the batch", slots, page_size, num_pages)
        if qo_indptr[-1] != len(ids) or len(positions) != len(ids) or len(slots) != len(ids):
            raise ValueError(
                f"qo_indptr ends at {qo_indptr[-1]}, for {len(ids)} ids, {len(positions)} positions, {len(slots)} slots"
            )
        max_q_len = int(q_lens.max(initial=0))
        return cls(
            **arrays, page_size=page_size, q_lens=q_lens, kv_lens=kv_lens, max_q_len=max_q_len,
            max_kv_len=int(kv_lens.max(initial=0)), num_tokens=len(ids),
            decode_only=max_q_len == 1 and len(ids) == len(q_lens),
        )

    def query_tiles(self, block: int) -> np.ndarray:
        """Prefill attention's work items: see :func:`query_tiles`."""
        return query_tiles(self.qo_indptr, self.q_lens, block)

    def key_chunks(self, chunk: int, window: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """Split-KV attention's work items: see :func:`key_chunks`."""
        return key_chunks(self.qo_indptr, self.q_lens, self.kv_lens, chunk, window)


def check_page_table_values(
    kernel: str,
    qo_indptr: np.ndarray,
    kv_page_indices: np.ndarray,
    kv_page_indptr: np.ndarray,
    kv_last_page_lens: np.ndarray,
    page_size: int,
    *,
    rows: int | None = None,
    num_pages: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """The batch's :func:`sequence_lengths`; ValueError naming ``kernel`` and the first value of its page tables
    that no attention may follow: offsets that do not start at 0 or decrease, ``qo_indptr`` not ending at ``rows``
    (the query rows, when given), ``kv_page_indptr`` not ending at the page indices' count, a last page length
    outside 1..``page_size`` for a sequence with pages, a sequence with more new tokens than its pages hold, and
    (``num_pages`` given) a page index outside the pool. The arrays' shapes and types are checked before
    (``catalogue.check_page_tables``)."""
    if len(qo_indptr) < 1 or qo_indptr[0] != 0:
        raise ValueError(f"{kernel}: qo_indptr must start at 0")
    if len(kv_page_indptr) != len(qo_indptr) or len(kv_last_page_lens) != len(qo_indptr) - 1:
        raise ValueError(
            f"{kernel}: qo_indptr describes {len(qo_indptr) - 1} sequences, kv_page_indptr {len(kv_page_indptr) - 1} "
            f"and kv_last_page_lens {len(kv_last_page_lens)}"
        )
    q_lens, page_counts = np.diff(qo_indptr), np.diff(kv_page_indptr)
    if (q_lens < 0).any() or (page_counts < 0).any() or kv_page_indptr[0] != 0:
        raise ValueError(f"{kernel}: qo_indptr and kv_page_indptr must start at 0 and never decrease")
    if rows is not None and qo_indptr[-1] != rows:
        raise ValueError(f"{kernel}: qo_indptr ends at {qo_indptr[-1]}, for {rows} query rows")
    if kv_page_indptr[-1] != len(kv_page_indices):
        raise ValueError(f"{kernel}: kv_page_indptr ends at {kv_page_indptr[-1]}, for {len(kv_page_indices)} page indices")
    if ((kv_last_page_lens < 1) | (kv_last_page_lens > page_size))[page_counts > 0].any():
        raise ValueError(f"{kernel}: kv_last_page_lens must be in 1..{page_size} (the page size) for a sequence with pages")
    q_lens, kv_lens = sequence_lengths(qo_indptr, kv_page_indptr, kv_last_page_lens, page_size)
    if (kv_lens < q_lens).any():
        raise ValueError(f"{kernel}: a sequence brings more new tokens than its pages hold")
    if num_pages is not None:
        outside = kv_page_indices[(kv_page_indices < 0) | (kv_page_indices >= num_pages)]
        if outside.size:
            raise ValueError(f"{kernel}: kv_page_indices holds page {outside[0]}, outside the pool's {num_pages} pages")
    return q_lens, kv_lens


def check_slot_values(kernel: str, slots: np.ndarray, page_size: int, num_pages: int) -> None:
    """ValueError naming ``kernel`` and the first KV slot outside a pool of ``num_pages`` pages of ``page_size``."""
    outside = slots[(slots < 0) | (slots >= num_pages * page_size)]
    if outside.size:
        raise ValueError(
            f"{kernel}: slot {outside[0]} is outside the pool's {num_pages} pages of {page_size} tokens"
        )


def sequence_lengths(
    qo_indptr: np.ndarray, kv_page_indptr: np.ndarray, kv_last_page_lens: np.ndarray, page_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """Each sequence's new tokens and the tokens its attention reads, from the batch's page tables
    (int32, ``[num_sequences]`` each; a sequence without pages reads none)."""
    pages = np.diff(kv_page_indptr)
    kv_lens = np.where(pages > 0, (pages - 1) * page_size + kv_last_page_lens, 0)
    return np.diff(qo_indptr).astype(I32), kv_lens.astype(I32)


def query_tiles(qo_indptr: np.ndarray, q_lens: np.ndarray, block: int) -> np.ndarray:
    """Each sequence's new tokens cut into tiles of at most ``block``: ``[tiles, 3]`` int32 rows of
    (sequence, first token, token count), sequences in order."""
    if block < 1:
        raise ValueError(f"a query tile holds at least 1 token, not {block}")
    counts = -(-q_lens.astype(np.int64) // block)
    sequence = np.repeat(np.arange(len(q_lens), dtype=np.int64), counts)
    tile = np.arange(len(sequence)) - np.repeat(np.cumsum(counts) - counts, counts)
    first = qo_indptr[sequence].astype(np.int64) + tile * block
    count = np.minimum(block, qo_indptr[sequence + 1] - first)
    return np.stack((sequence, first, count), axis=1).astype(I32).reshape(-1, 3)


def key_chunks(
    qo_indptr: np.ndarray, q_lens: np.ndarray, kv_lens: np.ndarray, chunk: int, window: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """The keys each new token sees (its causal prefix; with a sliding ``window``, only its last ``window``
    of them) cut into chunks of at most ``chunk``: (``[items, 3]`` int32 rows of (token, first key, end key),
    ``[num_tokens + 1]`` int32 offsets of each token's items)."""
    if chunk < 1:
        raise ValueError(f"a key chunk holds at least 1 key, not {chunk}")
    sequence = np.repeat(np.arange(len(q_lens), dtype=np.int64), q_lens)
    token = np.arange(len(sequence), dtype=np.int64)
    seen_before = kv_lens[sequence].astype(np.int64) - q_lens[sequence] - qo_indptr[sequence]
    visible = seen_before + token + 1
    start = np.maximum(visible - window, 0) if window > 0 else np.zeros_like(visible)
    counts = -(-(visible - start) // chunk)
    item_ptr = np.concatenate(([0], np.cumsum(counts))).astype(I32)
    owner = np.repeat(token, counts)
    first = start[owner] + (np.arange(len(owner)) - np.repeat(item_ptr[:-1].astype(np.int64), counts)) * chunk
    end = np.minimum(first + chunk, visible[owner])
    return np.stack((owner, first, end), axis=1).astype(I32).reshape(-1, 3), item_ptr
