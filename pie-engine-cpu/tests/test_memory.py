"""Weights packed per layer into one block that starts on a huge-page boundary."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from pie.plugins import EngineRegistry
from pie_engine_cpu.memory import ALIGNMENT, HUGE_PAGE, huge_page_block, pack


def test_pack_copies_every_array_into_one_aligned_block() -> None:
    rng = np.random.default_rng(0)
    arrays = [
        rng.standard_normal((3, 5), dtype=np.float32),
        np.arange(7, dtype=np.int32),
        np.zeros((0, 4), np.float32),
        rng.standard_normal((576, 576), dtype=np.float32),
    ]
    packed = pack(arrays)
    for original, copy in zip(arrays, packed, strict=True):
        assert copy.dtype == original.dtype and copy.shape == original.shape and copy.flags.c_contiguous
        assert copy.flags.writeable and np.array_equal(copy, original)
        assert copy.ctypes.data % ALIGNMENT == 0
    assert packed[0].ctypes.data % HUGE_PAGE == 0
    bases = {id(copy.base.base) for copy in packed if copy.size}
    assert len(bases) == 1, "the arrays should share one block"
    arrays[3][0, 0] = 1e9
    assert packed[3][0, 0] != 1e9, "a packed weight is a copy, not a view of the caller's array"


def test_the_engine_uploads_a_weight_group_into_one_block() -> None:
    device = EngineRegistry(env={"PIE_ENGINES": "cpu"}).engine("cpu").open(0)
    weights = device.upload_weights([np.ones((64, 32), np.float32), np.full(32, 2.0, np.float32)])
    assert weights[0].ctypes.data % HUGE_PAGE == 0
    assert weights[1].ctypes.data == weights[0].ctypes.data + 64 * 32 * 4
    np.testing.assert_array_equal(device.download(weights[1]), np.full(32, 2.0, np.float32))


def _smaps_field(address: int, field: str) -> str | None:
    """``field`` of the mapping holding ``address`` in this process's /proc/self/smaps."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            low, high = (int(bound, 16) for bound in head.split("-"))
            inside = low <= address < high
        elif inside and head == f"{field}:":
            return line.split()[1]
    return None


def test_a_block_is_memory_the_kernel_may_back_with_huge_pages() -> None:
    modes = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not modes.exists() or "[never]" in modes.read_text():
        pytest.skip("this kernel has no transparent huge pages for anonymous memory")
    block = huge_page_block(4 * HUGE_PAGE)
    block[::4096] = 1
    # Shared anonymous memory (mmap's default) is shmem and was never eligible here.
    assert _smaps_field(block.ctypes.data, "THPeligible") == "1"
