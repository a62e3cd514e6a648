"""The host page pool: where a preempted sequence's KV pages wait in host RAM.

The memory is a page pool of the CPU engine (``pie_allocate_pages`` on the
host), the same kind of pool a model runs on there; pages move between it and
the device pool only through the page hooks (``read_pages`` / ``write_pages``),
so swapping works for every engine the same way.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from pie.contract import PageLayout
from pie.plugins import Device
from pie.runtime.kv_cache import PageAllocator, SequencePages
from pie.runtime.model_runner import ModelRunner

I32 = np.int32


class HostPagePool:
    """KV pages in host memory, allocated by the CPU engine, with their own refcounts."""

    def __init__(self, cpu: Device, layout: PageLayout):
        self.device = cpu
        self.layout = layout
        self.pool = cpu.allocate_pages(layout)
        self.allocator = PageAllocator(layout.num_pages)

    @classmethod
    def for_runner(cls, runner: ModelRunner, num_pages: int) -> HostPagePool:
        """A host pool shaped like ``runner``'s device pool, holding ``num_pages`` pages, on the host device
        of the registry that loaded ``runner``'s engine (whatever ``PIE_ENGINES`` selects)."""
        return cls(runner.device.host_device(), replace(runner.layout, num_pages=num_pages))

    @property
    def num_pages(self) -> int:
        return self.layout.num_pages

    def store(self, runner: ModelRunner, pages: SequencePages) -> SequencePages | None:
        """Copy a sequence's device pages here; None when the host pool lacks room.

        The device pages are left as they are: the caller frees them.
        """
        count = len(pages.pages)
        if count > self.allocator.free_count:
            return None
        host_ids = self.allocator.allocate(count)
        if count:
            data = runner.device.read_pages(runner.pool, np.asarray(pages.pages, I32))
            self.device.write_pages(self.pool, np.asarray(host_ids, I32), data)
        return SequencePages.from_pages(self.allocator, pages.page_size, host_ids, pages.length)

    def load(self, runner: ModelRunner, host: SequencePages) -> SequencePages:
        """Copy a stored sequence back into fresh device pages and release its host pages.

        Raises OutOfPages (nothing changed) when the device pool lacks room.
        """
        device_ids = runner.allocator.allocate(len(host.pages))
        if device_ids:
            data = self.device.read_pages(self.pool, np.asarray(host.pages, I32))
            runner.device.write_pages(runner.pool, np.asarray(device_ids, I32), data)
        table = SequencePages.from_pages(runner.allocator, runner.page_size, device_ids, host.length)
        host.free()
        return table

    def close(self) -> None:
        self.device.free_pages(self.pool)
