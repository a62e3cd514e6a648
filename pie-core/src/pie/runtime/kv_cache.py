"""Paged KV cache bookkeeping: which pages exist, who holds them, where tokens go.

The memory itself is an engine page pool (``pie_allocate_pages``); this module
only hands out page indices. Pages are reference-counted so a forked sequence
shares its parent's pages; the first write into a shared page copies it
(copy-on-write), so a fork never changes its parent.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


class OutOfPages(RuntimeError):
    """The pool has fewer free pages than a request needs."""

    def __init__(self, needed: int, free: int):
        super().__init__(f"needs {needed} KV page(s) but only {free} are free")
        self.needed = needed
        self.free = free


class PageAllocator:
    """Reference-counted allocation of page indices ``0..num_pages-1``."""

    def __init__(self, num_pages: int):
        if num_pages <= 0:
            raise ValueError(f"a page pool needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        self._refcount = [0] * num_pages
        self._free: list[int] = list(range(num_pages - 1, -1, -1))

    @property
    def free_count(self) -> int:
        return len(self._free)

    @property
    def used_count(self) -> int:
        return self.num_pages - len(self._free)

    def refcount(self, page: int) -> int:
        return self._refcount[page]

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise OutOfPages(count, len(self._free))
        pages = [self._free.pop() for _ in range(count)]
        for page in pages:
            self._refcount[page] = 1
        return pages

    def retain(self, pages: Sequence[int]) -> None:
        for page in pages:
            if self._refcount[page] <= 0:
                raise ValueError(f"page {page} is not allocated")
            self._refcount[page] += 1

    def release(self, pages: Sequence[int]) -> None:
        for page in pages:
            if self._refcount[page] <= 0:
                raise ValueError(f"page {page} released more often than it was held (double free)")
            self._refcount[page] -= 1
            if self._refcount[page] == 0:
                self._free.append(page)


PageCopier = Callable[[int, int], None]
"""Copies the contents of page ``src`` to page ``dst`` in the device pool."""


class SequencePages:
    """The page table of one sequence: its pages in order and how many tokens it holds."""

    def __init__(self, allocator: PageAllocator, page_size: int):
        self.allocator = allocator
        self.page_size = page_size
        self.pages: list[int] = []
        self.length = 0

    @classmethod
    def from_pages(cls, allocator: PageAllocator, page_size: int, pages: Sequence[int], length: int) -> SequencePages:
        """A table over pages already allocated (and held) for this sequence, e.g. after a swap."""
        if length > len(pages) * page_size or (pages and length <= (len(pages) - 1) * page_size):
            raise ValueError(f"{length} tokens do not fill {len(pages)} page(s) of {page_size}")
        table = cls(allocator, page_size)
        table.pages = list(pages)
        table.length = length
        return table

    def exclusive_page_count(self) -> int:
        """Pages only this sequence holds: what freeing it would return to the pool."""
        return sum(1 for page in self.pages if self.allocator.refcount(page) == 1)

    def pages_needed(self, new_tokens: int) -> int:
        """Fresh pages that appending ``new_tokens`` would allocate (copy-on-write included)."""
        total = -(-(self.length + new_tokens) // self.page_size)
        fresh = total - len(self.pages)
        if new_tokens and self._last_page_shared():
            fresh += 1
        return max(fresh, 0)

    def _last_page_shared(self) -> bool:
        return bool(self.pages) and self.length % self.page_size != 0 and self.allocator.refcount(self.pages[-1]) > 1

    def append(self, new_tokens: int, copy_page: PageCopier) -> list[int]:
        """Reserve room for ``new_tokens`` and return their flat slots (page * page_size + offset).

        Raises OutOfPages before changing anything when the pool cannot hold them. Plain Python, no numpy:
        a decode step runs this right after the weights have swept the caches, where each numpy call
        costs several microseconds of cold code.
        """
        needed = self.pages_needed(new_tokens)
        if needed > self.allocator.free_count:
            raise OutOfPages(needed, self.allocator.free_count)
        if new_tokens and self._last_page_shared():
            (private,) = self.allocator.allocate(1)
            copy_page(self.pages[-1], private)
            self.allocator.release([self.pages[-1]])
            self.pages[-1] = private
        total = -(-(self.length + new_tokens) // self.page_size)
        if total > len(self.pages):
            self.pages.extend(self.allocator.allocate(total - len(self.pages)))
        start, size, pages = self.length, self.page_size, self.pages
        self.length += new_tokens
        return [pages[position // size] * size + position % size for position in range(start, self.length)]

    def fork(self) -> SequencePages:
        """A child that shares every page; either side copies a shared page before writing into it."""
        child = SequencePages(self.allocator, self.page_size)
        self.allocator.retain(self.pages)
        child.pages = list(self.pages)
        child.length = self.length
        return child

    def truncate(self, length: int) -> None:
        """Forget tokens past ``length`` (e.g. rejected drafts), returning whole pages no longer used."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a sequence of {self.length} tokens to {length}")
        keep = -(-length // self.page_size)
        self.allocator.release(self.pages[keep:])
        del self.pages[keep:]
        self.length = length

    def free(self) -> None:
        self.allocator.release(self.pages)
        self.pages = []
        self.length = 0

    @property
    def last_page_len(self) -> int:
        if not self.pages:
            return 0
        return self.length - (len(self.pages) - 1) * self.page_size
