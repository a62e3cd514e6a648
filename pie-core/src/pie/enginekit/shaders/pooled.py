"""A backend that records a submission's work and the uniform blocks of its dispatches, over a few primitives.

What a backend of the shared kernels does the same way whatever runs the commands (Vulkan, wgpu-native, a
browser page): tensors are buffers from a :class:`BufferPool`, uploads and page writes are byte writes, and the
uniform blocks of one submission lie back to back in one buffer, each at the device's dynamic-offset
alignment, so a dispatch binds its block by offset and bind groups depend only on the storage buffers. A
subclass creates, destroys, clears and writes buffers, and sends what is recorded (:meth:`flush`), which
takes :meth:`_take_params` with it.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any

import numpy as np

from pie.enginekit.shaders.launch import BufferRange
from pie.enginekit.tensor import BufferPool, GpuTensor
from pie.enginekit.transfers import HostTransfers
from pie.plugins import EngineError

PLACEHOLDER_BYTES = 256


class PooledBackend(HostTransfers):
    """The shared launchers' backend (:class:`pie.enginekit.shaders.launch.Backend`) as far as it needs no device API."""

    def __init__(self, storage_alignment: int, max_binding_bytes: int, uniform_alignment: int, params_capacity: int,
                 max_buffer_bytes: int):
        """Call once the subclass can create buffers; ``params_capacity`` is the bytes of its uniform-block buffer,
        ``max_buffer_bytes`` the most one buffer may take (Vulkan's maxMemoryAllocationSize, WebGPU's maxBufferSize)."""
        self.storage_alignment = storage_alignment
        self.max_binding_bytes = max_binding_bytes
        self.max_buffer_bytes = max_buffer_bytes
        self._uniform_alignment = uniform_alignment
        self._params_capacity = params_capacity
        self._params = bytearray()
        self.pool: BufferPool[Any] = BufferPool(self._new_buffer, self._destroy_buffer, release=self.flush)
        self.placeholder: BufferRange = (self._create_buffer(PLACEHOLDER_BYTES), 0, PLACEHOLDER_BYTES)

    def _new_buffer(self, capacity: int) -> Any:
        """A buffer of :meth:`_create_buffer`, refused (EngineError) where it is more than the device takes: asked for
        it, a wgpu device reported a validation error (an internal error to `pie run`), a browser's was lost."""
        if capacity > self.max_buffer_bytes:
            raise EngineError(
                f"a buffer of {capacity} bytes is more than the device takes (max buffer size {self.max_buffer_bytes} "
                "bytes); it was refused before reaching the device, which is still usable"
            )
        return self._create_buffer(capacity)

    @abstractmethod
    def _create_buffer(self, capacity: int) -> Any:
        """A storage buffer of ``capacity`` bytes (copyable both ways); where the device has no memory left for it,
        the MemoryError of :func:`pie.enginekit.tensor.device_memory_exhausted`."""

    @abstractmethod
    def _destroy_buffer(self, buffer: Any) -> None:
        """Called by the pool; work already recorded may still use the buffer (a backend that therefore destroys it
        later does so by :meth:`flush`, which the pool calls before it retries a buffer that did not fit)."""

    @abstractmethod
    def _clear(self, buffer: Any, size: int) -> None:
        """Zero the first ``size`` bytes, in order with the recorded work."""

    @abstractmethod
    def _write(self, buffer: Any, offset: int, data: np.ndarray) -> None:
        """Write ``data`` (uint8) at ``offset``, after the work recorded so far has read what was there."""

    @abstractmethod
    def flush(self) -> None:
        """Send everything recorded so far (the uniform blocks from :meth:`_take_params` with it)."""

    def empty(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> GpuTensor:
        return GpuTensor(self.pool, shape, dtype)

    def zeros(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> GpuTensor:
        tensor = self.empty(shape, dtype)
        self._clear(tensor.buffer, tensor.capacity)
        return tensor

    def upload(self, array: np.ndarray) -> GpuTensor:
        """A new tensor holding ``array``; its bytes are padded to whole 4-byte words (the buffer has room)."""
        host = np.ascontiguousarray(array)
        tensor = self.empty(host.shape, host.dtype)
        if tensor.nbytes:
            data = host.reshape(-1).view(np.uint8)
            if data.nbytes % 4:
                data = np.concatenate([data, np.zeros(-data.nbytes % 4, np.uint8)])
            self._write(tensor.buffer, 0, data)
        return tensor

    def _write_regions(self, buffer: Any, regions: list[tuple[int, int]], host: np.ndarray) -> None:
        start = 0
        for offset, size in regions:
            self._write(buffer, offset, host[start : start + size])
            start += size

    def _place_params(self, params: bytes) -> int:
        """Add a dispatch's uniform block to this submission's; its byte offset in the uniform-block buffer.
        Where the buffer is full, what is recorded is sent first and the block starts the next submission."""
        offset = -(-len(self._params) // self._uniform_alignment) * self._uniform_alignment
        if offset + len(params) > self._params_capacity:
            self.flush()
            offset = 0
        self._params += bytes(offset - len(self._params))
        self._params += params
        return offset

    def _take_params(self) -> bytearray:
        """The uniform blocks placed since the last call, which starts the next submission's."""
        params, self._params = self._params, bytearray()
        return params
