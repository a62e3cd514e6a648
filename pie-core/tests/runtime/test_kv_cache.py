"""Property tests of the page allocator and page tables."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pie.runtime.kv_cache import OutOfPages, PageAllocator, SequencePages, chain_keys

PAGE_SIZE = 4
NUM_PAGES = 24


class Pool:
    """A fake device pool: each slot stores the token value written there."""

    def __init__(self) -> None:
        self.data = np.full(NUM_PAGES * PAGE_SIZE, -1, dtype=np.int64)

    def copy_page(self, src: int, dst: int) -> None:
        self.data[dst * PAGE_SIZE : (dst + 1) * PAGE_SIZE] = self.data[src * PAGE_SIZE : (src + 1) * PAGE_SIZE]


actions = st.lists(
    st.tuples(
        st.sampled_from(["new", "append", "fork", "free", "truncate", "publish", "adopt"]),
        st.integers(0, 1000),
        st.integers(1, 9),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(actions)
def test_random_alloc_fork_free_never_leaks_and_forks_never_change_parents(steps) -> None:
    """Also with prefix caching: published pages never change, and a lookup finds exactly what was published."""
    allocator = PageAllocator(NUM_PAGES)
    pool = Pool()
    live: list[tuple[SequencePages, list[int]]] = []  # each sequence with the tokens it should hold
    published: dict[bytes, list[int]] = {}  # key -> the tokens up to the end of its page
    counter = 0
    for action, pick, count in steps:
        if action == "new" or not live:
            live.append((SequencePages(allocator, PAGE_SIZE), []))
            continue
        sequence, expected = live[pick % len(live)]
        if action == "append":
            values = list(range(counter, counter + count))
            counter += count
            free_before = allocator.free_count
            try:
                slots = sequence.append(count, pool.copy_page)
            except OutOfPages:
                assert allocator.free_count == free_before, "a failed append must not take pages"
                continue
            pool.data[slots] = values
            expected.extend(values)
        elif action == "fork":
            live.append((sequence.fork(), list(expected)))
        elif action == "free":
            sequence.free()
            live.remove((sequence, expected))
        elif action == "truncate":
            keep = pick % (len(expected) + 1)
            sequence.truncate(keep)
            del expected[keep:]
        elif action == "publish":
            for index in range(sequence.length // PAGE_SIZE):
                key = _content_key(expected[: (index + 1) * PAGE_SIZE])
                if allocator.publish(sequence.pages[index], key):
                    published[key] = expected[: (index + 1) * PAGE_SIZE]
        elif action == "adopt":
            pages = []
            for index in range(len(expected) // PAGE_SIZE):
                page = allocator.lookup(_content_key(expected[: (index + 1) * PAGE_SIZE]))
                if page is None:
                    break
                pages.append(page)
            allocator.retain(pages)
            live.append((SequencePages.from_pages(allocator, PAGE_SIZE, pages, len(pages) * PAGE_SIZE),
                         expected[: len(pages) * PAGE_SIZE]))
        for seq, tokens in live:
            positions = np.arange(seq.length)
            slots = np.asarray(seq.pages, dtype=np.int64)[positions // PAGE_SIZE] * PAGE_SIZE + positions % PAGE_SIZE
            assert pool.data[slots].tolist() == tokens, "a sequence's KV changed under it"
        held = [page for seq, _ in live for page in seq.pages]
        for page in set(held):
            assert allocator.refcount(page) == held.count(page)
        assert allocator.used_count == len(set(held))
        for key, tokens in published.items():
            page = allocator.lookup(key)
            if page is not None:
                slots = page * PAGE_SIZE + np.arange(PAGE_SIZE)
                assert pool.data[slots].tolist() == tokens[-PAGE_SIZE:], "a published page changed"
    for seq, _ in live:
        seq.free()
    assert allocator.used_count == 0 and allocator.free_count == NUM_PAGES


def _content_key(tokens: list[int]) -> bytes:
    return repr(tokens).encode()


def test_double_free_is_refused() -> None:
    allocator = PageAllocator(4)
    pages = allocator.allocate(2)
    allocator.release(pages)
    with pytest.raises(ValueError, match="double free"):
        allocator.release(pages[:1])


def test_out_of_pages_names_the_sizes() -> None:
    allocator = PageAllocator(2)
    sequence = SequencePages(allocator, 4)
    with pytest.raises(OutOfPages, match="needs 3 KV page\\(s\\) but only 2 are free"):
        sequence.append(9, lambda src, dst: None)
    assert sequence.length == 0 and allocator.free_count == 2


def test_fork_shares_full_pages_and_copies_the_partial_one_on_write() -> None:
    allocator = PageAllocator(8)
    pool = Pool()
    parent = SequencePages(allocator, PAGE_SIZE)
    parent.append(6, pool.copy_page)
    child = parent.fork()
    assert child.pages == parent.pages and allocator.refcount(parent.pages[0]) == 2
    child.append(1, pool.copy_page)
    assert child.pages[0] == parent.pages[0], "full pages stay shared"
    assert child.pages[1] != parent.pages[1], "the shared partial page is copied before the child writes"


def test_a_failing_copy_on_write_changes_nothing() -> None:
    """The private page was taken before the copy: a copy that raised (an engine error) left it held by no one."""
    allocator = PageAllocator(8)
    parent = SequencePages(allocator, PAGE_SIZE)
    parent.append(6, Pool().copy_page)
    child = parent.fork()

    def broken(src: int, dst: int) -> None:
        raise RuntimeError("copy_pages failed")

    with pytest.raises(RuntimeError, match="copy_pages failed"):
        child.append(1, broken)
    assert child.pages == parent.pages and child.length == 6 and allocator.free_count == 6


def test_chain_keys_name_every_token_up_to_the_page_end() -> None:
    a = list(chain_keys([1, 2, 3, 4, 5, 6, 7, 8, 9], 4))
    b = list(chain_keys([1, 2, 3, 4, 5, 6, 7, 0], 4))
    c = list(chain_keys([0, 2, 3, 4, 5, 6, 7, 8], 4))
    assert len(a) == 2, "only full pages have keys"
    assert a[0] == b[0] and a[1] != b[1]
    assert a[1] != c[1], "a page's key depends on the pages before it"
    assert list(chain_keys([1, 2, 3, 4, 5, 6, 7, 8, 9], 4, parent=a[0], start=1)) == a[1:]


def test_released_published_pages_stay_cached_until_needed_and_go_least_recently_used_first() -> None:
    allocator = PageAllocator(3)
    first, second, third = allocator.allocate(3)
    allocator.publish(first, b"first")
    allocator.publish(second, b"second")
    allocator.release([second])
    allocator.release([first])
    allocator.release([third])
    assert allocator.free_count == 3 and allocator.cached_count == 2 and allocator.used_count == 0
    assert allocator.allocate(1) == [third], "a never-published page goes before any cached one"
    assert allocator.lookup(b"second") == second
    (evicted,) = allocator.allocate(1)
    assert evicted == second, "the page released longest ago is evicted first"
    assert allocator.lookup(b"second") is None and allocator.lookup(b"first") == first
    allocator.retain([first])
    assert allocator.refcount(first) == 1 and allocator.free_count == 0
    with pytest.raises(OutOfPages):
        allocator.allocate(1)


def test_a_freed_chain_is_evicted_from_its_tail_so_its_start_stays_findable() -> None:
    """Eviction took a freed prefix's first page first, and the lookup, which walks a prefix from its start, then
    found none of the pages still cached after it."""
    allocator = PageAllocator(4)
    sequence = SequencePages(allocator, PAGE_SIZE)
    sequence.append(4 * PAGE_SIZE, Pool().copy_page)
    keys = list(chain_keys(list(range(4 * PAGE_SIZE)), PAGE_SIZE))
    for page, key in zip(sequence.pages, keys, strict=True):
        allocator.publish(page, key)
    pages = list(sequence.pages)
    sequence.free()
    assert allocator.allocate(1) == [pages[-1]]
    assert [allocator.lookup(key) for key in keys] == [*pages[:3], None]


def test_a_published_page_is_copied_before_a_write() -> None:
    allocator = PageAllocator(4)
    pool = Pool()
    sequence = SequencePages(allocator, PAGE_SIZE)
    pool.data[sequence.append(4, pool.copy_page)] = [1, 2, 3, 4]
    page = sequence.pages[0]
    allocator.publish(page, b"k")
    sequence.truncate(2)
    assert sequence.pages_needed(1) == 1, "writing into the published page takes a copy"
    pool.data[sequence.append(1, pool.copy_page)] = [9]
    assert sequence.pages[0] != page and pool.data[page * PAGE_SIZE : page * PAGE_SIZE + 4].tolist() == [1, 2, 3, 4]
    assert allocator.lookup(b"k") == page and allocator.refcount(page) == 0 and allocator.cached_count == 1


def test_an_unpublished_page_is_written_in_place() -> None:
    allocator = PageAllocator(4)
    pool = Pool()
    sequence = SequencePages(allocator, PAGE_SIZE)
    sequence.append(4, pool.copy_page)
    page = sequence.pages[0]
    allocator.publish(page, b"k")
    sequence.truncate(2)
    allocator.unpublish(page)
    assert sequence.pages_needed(1) == 0 and allocator.lookup(b"k") is None
    sequence.append(1, pool.copy_page)
    assert sequence.pages == [page] and allocator.free_count == 3


def test_publishing_twice_keeps_the_first_page() -> None:
    allocator = PageAllocator(2)
    a, b = allocator.allocate(2)
    assert allocator.publish(a, b"k") and not allocator.publish(b, b"k") and not allocator.publish(a, b"other")
    assert allocator.lookup(b"k") == a and allocator.lookup(b"other") is None
    allocator.release([b])
    with pytest.raises(ValueError, match="not allocated"):
        allocator.publish(b, b"other")
