"""A KV page pool: the engine's memory for it and the bookkeeping of which pages are whose, as one object.

The model runner's device pool and the scheduler's host pool (where a preempted sequence waits) are both
one. The scheduler, the inferlet host and the server reach the KV cache only through it: page counts and
refcounts, allocation and prefix-cache publishing (:class:`PageAllocator`'s), and the pages' contents,
which move only through the engine's page hooks.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pie.contract import PageLayout
from pie.plugins import Device
from pie.runtime.kv_cache import PageAllocator, SequencePages

I32 = np.int32


class PagePool(PageAllocator):
    """``layout.num_pages`` KV pages of ``layout`` in ``device``'s memory (zero-filled), reference-counted."""

    def __init__(self, device: Device, layout: PageLayout):
        super().__init__(layout.num_pages)
        self.device = device
        self.layout = layout
        self.handle = device.allocate_pages(layout)
        """The engine's pool, as ``append_kv`` and ``attention`` launches take it."""

    @property
    def page_size(self) -> int:
        return self.layout.page_size

    def new_sequence(self) -> SequencePages:
        return SequencePages(self, self.layout.page_size)

    def sequence(self, pages: Sequence[int], length: int) -> SequencePages:
        """A page table over ``pages``, already allocated (and held) for it, holding ``length`` tokens."""
        return SequencePages.from_pages(self, self.layout.page_size, pages, length)

    def read(self, pages: Sequence[int]) -> np.ndarray:
        """The pages' contents in host memory, ``[num_layers, len(pages), 2, page_size, heads, dim]``."""
        return self.device.read_pages(self.handle, np.asarray(pages, I32))

    def write(self, pages: Sequence[int], data: np.ndarray) -> None:
        """Set the pages' contents (``data`` as :meth:`read` returns it)."""
        self.device.write_pages(self.handle, np.asarray(pages, I32), data)

    def copy(self, source: int, destination: int) -> None:
        """Copy one page's contents onto another (copy-on-write), on the device."""
        self.device.copy_pages(self.handle, np.array([source], I32), np.array([destination], I32))

    def close(self) -> None:
        self.device.free_pages(self.handle)
