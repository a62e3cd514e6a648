"""Device tensors, buffer reuse, pipeline cache and command-buffer batching for one device.

Every tensor is a shared-storage buffer (unified memory on Apple silicon): an upload
copies into the buffer's contents, a download waits for the GPU and copies out.
Launches only *encode* dispatches; the open command buffer is submitted every
``dispatches_per_commit`` dispatches (so the GPU starts while Python keeps encoding)
and on every download, page read/write or synchronize, which also waits.

Buffers of dead tensors are reused. A kernel may write into one at once: dispatches
on one queue run in order, so whatever read the old contents has run before. The CPU
may only write into one (an upload) once every command buffer that could still read
it has completed; each returned buffer remembers the command buffer that was open
(its *epoch*) for that check.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from pie.contract import DeviceInfo, PassPlan
from pie.weights import F32 as F32_TYPE
from pie.weights import StoredWeight

from pie_engine_metal.driver import Driver, Pipeline, Size
from pie_engine_metal.library import FUNCTIONS, Function, constant_values, source
from pie_engine_metal.weights import STORED_TYPES, host_bytes

F32 = np.dtype(np.float32)
I32 = np.dtype(np.int32)
ALIGNMENT = 16
"""Buffer sizes are rounded to this; buffers of equal capacity are reused for each other."""
MAX_ELEMENTS = 2**32 - 1
"""Kernels index with 32-bit integers."""


class MetalTensor:
    """A device tensor: a shared buffer, its shape and dtype."""

    __slots__ = (
        "buffer", "shape", "dtype", "nbytes", "capacity", "static", "weight_type", "logical_shape", "_context",
        "host_absmax", "__weakref__",
    )

    def __init__(
        self, context: OpenedDevice, buffer: Any, capacity: int, shape: tuple[int, ...], dtype: np.dtype, static: bool
    ):
        self._context: OpenedDevice | None = context
        self.buffer = buffer
        self.capacity = capacity
        self.shape = shape
        self.dtype = dtype
        self.nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        self.static = static
        """Uploaded from the host and never written by a kernel (weights, tables)."""
        self.host_absmax: float | None = None
        """Largest magnitude of a static tensor, once the Neural Engine rule has asked for it."""
        self.weight_type = F32_TYPE
        """The ``pie.weights`` type of a weight uploaded as stored (``f32`` for every other tensor)."""
        self.logical_shape = self.shape
        """The matrix a stored weight holds: ``[rows, cols]`` (``shape`` is that of its stored data)."""

    @property
    def size(self) -> int:
        return self.nbytes // self.dtype.itemsize

    def __repr__(self) -> str:
        return f"MetalTensor(shape={self.shape}, dtype={self.dtype})"

    def release(self) -> None:
        """Give the buffer back now; the tensor must not be used again."""
        context, self._context = self._context, None
        if context is not None and self.buffer is not None:
            context.give_back(self.buffer, self.capacity)
        self.buffer = None

    def __del__(self) -> None:
        self.release()


class Recycler:
    """Free buffers by capacity, each with the epoch in which it was returned.

    Buffers over ``largest`` (page pools, weights) are not kept: Metal frees them once
    no command buffer holds them.
    """

    def __init__(self, limit_bytes: int, largest: int = 64 << 20):
        self.limit_bytes = limit_bytes
        self.largest = largest
        self.cached_bytes = 0
        self._free: dict[int, list[tuple[Any, int]]] = {}

    def give_back(self, buffer: Any, capacity: int, epoch: int) -> None:
        if capacity > self.largest or self.cached_bytes + capacity > self.limit_bytes:
            return
        self._free.setdefault(capacity, []).append((buffer, epoch))
        self.cached_bytes += capacity

    def take(self, capacity: int, completed_epoch: int | None = None) -> Any | None:
        """A free buffer of ``capacity``: any one for GPU writes (None), else one whose epoch has completed."""
        bucket = self._free.get(capacity)
        if not bucket:
            return None
        if completed_epoch is None:
            buffer, _ = bucket.pop()
        else:
            index = next((i for i, (_, epoch) in enumerate(bucket) if epoch <= completed_epoch), None)
            if index is None:
                return None
            buffer, _ = bucket.pop(index)
        self.cached_bytes -= capacity
        return buffer


class OpenedDevice:
    """One opened device: the driver plus the engine's host-side state for it."""

    def __init__(
        self,
        driver: Driver,
        info: DeviceInfo,
        *,
        dispatches_per_commit: int = 64,
        cache_limit_bytes: int = 1 << 30,
    ):
        self.driver = driver
        self.info = info
        self.dispatches_per_commit = dispatches_per_commit
        self.recycler = Recycler(cache_limit_bytes)
        self.epoch = 1
        """The command buffer being encoded; earlier ones are submitted."""
        self.completed = 0
        """Every command buffer up to this epoch has completed."""
        self.pending = 0
        """Dispatches in the open command buffer."""
        self.dispatches = 0
        self.pass_plan: PassPlan | None = None
        """The running pass's plan (``pie_begin_pass`` to ``pie_end_pass``), None between passes."""
        self._libraries: dict[str, Any] = {}
        self._pipelines: dict[tuple[str, tuple[tuple[str, bool | int | float], ...]], Pipeline] = {}
        self.placeholder = self._new_buffer(ALIGNMENT)
        """Bound where a kernel's optional input is absent; never read."""
        np.frombuffer(driver.contents(self.placeholder, ALIGNMENT), np.uint8)[:] = 0

    # -- pipelines ----------------------------------------------------------------

    def pipeline(self, name: str, **constants: bool | int | float) -> Pipeline:
        """The pipeline of MSL function ``name`` specialised with ``constants`` (built once, then cached)."""
        function: Function = FUNCTIONS[name]
        key = (name, tuple(sorted(constants.items())))
        pipeline = self._pipelines.get(key)
        if pipeline is None:
            library = self._libraries.get(function.library)
            if library is None:
                library = self.driver.compile_library(function.library, source(function.library))
                self._libraries[function.library] = library
            pipeline = self.driver.new_pipeline(library, name, constant_values(function, constants))
            self._pipelines[key] = pipeline
        return pipeline

    @property
    def pipeline_keys(self) -> list[tuple[str, tuple[tuple[str, bool | int | float], ...]]]:
        return list(self._pipelines)

    # -- tensors ------------------------------------------------------------------

    def _new_buffer(self, capacity: int) -> Any:
        return self.driver.new_buffer(capacity)

    def give_back(self, buffer: Any, capacity: int) -> None:
        # With nothing encoded yet, every reader sits in an earlier command buffer.
        self.recycler.give_back(buffer, capacity, self.epoch if self.pending else self.epoch - 1)

    def _tensor(self, shape: tuple[int, ...], dtype: np.dtype, *, for_cpu: bool, static: bool) -> MetalTensor:
        count = int(np.prod(shape, dtype=np.int64))
        if count > MAX_ELEMENTS:
            raise ValueError(
                f"a tensor of shape {shape} has more than 2**32 elements; the Metal kernels index with 32 bits"
            )
        capacity = max(ALIGNMENT, -(-count * dtype.itemsize // ALIGNMENT) * ALIGNMENT)
        buffer = self.recycler.take(capacity, self.completed if for_cpu else None)
        if buffer is None:
            buffer = self._new_buffer(capacity)
        return MetalTensor(self, buffer, capacity, tuple(int(s) for s in shape), dtype, static)

    def empty(self, shape: tuple[int, ...], dtype: np.dtype = F32) -> MetalTensor:
        """A tensor for a kernel to write (its contents are unspecified)."""
        return self._tensor(shape, dtype, for_cpu=False, static=False)

    def upload(self, array: np.ndarray, *, static: bool = True) -> MetalTensor:
        """Copy a host array into a new tensor; ``static`` marks model data no kernel writes."""
        host = np.ascontiguousarray(array)
        tensor = self._tensor(host.shape, host.dtype, for_cpu=True, static=static)
        if host.size:
            np.copyto(self.view(tensor).reshape(-1), host.reshape(-1))
        return tensor

    def upload_weight(self, weight: np.ndarray | StoredWeight) -> MetalTensor:
        """A model weight: a float32 array, or a stored weight with its bytes as stored."""
        if not isinstance(weight, StoredWeight):
            return self.upload(weight)
        if weight.type not in STORED_TYPES:
            raise ValueError(f"the Metal engine does not read {weight.type} weights as stored")
        tensor = self.upload(host_bytes(weight))
        tensor.weight_type, tensor.logical_shape = weight.type, weight.shape
        return tensor

    def view(self, tensor: MetalTensor) -> np.ndarray:
        """The tensor's contents as a writable numpy array, without waiting for the GPU."""
        if tensor.buffer is None:
            raise ValueError("this Metal tensor was released")
        raw = self.driver.contents(tensor.buffer, tensor.nbytes)
        return np.frombuffer(raw, dtype=tensor.dtype, count=tensor.size).reshape(tensor.shape)

    def download(self, tensor: MetalTensor) -> np.ndarray:
        self.synchronize()
        return self.view(tensor).copy()

    # -- dispatch -----------------------------------------------------------------

    def dispatch(
        self,
        pipeline: Pipeline,
        function: Function,
        buffers: Sequence[tuple[Any, int]],
        params: bytes,
        groups: Size,
        threads: Size,
    ) -> None:
        """Encode one dispatch; grids with no threads are skipped."""
        if len(buffers) != len(function.buffers):
            raise ValueError(f"{function.name} binds {len(function.buffers)} buffers, got {len(buffers)}")
        if threads[0] * threads[1] * threads[2] > pipeline.max_threads:
            limit = pipeline.max_threads
            raise ValueError(f"{function.name}: {threads} threads per threadgroup exceed the pipeline's {limit}")
        if groups[0] * groups[1] * groups[2] == 0:
            return
        self.driver.encode(pipeline, buffers, params, groups, threads)
        self.pending += 1
        self.dispatches += 1
        if self.pending >= self.dispatches_per_commit:
            self.commit()

    def commit(self) -> None:
        """Submit the open command buffer without waiting."""
        if self.pending:
            self.driver.commit()
            self.epoch += 1
            self.pending = 0

    def synchronize(self) -> None:
        """Submit what is encoded and wait for all of it."""
        self.commit()
        if self.completed < self.epoch - 1:
            self.driver.wait()
            self.completed = self.epoch - 1
