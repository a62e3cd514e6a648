"""Device tensors and the pool of device blocks behind them.

All work of a device runs on one stream, in order. So a buffer whose tensor is
dropped can be handed to the next allocation at once: whatever uses it next is
queued after everything that used it before. Launchers therefore allocate
their outputs and temporaries freely; reuse costs a dict lookup, not a driver call.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
from pie.enginekit.tensor import BufferPool
from pie.enginekit.tensor import OutOfDeviceMemory as OutOfDeviceMemory  # re-exported: the kit's, every engine's

HOST_COPY_LIMIT = 1 << 16
"""Small integer tensors remember the host array they were uploaded from (the batch
description), so a launch outside a pass plans its work without reading the device back."""

ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "int32": 4}
BLOCK_DTYPES = ("q8_0", "q4_0", "q4_1", "q5_0", "q4_k", "q5_k", "q6_k")
"""GGML's block types, kept on the device as stored: a tensor of logical shape [rows, cols] whose
bytes are the ``[rows, row_bytes]`` of its :class:`pie.weights.StoredWeight`."""
STORED_DTYPES = {"f16": "float16", "bf16": "bfloat16", **{name: name for name in BLOCK_DTYPES}}
"""The device dtype of each stored weight type (``pie.weights``) the projections and the gather read."""


class DeviceTensor:
    """A dense, C-ordered buffer in device memory.

    ``dtype`` is a numpy dtype name, or ``"bfloat16"``. The memory goes back to
    the allocator when the tensor is garbage-collected or :meth:`free` is called.
    """

    __slots__ = ("__weakref__", "_release", "capacity", "dtype", "host", "nbytes", "ptr", "shape")

    def __init__(
        self,
        ptr: int,
        shape: tuple[int, ...],
        dtype: str,
        capacity: int,
        release: Callable[[int, int], None] | None,
        host: np.ndarray | None = None,
        nbytes: int | None = None,
    ):
        self.ptr = ptr
        self.shape = shape
        self.dtype = dtype
        self.nbytes = math.prod(shape) * itemsize(dtype) if nbytes is None else nbytes
        self.capacity = capacity
        self.host = host
        self._release = release

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def adopt(self, other: DeviceTensor) -> None:
        """Swap storage with ``other`` (same shape): this tensor takes its buffer and dtype, and
        ``other`` now owns, and will release, the old buffer. Used to retype weights in place."""
        if other.shape != self.shape:
            raise ValueError(f"cannot adopt a buffer of shape {other.shape} into {self.shape}")
        self.ptr, other.ptr = other.ptr, self.ptr
        self.dtype, other.dtype = other.dtype, self.dtype
        self.nbytes, other.nbytes = other.nbytes, self.nbytes
        self.capacity, other.capacity = other.capacity, self.capacity
        self._release, other._release = other._release, self._release

    def free(self) -> None:
        release, self._release = self._release, None
        if release is not None:
            release(self.ptr, self.capacity)

    def __del__(self) -> None:
        release = self._release
        if release is not None:
            self._release = None
            # A try costs nothing until it catches; contextlib.suppress cost a third of an allocation.
            try:
                release(self.ptr, self.capacity)
            except Exception:  # noqa: BLE001 - at interpreter shutdown the driver may be gone
                pass

    def __repr__(self) -> str:
        return f"DeviceTensor(shape={self.shape}, dtype={self.dtype}, ptr=0x{self.ptr:x})"


def itemsize(dtype: str) -> int:
    size = ITEMSIZE.get(dtype)
    return size if size is not None else np.dtype(dtype).itemsize


def size_class(nbytes: int) -> int:
    """Bytes actually reserved for a request: small sizes round to 512 bytes, medium ones to
    eighths of their power of two (at most 12.5% waste), large ones (>= 64 MiB) to 2 MiB."""
    if nbytes <= 512:
        return 512
    if nbytes < 1 << 20:
        return -(-nbytes // 512) * 512
    if nbytes < 64 << 20:
        step = 1 << (nbytes.bit_length() - 1 - 3)
        return -(-nbytes // step) * step
    return -(-nbytes // (2 << 20)) * (2 << 20)


LARGE = 64 << 20
"""Blocks this big are returned to the driver, not cached (page pools, big weights)."""


def device_pool(alloc: Callable[[int], int], free: Callable[[int], None], synchronize: Callable[[], None]) -> BufferPool[int]:
    """The kit's buffer pool over the driver's alloc and free, of :func:`size_class` blocks: every block
    but a :data:`LARGE` one is kept, and a block goes back to the driver only after a sync (work queued
    before may still read it: the driver must not hand it out yet)."""

    def synchronized_free(ptr: int) -> None:
        synchronize()
        free(ptr)

    return BufferPool(alloc, synchronized_free, keep_bytes=1 << 62, capacity=size_class, largest_kept=LARGE)
