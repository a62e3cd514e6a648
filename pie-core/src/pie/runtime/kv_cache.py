"""Paged KV cache bookkeeping: which pages exist, who holds them, where tokens go.

The memory itself is an engine page pool (``pie_allocate_pages``); this module
only hands out page indices. Pages are reference-counted so a forked sequence
shares its parent's pages; the first write into a shared page copies it
(copy-on-write), so a fork never changes its parent.

Prefix caching: a full page can be *published* under a key that names its
contents (the hash chain of every token up to its end, :func:`chain_keys`).
A published page is never written again (a write into it copies it first, as
for a shared page), so a later sequence that starts with the same tokens can
take it by key. When its last holder releases it, it stays cached, counted as
free, until the pool needs a page and nothing else is free: then the cached
page unused longest is evicted. A page some sequence holds is never evicted.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence


class OutOfPages(RuntimeError):
    """The pool has fewer free pages than a request needs."""

    def __init__(self, needed: int, free: int):
        super().__init__(f"needs {needed} KV page(s) but only {free} are free")
        self.needed = needed
        self.free = free


def chain_keys(tokens: Sequence[int], page_size: int, parent: bytes = b"", start: int = 0) -> Iterator[bytes]:
    """Keys of the full pages of ``tokens`` from page ``start`` on, each naming every token up to its page's end.

    ``parent`` is the key of page ``start - 1``, or for the first page the chain's root (:func:`cache_root`).
    Lazy: a lookup that misses early hashes no further.
    """
    key = parent
    for begin in range(start * page_size, len(tokens) - page_size + 1, page_size):
        key = hashlib.blake2b(key + array("i", tokens[begin : begin + page_size]).tobytes(), digest_size=16).digest()
        yield key


def cache_root(salt: str | None) -> bytes:
    """The root a sequence's page keys chain from: empty without a salt. Chains from different roots never meet
    (short of a hash collision), so a salted prompt's pages are found only under the same salt."""
    if salt is None:
        return b""
    return hashlib.blake2b(salt.encode("utf-8", "surrogatepass"), digest_size=16, person=b"pie-cache-salt").digest()


class PageAllocator:
    """Reference-counted allocation of page indices ``0..num_pages-1``, with published pages cached by key."""

    def __init__(self, num_pages: int):
        if num_pages <= 0:
            raise ValueError(f"a page pool needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        self._refcount = [0] * num_pages
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._key_of: dict[int, bytes] = {}
        self._page_of: dict[bytes, int] = {}
        self._idle: OrderedDict[int, None] = OrderedDict()
        """Published pages nobody holds, least recently released first: free, but still findable by key."""

    @property
    def free_count(self) -> int:
        """Pages an allocation can take: never-used or released ones, and cached ones nobody holds."""
        return len(self._free) + len(self._idle)

    @property
    def used_count(self) -> int:
        """Pages some sequence holds."""
        return self.num_pages - self.free_count

    @property
    def cached_count(self) -> int:
        """Published pages nobody holds (counted in ``free_count``; evicted when nothing else is free)."""
        return len(self._idle)

    def refcount(self, page: int) -> int:
        if not 0 <= page < self.num_pages:  # a negative index would read another page's count
            raise ValueError(f"page {page} is outside the KV cache's {self.num_pages} pages")
        return self._refcount[page]

    def allocate(self, count: int) -> list[int]:
        if count > self.free_count:
            raise OutOfPages(count, self.free_count)
        pages = []
        for _ in range(count):
            if self._free:
                page = self._free.pop()
            else:
                page, _ = self._idle.popitem(last=False)
                del self._page_of[self._key_of.pop(page)]
            self._refcount[page] = 1
            pages.append(page)
        return pages

    def retain(self, pages: Sequence[int]) -> None:
        """Hold pages once more; a cached page nobody held is taken out of the eviction order."""
        for page in pages:
            if self._refcount[page] <= 0:
                if page not in self._idle:
                    raise ValueError(f"page {page} is not allocated")
                del self._idle[page]
            self._refcount[page] += 1

    def release(self, pages: Sequence[int]) -> None:
        """Hold ``pages`` (a sequence's, in its order) once less. They are released last first, so that the cached
        ones are evicted tail first: a cached prefix is found page by page from its start, and losing its first page
        would leave every page after it cached but unreachable."""
        for page in reversed(pages):
            if self._refcount[page] <= 0:
                raise ValueError(f"page {page} released more often than it was held (double free)")
            self._refcount[page] -= 1
            if self._refcount[page] == 0:
                if page in self._key_of:
                    self._idle[page] = None
                else:
                    self._free.append(page)

    # -- prefix caching ------------------------------------------------------

    def publish(self, page: int, key: bytes) -> bool:
        """Make a held, full page findable by ``key``; False (nothing changed) when the key or page already is."""
        if self._refcount[page] <= 0:
            raise ValueError(f"page {page} is not allocated")
        if key in self._page_of or page in self._key_of:
            return False
        self._key_of[page] = key
        self._page_of[key] = page
        return True

    def lookup(self, key: bytes) -> int | None:
        """The page published under ``key`` (held or cached), or None."""
        return self._page_of.get(key)

    def is_published(self, page: int) -> bool:
        return page in self._key_of

    def unpublish(self, page: int) -> None:
        """Make a held page findable by key no more, so that its holder may write into it."""
        if self._refcount[page] <= 0:
            raise ValueError(f"page {page} is not allocated")
        key = self._key_of.pop(page, None)
        if key is not None:
            del self._page_of[key]


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
        """Whether the next token goes into a page that must not be written: held by another sequence too,
        or published (its contents are named by its key)."""
        if not self.pages or self.length % self.page_size == 0:
            return False
        last = self.pages[-1]
        return self.allocator.refcount(last) > 1 or self.allocator.is_published(last)

    def append(self, new_tokens: int, copy_page: PageCopier) -> list[int]:
        """Reserve room for ``new_tokens`` and return their flat slots (page * page_size + offset).

        Raises OutOfPages, or what ``copy_page`` raises, before changing anything. Plain Python, no numpy:
        a decode step runs this right after the weights have swept the caches, where each numpy call
        costs several microseconds of cold code.
        """
        needed = self.pages_needed(new_tokens)
        if needed > self.allocator.free_count:
            raise OutOfPages(needed, self.allocator.free_count)
        if new_tokens and self._last_page_shared():
            (private,) = self.allocator.allocate(1)
            try:
                copy_page(self.pages[-1], private)
            except BaseException:
                self.allocator.release([private])
                raise
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
