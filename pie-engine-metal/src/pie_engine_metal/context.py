"""One opened Metal device: tensors, the pipeline cache and command-buffer batching.

Every tensor is a shared-storage buffer (unified memory on Apple silicon) from the kit's
:class:`pie.enginekit.tensor.BufferPool`: a dead tensor's buffer goes to the next tensor of its size.
Launches only *encode* dispatches; the open command buffer is submitted every
``dispatches_per_commit`` dispatches (so the GPU starts while Python keeps encoding). A kernel may
write into a recycled buffer at once: dispatches on one queue run in order, so whatever read the
old contents has run before. The host reads and writes buffers directly, so every host access (an
upload, a download, page reads, writes and copies) first waits for the queued work.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from pie.contract import DeviceInfo, PassPlan
from pie.enginekit.tensor import ALIGNMENT, BufferPool, GpuTensor
from pie.enginekit.transfers import HostTransfers

from pie_engine_metal.driver import Driver, Pipeline, Size
from pie_engine_metal.library import FUNCTIONS, Function, constant_values, source

F32 = np.dtype(np.float32)
I32 = np.dtype(np.int32)
MAX_ELEMENTS = 2**32 - 1
"""Kernels index with 32-bit integers."""
PipelineKey = tuple[str, tuple[tuple[str, bool | int | float], ...]]


@dataclass(frozen=True)
class Kernel:
    """An MSL function's pipeline on one device, ready to encode."""

    device: OpenedDevice
    function: Function
    pipeline: Pipeline

    def __call__(
        self, tensors: Sequence[GpuTensor | tuple[Any, int]], params: Sequence[int], grid: tuple[Size, Size]
    ) -> None:
        """Encode one dispatch; ``tensors`` are bound in the function's order (a tensor at its start,
        else a (buffer, byte offset) pair)."""
        buffers = [(t.buffer, 0) if isinstance(t, GpuTensor) else t for t in tensors]
        self.device.dispatch(self.pipeline, self.function, buffers, self.function.pack(*params), *grid)


class OpenedDevice(HostTransfers):
    """One opened device: the driver plus the engine's host-side state for it."""

    def __init__(self, driver: Driver, info: DeviceInfo, *, dispatches_per_commit: int = 64):
        self.driver = driver
        self.info = info
        self.dispatches_per_commit = dispatches_per_commit
        # Metal frees a buffer once nothing references it: the pool only drops the ones it does not keep.
        self.pool: BufferPool[Any] = BufferPool(driver.new_buffer, lambda buffer: None)
        self.pending = 0
        """Dispatches in the open command buffer."""
        self.submitted = False
        """Whether command buffers were submitted since the last wait."""
        self.pass_plan: PassPlan | None = None
        """The running pass's plan (``pie_begin_pass`` to ``pie_end_pass``), None between passes."""
        self._libraries: dict[str, Any] = {}
        self._pipelines: dict[PipelineKey, Pipeline] = {}
        self.placeholder = driver.new_buffer(ALIGNMENT)
        """Bound where a kernel's optional input is absent; never read."""

    # -- pipelines ----------------------------------------------------------------

    def kernel(self, name: str, **constants: bool | int | float) -> Kernel:
        """MSL function ``name`` specialised with ``constants`` (its pipeline built once, then cached)."""
        function = FUNCTIONS[name]
        key = (name, tuple(sorted(constants.items())))
        pipeline = self._pipelines.get(key)
        if pipeline is None:
            library = self._libraries.get(function.library)
            if library is None:
                library = self.driver.compile_library(function.library, source(function.library))
                self._libraries[function.library] = library
            pipeline = self.driver.new_pipeline(library, name, constant_values(function, constants))
            self._pipelines[key] = pipeline
        return Kernel(self, function, pipeline)

    @property
    def pipeline_keys(self) -> list[PipelineKey]:
        return list(self._pipelines)

    # -- tensors ------------------------------------------------------------------

    def empty(self, shape: tuple[int, ...], dtype: np.dtype = F32) -> GpuTensor:
        """A tensor for a kernel to write (its contents are unspecified)."""
        if int(np.prod(shape, dtype=np.int64)) > MAX_ELEMENTS:
            raise ValueError(
                f"a tensor of shape {shape} has more than 2**32 elements; the Metal kernels index with 32 bits"
            )
        return GpuTensor(self.pool, shape, dtype)

    def zeros(self, shape: tuple[int, ...], dtype: np.dtype = F32) -> GpuTensor:
        """A zeroed tensor (a page pool): at most the GPU's largest buffer."""
        limit = int(dict(self.info.extra).get("max_buffer_bytes", "0"))
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if limit and nbytes > limit:
            raise ValueError(f"a page pool of {nbytes} bytes exceeds this GPU's largest buffer ({limit} bytes)")
        tensor = self.empty(shape, dtype)
        self.synchronize()
        self.view(tensor)[...] = 0
        return tensor

    def upload(self, array: np.ndarray) -> GpuTensor:
        """Copy a host array into a new tensor."""
        host = np.ascontiguousarray(array)
        tensor = self.empty(host.shape, host.dtype)
        self.synchronize()  # the recycled buffer may still be read by queued work
        np.copyto(self.view(tensor), host)
        return tensor

    def view(self, tensor: GpuTensor) -> np.ndarray:
        """The tensor's contents as a writable numpy array, without waiting for the GPU."""
        raw = self.driver.contents(tensor.buffer, tensor.nbytes)
        return np.frombuffer(raw, dtype=tensor.dtype, count=tensor.size).reshape(tensor.shape)

    def _bytes(self, buffer: Any, nbytes: int) -> np.ndarray:
        return np.frombuffer(self.driver.contents(buffer, nbytes), np.uint8)

    def _read(self, ranges: list[tuple[Any, int, int]]) -> np.ndarray:
        self.synchronize()
        ends: dict[Any, int] = {}
        for buffer, offset, size in ranges:  # one view of each buffer (a page read has a range per page)
            ends[buffer] = max(ends.get(buffer, 0), offset + size)
        views = {buffer: self._bytes(buffer, end) for buffer, end in ends.items()}
        return np.concatenate([views[buffer][offset : offset + size] for buffer, offset, size in ranges])

    def _write_regions(self, buffer: Any, regions: list[tuple[int, int]], host: np.ndarray) -> None:
        self.synchronize()
        contents = self._bytes(buffer, max(offset + size for offset, size in regions))
        start = 0
        for offset, size in regions:
            contents[offset : offset + size] = host[start : start + size]
            start += size

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
        if self.pending >= self.dispatches_per_commit:
            self.commit()

    def commit(self) -> None:
        """Submit the open command buffer without waiting."""
        if self.pending:
            self.driver.commit()
            self.submitted = True
            self.pending = 0

    def synchronize(self) -> None:
        """Submit what is encoded and wait for all of it."""
        self.commit()
        if self.submitted:
            self.driver.wait()
            self.submitted = False
