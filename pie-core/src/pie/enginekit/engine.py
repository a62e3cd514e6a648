"""The hooks every engine of the shared kit implements the same way.

:class:`DeviceEngine` supplies the page hooks, transfers and weight uploads over a
:class:`HostBackend` per device; an engine with its own kernels (Metal, CUDA) subclasses it, or
:class:`PassPlanEngine` when its kernels read the pass plan, and adds its kernel hooks; it states the
largest head_dim its attention takes (:attr:`DeviceEngine.max_head_dim`), and a model beyond it is refused
while its plan is built.
:class:`ShaderEngine` adds the shared Slang kernels' launchers to it: an engine of those
subclasses it, adds the hooks that differ (engine info, device probing, diagnosis, kernel
source) and says how to open a device (:meth:`DeviceEngine.open_backend`); its entry point
names an instance. Kernels, page hooks and transfers then behave identically on Vulkan and WebGPU, and
so do the bounds on one layer of a page pool, which they bind as one storage range, and on the whole pool,
which they hold in one buffer.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from pie.contract import (
    KV_DTYPES,
    DeviceInfo,
    KernelRequest,
    Launcher,
    PageLayout,
    PassPlan,
    RegionRequest,
    kv_host_dtype,
)
from pie.enginekit.blocks import check_head_dim
from pie.enginekit.shaders.launch import (
    EPILOGUE_VARIANTS,
    MAX_HEAD_DIM,
    STORED_TYPES,
    VARIANTS,
    Backend,
    Launchers,
    max_pool_layer_bytes,
)
from pie.enginekit.tensor import ALIGNMENT, GpuTensor, StoredTensor
from pie.hookspecs import hookimpl
from pie.kernels import WEIGHT_KERNELS
from pie.plugins import EngineError
from pie.weights import StoredWeight


class HostBackend(Protocol):
    """One opened device as the shared hooks use it: tensors to and from the host, and page pools."""

    def zeros(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> GpuTensor: ...
    def upload(self, array: np.ndarray) -> GpuTensor: ...
    def download(self, tensor: GpuTensor) -> np.ndarray: ...
    def read_pages(self, pool: GpuTensor, page_ids: np.ndarray) -> np.ndarray: ...
    def write_pages(self, pool: GpuTensor, page_ids: np.ndarray, data: np.ndarray) -> None: ...
    def copy_pages(self, pool: GpuTensor, source_ids: np.ndarray, destination_ids: np.ndarray) -> None: ...
    def synchronize(self) -> None: ...


class DeviceBackend(Backend, HostBackend, Protocol):
    """A :class:`Backend` of the shared kernels that also moves data to and from the host."""


class DeviceEngine:
    """Hook implementations over one :class:`HostBackend` per device, opened on first use."""

    name = ""
    kv_dtypes: tuple[str, ...] = tuple(KV_DTYPES)
    """The element types of the page pools the engine's kernels read (``pie_kv_dtypes``)."""
    stored_types: tuple[str, ...] = STORED_TYPES
    """The weight types (``pie.weights``) the kernels read as stored (:class:`StoredTensor`)."""
    stored_type_kernels: tuple[str, ...] = WEIGHT_KERNELS
    """The kernels whose weight input may be stored (every variant)."""
    max_head_dim: int | None = None
    """The largest head_dim the engine's attention takes (None: any); a model's layer beyond it is refused when
    its block is compiled (``pie_compile_block``), before the weights load."""

    def __init__(self) -> None:
        self._backends: dict[Hashable, HostBackend] = {}

    def open_backend(self, device: DeviceInfo) -> HostBackend:
        raise NotImplementedError

    def backend_key(self, device: DeviceInfo) -> Hashable:
        """What tells the engine's opened devices apart: the index, unless one index can be opened as
        several devices (CUDA's backends and compile targets)."""
        return device.index

    def backend(self, device: DeviceInfo) -> HostBackend:
        key = self.backend_key(device)
        backend = self._backends.get(key)
        if backend is None:
            backend = self._backends[key] = self.open_backend(device)
        return backend

    def close(self, device: DeviceInfo) -> None:
        """Drop the device's backend; a backend that holds something outside this process (a browser
        page) is closed. The device opens afresh on next use."""
        backend = self._backends.pop(self.backend_key(device), None)
        close = getattr(backend, "close", None)
        if close is not None:
            close()

    @hookimpl
    def pie_device_profiles(self) -> Sequence[str]:
        from pie.profiles.shipped import shipped_profiles

        return shipped_profiles(type(self).__module__.partition(".")[0])

    @hookimpl
    def pie_synchronize(self, device: DeviceInfo) -> None:
        self.backend(device).synchronize()

    @hookimpl
    def pie_kv_dtypes(self, device: DeviceInfo) -> Sequence[str]:
        return self.kv_dtypes

    @hookimpl
    def pie_compile_block(self, device: DeviceInfo, block: RegionRequest) -> Launcher | None:
        """Refuses a layer whose head_dim is beyond :attr:`max_head_dim`; runs no block as one launch."""
        check_head_dim(self.name, block, self.max_head_dim)
        return None

    def page_pool_layer_bound(self, device: DeviceInfo) -> int | None:
        """The most bytes one layer of a page pool may take on ``device``, which :meth:`pie_allocate_pages` holds a
        layout to; None, no bound, unless the engine's kernels bind a layer as a range the device bounds (then it
        also states it: ``pie_max_page_pool_layer_bytes``, as :class:`ShaderEngine` does)."""
        return None

    @hookimpl
    def pie_allocate_pages(self, device: DeviceInfo, layout: PageLayout) -> Any:
        if layout.dtype not in self.kv_dtypes:
            raise ValueError(
                f"the {self.name} engine keeps KV pages in {', '.join(self.kv_dtypes)}, not {layout.dtype}"
            )
        limit = self.page_pool_layer_bound(device)
        if limit is not None and layout.layer_bytes > limit:
            raise EngineError(
                f"the {self.name} engine binds at most {limit} bytes of one layer's KV pages on {device.key}: "
                f"{layout.num_pages} pages of {layout.page_size} tokens take {layout.layer_bytes} bytes a layer "
                f"(at most {limit // (layout.layer_bytes // layout.num_pages)} pages fit)"
            )
        dtype = kv_host_dtype(layout.dtype)
        if dtype.itemsize == 2 and layout.head_dim % 2:
            raise ValueError(
                f"the {self.name} engine packs {layout.dtype} KV pages two elements a word: "
                f"head_dim {layout.head_dim} is odd (use float32 KV pages)"
            )
        return self.backend(device).zeros(layout.shape, dtype)

    @hookimpl
    def pie_free_pages(self, device: DeviceInfo, pool: GpuTensor) -> None:
        pool.free()

    @hookimpl
    def pie_read_pages(self, device: DeviceInfo, pool: GpuTensor, page_ids: np.ndarray) -> np.ndarray | None:
        return self.backend(device).read_pages(pool, page_ids)

    @hookimpl
    def pie_write_pages(self, device: DeviceInfo, pool: GpuTensor, page_ids: np.ndarray, data: np.ndarray) -> None:
        self.backend(device).write_pages(pool, page_ids, data)

    @hookimpl
    def pie_copy_pages(
        self, device: DeviceInfo, pool: GpuTensor, source_ids: np.ndarray, destination_ids: np.ndarray
    ) -> None:
        self.backend(device).copy_pages(pool, source_ids, destination_ids)

    @hookimpl
    def pie_upload(self, device: DeviceInfo, array: np.ndarray) -> GpuTensor | None:
        return self.backend(device).upload(array)

    @hookimpl
    def pie_weight_types(self, device: DeviceInfo) -> Mapping[str, Sequence[str]] | None:
        return dict.fromkeys(self.stored_type_kernels, self.stored_types)

    @hookimpl
    def pie_upload_weights(self, device: DeviceInfo, arrays: Sequence[Any]) -> list[Any] | None:
        backend = self.backend(device)
        return [self._upload_weight(backend, weight) for weight in arrays]

    def _upload_weight(self, backend: HostBackend, weight: Any) -> GpuTensor | StoredTensor:
        if not isinstance(weight, StoredWeight):
            return backend.upload(weight)
        if weight.type not in self.stored_types:
            raise ValueError(
                f"the {self.name} engine reads weights stored as {', '.join(self.stored_types)} or float32, "
                f"not {weight.type}"
            )
        return self._upload_stored(backend, weight)

    def _upload_stored(self, backend: HostBackend, weight: StoredWeight) -> Any:
        """A weight stored as one of :attr:`stored_types` on the device: by default its bytes as u32 words."""
        return StoredTensor(backend.upload(StoredTensor.packed(weight.data)), weight.type, weight.shape)

    @hookimpl
    def pie_download(self, device: DeviceInfo, tensor: GpuTensor) -> np.ndarray | None:
        return self.backend(device).download(tensor)


class PassPlanEngine(DeviceEngine):
    """A :class:`DeviceEngine` whose kernels read the running pass's plan: the device's backend holds it as
    ``pass_plan`` from ``pie_begin_pass`` to ``pie_end_pass``, None between passes (Metal's attention chooses
    its kernel by it, CUDA's uploads its work items from it)."""

    @hookimpl
    def pie_begin_pass(self, device: DeviceInfo, plan: PassPlan) -> None:
        backend: Any = self.backend(device)  # a backend of such an engine has a pass_plan
        backend.pass_plan = plan

    @hookimpl
    def pie_end_pass(self, device: DeviceInfo) -> None:
        backend: Any = self.backend(device)
        backend.pass_plan = None


class ShaderEngine(PassPlanEngine):
    """The shared Slang kernels' hooks on top: one set of launchers per device, built on first use (the attention
    launcher reads the pass plan's longest sequence)."""

    runtime_wgsl = False
    """Whether the backend compiles WGSL when running: then eta epilogues run on it."""
    max_head_dim = MAX_HEAD_DIM

    def __init__(self) -> None:
        super().__init__()
        self._launchers: dict[int, Launchers] = {}

    def epilogue_target(self) -> str | None:
        """The eta render target whose source the backend compiles when running (then eta epilogues run on
        it), or None; an engine whose compiler is optional overrides this."""
        return "wgsl" if self.runtime_wgsl else None

    def open_backend(self, device: DeviceInfo) -> DeviceBackend:
        raise NotImplementedError

    def launchers(self, device: DeviceInfo) -> Launchers:
        launchers = self._launchers.get(device.index)
        if launchers is None:
            backend: Any = self.backend(device)  # a DeviceBackend: open_backend opens those
            target = self.epilogue_target()
            launchers = Launchers(backend, epilogues=target is not None, epilogue_target=target or "wgsl")
            self._launchers[device.index] = launchers
        return launchers

    def close(self, device: DeviceInfo) -> None:
        """Drop the device's launchers and backend (:meth:`DeviceEngine.close`)."""
        self._launchers.pop(device.index, None)
        super().close(device)

    def page_pool_layer_bound(self, device: DeviceInfo) -> int | None:
        return max_pool_layer_bytes(self.launchers(device).backend)

    @hookimpl
    def pie_max_page_pool_layer_bytes(self, device: DeviceInfo) -> int | None:
        return self.page_pool_layer_bound(device)

    @hookimpl
    def pie_upload_weights(self, device: DeviceInfo, arrays: Sequence[Any]) -> list[Any] | None:
        """Refuses, before any is uploaded, a weight no launch can bind: one larger than a buffer, or one larger than
        a storage binding whose aligned rows no launch binds (projections and embeddings run a larger weight in
        chunks of its rows, ``Launchers.weight_rows_per_launch``; a norm's one row is bound whole). Refused when a
        kernel ran it instead, the model loaded and every step failed (`pie serve` said it was ready, then answered
        each request with a 500)."""
        launchers = self.launchers(device)
        backend = launchers.backend
        for weight in arrays:
            stored = isinstance(weight, StoredWeight)
            nbytes = StoredTensor.packed_bytes(weight.data.nbytes) if stored else int(weight.nbytes)
            rows = weight.shape[0] if len(weight.shape) == 2 else 1
            row_bytes = (weight.data.nbytes if stored else nbytes) // rows
            limit, what = backend.max_binding_bytes, "binds at most"
            if nbytes > backend.max_buffer_bytes:
                limit, what = backend.max_buffer_bytes, "holds at most"
            elif nbytes <= limit or launchers.weight_rows_per_launch(row_bytes, stored) > 0:
                continue
            kind = weight.type if stored else str(weight.dtype)
            smaller = "--dtype float16, or " if kind == "float32" else ""
            raise EngineError(
                f"the {self.name} engine {what} {limit} bytes of one weight on {device.key}: a "
                f"{'x'.join(map(str, weight.shape))} weight of {kind} takes {nbytes} bytes (use {smaller}"
                "--engine cpu or xla)"
            )
        return super().pie_upload_weights(device, arrays)

    @hookimpl
    def pie_max_page_pool_bytes(self, device: DeviceInfo) -> int | None:
        """A pool is one buffer (:meth:`pie_allocate_pages`): at most the device's largest, in whole size classes (the
        buffer pool rounds a buffer up to a multiple of ``ALIGNMENT`` bytes)."""
        return self.launchers(device).backend.max_buffer_bytes // ALIGNMENT * ALIGNMENT

    @hookimpl
    def pie_list_kernels(self, device: DeviceInfo) -> Mapping[str, Sequence[str]] | None:
        return {**VARIANTS, "epilogue": EPILOGUE_VARIANTS} if self.epilogue_target() else dict(VARIANTS)

    @hookimpl
    def pie_compile_kernel(self, device: DeviceInfo, request: KernelRequest) -> Launcher | None:
        return self.launchers(device).compile(request)
