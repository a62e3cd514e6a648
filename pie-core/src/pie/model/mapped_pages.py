"""Read-only file maps: their pages dropped from the process once a load has taken what it read, and the file
checked for changes before each read."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

from .errors import ModelLoadError

FileIdentity = tuple[int, int, int, int]
"""A file's device, inode, size and modification time (ns), as `identity` reads them."""


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


def identity(stat: os.stat_result) -> FileIdentity:
    return stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns


def changed_error(path: Path) -> ModelLoadError:
    return ModelLoadError(f"{path}: the file changed while it was loading (a model file rewritten in place can crash "
                          "a load that reads it: replace one by renaming a new one over it)")


def check_unchanged(path: Path, mapped: FileIdentity) -> None:
    """Refuse to read a map of ``path`` (``mapped``: the file's identity when it was mapped) once the file has been
    truncated or rewritten in place: a read past its new end kills the process (SIGBUS), and rewritten pages are
    another model's bytes. A file renamed over it or deleted leaves the map on the old one, whole. What changes
    while one tensor is read is not caught: mmap cannot be made safe against that."""
    try:
        now = identity(os.stat(path))
    except OSError:
        return
    if now[:2] == mapped[:2] and now != mapped:
        raise changed_error(path)
