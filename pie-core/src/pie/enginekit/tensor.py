"""Device tensors of the shared-kernel engines, and the pool their buffers come from.

Launchers are functional: every call returns a new tensor. Allocating a device
buffer per launch would cost more than the kernel on a software device, so
buffers are recycled: when a tensor is dropped its buffer goes back to the pool,
to be handed to the next tensor of the same rounded size. Engines record work in
order on one queue, so reuse is safe even while earlier commands that read the
old contents are still pending (they run first).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

import numpy as np

B = TypeVar("B")

ALIGNMENT = 256
"""Buffer capacities are multiples of this many bytes (and never zero)."""


def capacity_for(nbytes: int) -> int:
    return max(ALIGNMENT, -(-nbytes // ALIGNMENT) * ALIGNMENT)


class OutOfDeviceMemory(MemoryError):
    """The device has no room for an allocation: a MemoryError, as the CPU engine's numpy raises, so that the buffer
    pool retries, the facade passes it on as the machine's limit and `pie run` says to ask for less, whatever the
    engine."""


def device_memory_exhausted(device: str, nbytes: int | None, said: str) -> OutOfDeviceMemory:
    """What an engine raises where its device refuses ``nbytes`` (None: unknown) for want of memory (``said``: the
    API's words)."""
    what = "device memory" if nbytes is None else f"{nbytes / 2**20:.1f} MiB of device memory"
    return OutOfDeviceMemory(f"{device} could not allocate {what}: {said}")


class BufferPool(Generic[B]):
    """Free buffers by capacity; keeps at most ``keep_bytes`` of them, destroying the rest.

    ``capacity`` rounds a request up to the size of buffer made for it (its size class); buffers of
    ``largest_kept`` bytes or more are destroyed when given back, never kept. When making a buffer
    fails for want of memory (a ``MemoryError``), the kept buffers are destroyed, ``release`` (where given)
    frees what the backend destroys only later (buffers recorded work may still use), and it is tried once more.
    """

    def __init__(
        self,
        create: Callable[[int], B],
        destroy: Callable[[B], None],
        keep_bytes: int = 512 << 20,
        *,
        capacity: Callable[[int], int] = capacity_for,
        largest_kept: int | None = None,
        release: Callable[[], None] | None = None,
    ):
        self._create = create
        self._destroy = destroy
        self._keep_bytes = keep_bytes
        self._capacity = capacity
        self._largest_kept = largest_kept
        self._release = release
        self._free: dict[int, list[B]] = {}
        self.kept_bytes = 0
        self.live_bytes = 0

    def take(self, nbytes: int) -> tuple[B, int]:
        capacity = self._capacity(nbytes)
        free = self._free.get(capacity)
        if free:
            self.kept_bytes -= capacity
            buffer = free.pop()
        else:
            try:
                buffer = self._create(capacity)
            except MemoryError:  # the kept buffers may hold the memory it needs
                self.clear()
                if self._release is not None:
                    self._release()
                buffer = self._create(capacity)
        self.live_bytes += capacity
        return buffer, capacity

    def give(self, buffer: B, capacity: int) -> None:
        self.live_bytes -= capacity
        too_large = self._largest_kept is not None and capacity >= self._largest_kept
        if too_large or self.kept_bytes + capacity > self._keep_bytes:
            self._destroy(buffer)
            return
        self._free.setdefault(capacity, []).append(buffer)
        self.kept_bytes += capacity

    def clear(self) -> None:
        """Destroy every kept buffer."""
        for buffers in self._free.values():
            for buffer in buffers:
                self._destroy(buffer)
        self._free.clear()
        self.kept_bytes = 0


class GpuTensor:
    """A dense row-major tensor in one device buffer; returns its buffer to the pool when dropped."""

    __slots__ = ("_pool", "buffer", "capacity", "dtype", "nbytes", "shape")

    def __init__(self, pool: BufferPool[Any], shape: tuple[int, ...], dtype: np.dtype[Any]):
        self._pool: BufferPool[Any] | None = None  # until the buffer is taken: a failed take leaves nothing to give
        self.shape = tuple(int(n) for n in shape)
        self.dtype = np.dtype(dtype)
        self.nbytes = int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize
        self.buffer, self.capacity = pool.take(self.nbytes)
        self._pool = pool

    def free(self) -> None:
        """Give the buffer back now (a page pool freed explicitly); the tensor is unusable afterwards."""
        self.__del__()
        self.shape, self.nbytes = (0,), 0

    def __del__(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            try:
                pool.give(self.buffer, self.capacity)
            except Exception:
                pass

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return self.nbytes // self.dtype.itemsize

    def __repr__(self) -> str:
        return f"GpuTensor(shape={self.shape}, dtype={self.dtype.name})"


class StoredTensor:
    """A weight on the device in its stored type (``pie.weights.StoredWeight``): its bytes as u32 words,
    one spare word after them (the kernels may read a word past a block's last byte)."""

    __slots__ = ("shape", "type", "words")

    def __init__(self, words: GpuTensor, weight_type: str, shape: tuple[int, int]):
        self.words = words
        self.type = weight_type
        self.shape = (int(shape[0]), int(shape[1]))
        """The logical [rows, columns] of the weight."""

    @staticmethod
    def packed_bytes(nbytes: int) -> int:
        """Bytes of the words :meth:`packed` makes of ``nbytes`` bytes of a stored weight."""
        return 4 * (-(-nbytes // 4) + 1)

    @staticmethod
    def packed(data: np.ndarray) -> np.ndarray:
        """A stored weight's bytes (uint8) as the u32 words the kernels read, the spare word included."""
        words = np.zeros(StoredTensor.packed_bytes(data.nbytes) // 4, np.uint32)
        words.view(np.uint8)[: data.nbytes] = data.reshape(-1)
        return words

    @property
    def ndim(self) -> int:
        return 2

    def __repr__(self) -> str:
        return f"StoredTensor({self.type}, shape={self.shape})"
