"""Pages of a read-only file map dropped from the process once a load has taken what it read."""

from __future__ import annotations

import mmap


def release_pages(buffer: mmap.mmap, offset: int, nbytes: int) -> None:
    """Drop the pages of ``buffer[offset:offset + nbytes]`` from this process's memory (the file's pages stay in
    the page cache).

    A hint, never a loss: the map is read-only and file-backed, so a view read again afterwards faults its
    pages back in from the cache. Without it every page a load touched would count in the process's memory
    until the map is closed, beside the engine's copies of the same weights.
    """
    if not hasattr(mmap, "MADV_DONTNEED") or not nbytes:  # Windows; an empty tensor
        return
    start = offset - offset % mmap.PAGESIZE
    buffer.madvise(mmap.MADV_DONTNEED, start, offset + nbytes - start)
