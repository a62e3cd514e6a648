"""Device tensors and the device's pool of blocks, over a fake driver that records its calls."""

from __future__ import annotations

import gc

import pytest
from pie.enginekit import tensor as kit
from pie.enginekit.tensor import BufferPool
from pie_engine_cuda.tensor import (
    LARGE,
    DeviceTensor,
    OutOfDeviceMemory,
    device_pool,
    size_class,
)


class FakeDriver:
    def __init__(self, capacity: int = 1 << 40):
        self.capacity = capacity
        self.live: dict[int, int] = {}
        self.next = 0x10000
        self.syncs = 0
        self.allocs = 0

    def alloc(self, nbytes: int) -> int:
        if sum(self.live.values()) + nbytes > self.capacity:
            raise OutOfDeviceMemory("fake device full")
        ptr, self.next = self.next, self.next + nbytes + 256
        self.live[ptr] = nbytes
        self.allocs += 1
        return ptr

    def free(self, ptr: int) -> None:
        del self.live[ptr]

    def synchronize(self) -> None:
        self.syncs += 1


def _allocator(driver: FakeDriver) -> BufferPool[int]:
    return device_pool(driver.alloc, driver.free, driver.synchronize)


@pytest.mark.parametrize(
    "nbytes, expected",
    [(0, 512), (1, 512), (513, 1024), (4000, 4096), ((1 << 20) + 1, (1 << 20) + (1 << 17)),
     (3 << 20, 3 << 20), (100 << 20, 100 << 20), ((100 << 20) + 1, 102 << 20)],
)
def test_size_classes(nbytes: int, expected: int) -> None:
    assert size_class(nbytes) == expected
    assert size_class(nbytes) >= nbytes


def test_medium_size_classes_waste_at_most_an_eighth() -> None:
    for nbytes in range(1 << 20, 64 << 20, 123457):
        assert size_class(nbytes) - nbytes <= nbytes / 8


def test_a_released_block_is_reused_without_the_driver() -> None:
    driver = FakeDriver()
    allocator = _allocator(driver)
    ptr, capacity = allocator.take(1000)
    allocator.give(ptr, capacity)
    again, _ = allocator.take(900)  # same size class
    assert again == ptr and driver.allocs == 1
    other, _ = allocator.take(5000)
    assert other != ptr and driver.allocs == 2


def test_large_blocks_go_back_to_the_driver_after_a_sync() -> None:
    driver = FakeDriver()
    allocator = _allocator(driver)
    ptr, capacity = allocator.take(LARGE)
    allocator.give(ptr, capacity)
    assert ptr not in driver.live and driver.syncs == 1
    assert allocator.live_bytes + allocator.kept_bytes == 0


def test_out_of_memory_empties_the_cache_and_retries() -> None:
    driver = FakeDriver(capacity=3 * 4096)
    allocator = _allocator(driver)
    blocks = [allocator.take(4096) for _ in range(3)]
    for ptr, capacity in blocks:
        allocator.give(ptr, capacity)
    ptr, capacity = allocator.take(8192)  # needs the cached 4 KiB blocks back
    assert capacity == 8192 and len(driver.live) == 1 and driver.syncs == 3  # a sync before each free
    with pytest.raises(OutOfDeviceMemory, match="fake device full"):
        allocator.take(1 << 20)


def test_a_dropped_tensor_returns_its_block() -> None:
    driver = FakeDriver()
    allocator = _allocator(driver)
    ptr, capacity = allocator.take(4 * 6)
    tensor = DeviceTensor(ptr, (2, 3), "float32", capacity, allocator.give)
    assert tensor.nbytes == 24 and tensor.size == 6 and tensor.ndim == 2
    del tensor
    gc.collect()
    assert allocator.kept_bytes == capacity


def test_free_is_idempotent_and_adopt_swaps_storage() -> None:
    driver = FakeDriver()
    allocator = _allocator(driver)
    a_ptr, a_cap = allocator.take(4 * 64)
    b_ptr, b_cap = allocator.take(2 * 64)
    weight = DeviceTensor(a_ptr, (8, 8), "float32", a_cap, allocator.give)
    converted = DeviceTensor(b_ptr, (8, 8), "bfloat16", b_cap, allocator.give)
    weight.adopt(converted)
    assert (weight.ptr, weight.dtype, weight.nbytes) == (b_ptr, "bfloat16", 128)
    assert (converted.ptr, converted.dtype) == (a_ptr, "float32")
    converted.free()
    converted.free()
    assert allocator.kept_bytes == a_cap
    with pytest.raises(ValueError):
        weight.adopt(DeviceTensor(0, (4,), "float32", 512, None))


def test_the_device_out_of_memory_is_the_kits_one_type_for_every_engine() -> None:
    """CUDA had a class of its own; Vulkan, wgpu and XLA now raise the kit's (a MemoryError)."""
    assert OutOfDeviceMemory is kit.OutOfDeviceMemory and issubclass(OutOfDeviceMemory, MemoryError)
    assert isinstance(kit.device_memory_exhausted("gpu:0", 1 << 20, "said"), OutOfDeviceMemory)
