"""Property tests of the page allocator and page tables."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pie.runtime.kv_cache import OutOfPages, PageAllocator, SequencePages

PAGE_SIZE = 4
NUM_PAGES = 24


class Pool:
    """A fake device pool: each slot stores the token value written there."""

    def __init__(self) -> None:
        self.data = np.full(NUM_PAGES * PAGE_SIZE, -1, dtype=np.int64)

    def copy_page(self, src: int, dst: int) -> None:
        self.data[dst * PAGE_SIZE : (dst + 1) * PAGE_SIZE] = self.data[src * PAGE_SIZE : (src + 1) * PAGE_SIZE]


actions = st.lists(
    st.tuples(st.sampled_from(["new", "append", "fork", "free", "truncate"]), st.integers(0, 1000), st.integers(1, 9)),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(actions)
def test_random_alloc_fork_free_never_leaks_and_forks_never_change_parents(steps) -> None:
    allocator = PageAllocator(NUM_PAGES)
    pool = Pool()
    live: list[tuple[SequencePages, list[int]]] = []  # each sequence with the tokens it should hold
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
        for seq, tokens in live:
            positions = np.arange(seq.length)
            slots = np.asarray(seq.pages, dtype=np.int64)[positions // PAGE_SIZE] * PAGE_SIZE + positions % PAGE_SIZE
            assert pool.data[slots].tolist() == tokens, "a sequence's KV changed under it"
        held = [page for seq, _ in live for page in seq.pages]
        for page in set(held):
            assert allocator.refcount(page) == held.count(page)
        assert allocator.used_count == len(set(held))
    for seq, _ in live:
        seq.free()
    assert allocator.used_count == 0 and allocator.free_count == NUM_PAGES


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
