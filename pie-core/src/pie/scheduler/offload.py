"""The host page pool: where a preempted sequence's KV pages wait in host RAM.

The memory is a page pool of the CPU engine (``pie_allocate_pages`` on the
host), the same kind of pool a model runs on there; pages move between it and
the device pool only through the page hooks (``read_pages`` / ``write_pages``),
so swapping works for every engine the same way.
"""

from __future__ import annotations

from dataclasses import replace

from pie.runtime.kv_cache import SequencePages
from pie.runtime.model_runner import ModelRunner
from pie.runtime.page_pool import PagePool


class HostPagePool(PagePool):
    """KV pages in host memory, allocated by the CPU engine, with their own refcounts."""

    @classmethod
    def for_runner(cls, runner: ModelRunner, num_pages: int) -> HostPagePool:
        """A host pool shaped like ``runner``'s device pool, holding ``num_pages`` pages, on the host device
        of the registry that loaded ``runner``'s engine (whatever ``PIE_ENGINES`` selects)."""
        return cls(runner.device.host_device(), replace(runner.layout, num_pages=num_pages))

    def store(self, device: PagePool, pages: SequencePages) -> SequencePages | None:
        """Copy a sequence's pages of the ``device`` pool here; None when this pool lacks room.

        The device pages are left as they are: the caller frees them. A copy that raises changes nothing.
        """
        count = len(pages.pages)
        if count > self.free_count:
            return None
        host_ids = self.allocate(count)
        try:
            if count:
                self.write(host_ids, device.read(pages.pages))
        except BaseException:
            self.release(host_ids)
            raise
        return self.sequence(host_ids, pages.length)

    def load(self, device: PagePool, host: SequencePages) -> SequencePages:
        """Copy a stored sequence back into fresh pages of the ``device`` pool and release its host pages.

        Raises OutOfPages when the device pool lacks room, or what the copy raises, having changed nothing.
        """
        device_ids = device.allocate(len(host.pages))
        try:
            if device_ids:
                device.write(device_ids, self.read(host.pages))
        except BaseException:
            device.release(device_ids)
            raise
        table = device.sequence(device_ids, host.length)
        host.free()
        return table
