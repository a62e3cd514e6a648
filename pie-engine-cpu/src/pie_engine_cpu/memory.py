"""Host memory for weights: one block per group, on transparent huge pages where the kernel offers them.

A decode step streams every weight once, and at 4 KiB pages that stream takes a TLB miss every
4 KiB and loses the hardware prefetchers at every page boundary. numpy asks for huge pages only
for arrays of 4 MiB and more, and not 2 MiB-aligned, so most of a small model's matrices (576x576
is 1.3 MiB) stayed on small pages. Packing a layer's weights into one 2 MiB-aligned block with
``MADV_HUGEPAGE`` moves them onto huge pages (``benchmarks/README.md`` has the effect).
"""

from __future__ import annotations

import mmap
from collections.abc import Sequence

import numpy as np
from pie.weights import StoredWeight

HUGE_PAGE = 2 * 1024 * 1024
ALIGNMENT = 64
"""Each array of a block starts on a cache line."""


def _aligned(n: int, to: int) -> int:
    return -(-n // to) * to


def huge_page_block(nbytes: int) -> np.ndarray:
    """``nbytes`` of zeroed host memory (uint8) starting on a 2 MiB boundary, its whole 2 MiB pages advised
    onto huge pages.

    Private anonymous memory from mmap, so it goes back to the system when the last view of it is gone.
    Private, not mmap's default of shared: shared anonymous memory is shmem, which gets huge pages only
    where ``shmem_enabled`` says so ("never" here) and ignores the advice. Where the kernel has no
    transparent huge pages the advice is ignored and the block is ordinary memory.
    """
    size = _aligned(nbytes, HUGE_PAGE) + HUGE_PAGE
    if hasattr(mmap, "MAP_PRIVATE"):
        mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    else:  # Windows has no mapping flags
        mapping = mmap.mmap(-1, size)
    raw = np.frombuffer(mapping, dtype=np.uint8)
    start = -raw.ctypes.data % HUGE_PAGE
    if hasattr(mmap, "MADV_HUGEPAGE"):
        # Only the whole huge pages the block fills: a huge page past its end would be memory the process
        # holds but never uses (a layer of the default model is 2.2 MB; it took two), so the rest of the
        # block stays on small pages, where the kernel would otherwise back it with huge ones anyway.
        whole = nbytes - nbytes % HUGE_PAGE
        try:
            if whole:
                mapping.madvise(mmap.MADV_HUGEPAGE, start, whole)
            mapping.madvise(mmap.MADV_NOHUGEPAGE, start + whole, size - start - whole)
        except OSError:  # kernels built without transparent huge pages
            pass
    return raw[start : start + nbytes]


def pack(arrays: Sequence[np.ndarray | StoredWeight]) -> list[np.ndarray | StoredWeight]:
    """Copies of ``arrays`` (C order, same dtypes and shapes; a StoredWeight's bytes as its data) side by
    side in one huge-page block."""
    offsets, total = [], 0
    for array in arrays:
        offsets.append(total)
        total += _aligned(array.nbytes, ALIGNMENT)
    block = huge_page_block(max(total, 1))
    copies: list[np.ndarray | StoredWeight] = []
    for array, offset in zip(arrays, offsets, strict=True):
        data = array.data if isinstance(array, StoredWeight) else array
        copy = block[offset : offset + data.nbytes].view(data.dtype).reshape(data.shape)
        copy[...] = data
        copies.append(StoredWeight(array.type, array.shape, copy) if isinstance(array, StoredWeight) else copy)
    return copies
