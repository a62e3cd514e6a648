"""A KV page pool: the engine's memory for it and the bookkeeping of which pages are whose, as one object.

The model runner's device pool and the scheduler's host pool (where a preempted sequence waits) are both
one. The scheduler, the inferlet host and the server reach the KV cache only through it: page counts and
refcounts, allocation and prefix-cache publishing (:class:`PageAllocator`'s), and the pages' contents,
which move only through the engine's page hooks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from pie.contract import PageLayout
from pie.plugins import Device
from pie.runtime.kv_cache import PageAllocator, SequencePages

I32 = np.int32


class PageReplicas(Protocol):
    """Other copies of a pool that get each of its page operations before it runs (see
    :meth:`pie.runtime.model_runner.ModelRunner.replicate_to`)."""

    def read_pages(self, page_ids: np.ndarray) -> None: ...

    def write_pages(self, page_ids: np.ndarray, data: np.ndarray) -> None: ...

    def copy_pages(self, source_ids: np.ndarray, destination_ids: np.ndarray) -> None: ...


class PagePool(PageAllocator):
    """``layout.num_pages`` KV pages of ``layout`` in ``device``'s memory (zero-filled), reference-counted."""

    def __init__(self, device: Device, layout: PageLayout):
        super().__init__(layout.num_pages)
        self.device = device
        self.layout = layout
        self.handle = device.allocate_pages(layout)
        """The engine's pool, as ``append_kv`` and ``attention`` launches take it."""
        self.replicas: PageReplicas | None = None

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
        page_ids = np.asarray(pages, I32)
        if self.replicas is not None:
            self.replicas.read_pages(page_ids)
        return self.device.read_pages(self.handle, page_ids)

    def write(self, pages: Sequence[int], data: np.ndarray) -> None:
        """Set the pages' contents (``data`` as :meth:`read` returns it)."""
        page_ids = np.asarray(pages, I32)
        if self.replicas is not None:
            self.replicas.write_pages(page_ids, data)
        self.device.write_pages(self.handle, page_ids, data)

    def copy(self, source: int, destination: int) -> None:
        """Copy one page's contents onto another (copy-on-write), on the device."""
        source_ids, destination_ids = np.array([source], I32), np.array([destination], I32)
        if self.replicas is not None:
            self.replicas.copy_pages(source_ids, destination_ids)
        self.device.copy_pages(self.handle, source_ids, destination_ids)

    def close(self) -> None:
        self.device.free_pages(self.handle)
