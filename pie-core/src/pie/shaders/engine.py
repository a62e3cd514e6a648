"""The hooks every engine of the shared kernels implements the same way.

An engine subclasses :class:`ShaderEngine`, adds the hooks that differ (engine
info, device probing, diagnosis, kernel source) and says how to open a device
(:meth:`ShaderEngine.open_backend`); its entry point names an instance. Kernels,
page hooks and transfers then behave identically on Vulkan and WebGPU.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from pie.contract import KV_DTYPES, DeviceInfo, KernelRequest, Launcher, PageLayout, kv_host_dtype
from pie.hookspecs import hookimpl
from pie.shaders.launch import (
    EPILOGUE_VARIANTS,
    STORED_TYPE_KERNELS,
    STORED_TYPES,
    VARIANTS,
    Backend,
    Launchers,
)
from pie.shaders.tensor import GpuTensor, StoredTensor
from pie.weights import StoredWeight


class DeviceBackend(Backend, Protocol):
    """A :class:`Backend` that also moves data to and from the host."""

    def zeros(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> GpuTensor: ...
    def upload(self, array: np.ndarray) -> GpuTensor: ...
    def download(self, tensor: GpuTensor) -> np.ndarray: ...
    def read_pages(self, pool: GpuTensor, page_ids: np.ndarray) -> np.ndarray: ...
    def write_pages(self, pool: GpuTensor, page_ids: np.ndarray, data: np.ndarray) -> None: ...
    def copy_pages(self, pool: GpuTensor, source_ids: np.ndarray, destination_ids: np.ndarray) -> None: ...
    def synchronize(self) -> None: ...


class ShaderEngine:
    """Common hook implementations; one backend and one set of launchers per device, opened on first use."""

    name = ""
    runtime_wgsl = False
    """Whether the backend compiles WGSL when running: then eta epilogues run on it."""

    def __init__(self) -> None:
        self._backends: dict[int, DeviceBackend] = {}
        self._launchers: dict[int, Launchers] = {}

    def epilogue_target(self) -> str | None:
        """The eta render target whose source the backend compiles when running (then eta epilogues run on
        it), or None; an engine whose compiler is optional overrides this."""
        return "wgsl" if self.runtime_wgsl else None

    def open_backend(self, device: DeviceInfo) -> DeviceBackend:
        raise NotImplementedError

    def backend(self, device: DeviceInfo) -> DeviceBackend:
        backend = self._backends.get(device.index)
        if backend is None:
            backend = self._backends[device.index] = self.open_backend(device)
        return backend

    def launchers(self, device: DeviceInfo) -> Launchers:
        launchers = self._launchers.get(device.index)
        if launchers is None:
            backend = self.backend(device)
            target = self.epilogue_target()
            launchers = Launchers(backend, epilogues=target is not None, epilogue_target=target or "wgsl")
            self._launchers[device.index] = launchers
        return launchers

    def close(self, device: DeviceInfo) -> None:
        """Drop the device's backend and launchers; a backend that holds something outside this process
        (a browser page) is closed. The device opens afresh on next use."""
        self._launchers.pop(device.index, None)
        backend = self._backends.pop(device.index, None)
        close = getattr(backend, "close", None)
        if close is not None:
            close()

    @hookimpl
    def pie_device_profiles(self) -> Sequence[str]:
        from pie.profiles.shipped import shipped_profiles

        return shipped_profiles(type(self).__module__.partition(".")[0])

    @hookimpl
    def pie_list_kernels(self, device: DeviceInfo) -> Mapping[str, Sequence[str]] | None:
        return {**VARIANTS, "epilogue": EPILOGUE_VARIANTS} if self.epilogue_target() else dict(VARIANTS)

    @hookimpl
    def pie_compile_kernel(self, device: DeviceInfo, request: KernelRequest) -> Launcher | None:
        return self.launchers(device).compile(request)

    @hookimpl
    def pie_synchronize(self, device: DeviceInfo) -> None:
        self.backend(device).synchronize()

    @hookimpl
    def pie_kv_dtypes(self, device: DeviceInfo) -> Sequence[str]:
        return tuple(KV_DTYPES)

    @hookimpl
    def pie_allocate_pages(self, device: DeviceInfo, layout: PageLayout) -> Any:
        if layout.dtype not in KV_DTYPES:
            raise ValueError(f"the {self.name} engine keeps KV pages in {', '.join(KV_DTYPES)}, not {layout.dtype}")
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
        return dict.fromkeys(STORED_TYPE_KERNELS, STORED_TYPES)

    @hookimpl
    def pie_upload_weights(self, device: DeviceInfo, arrays: Sequence[Any]) -> list[Any] | None:
        backend = self.backend(device)
        return [self._upload_weight(backend, weight) for weight in arrays]

    def _upload_weight(self, backend: DeviceBackend, weight: Any) -> GpuTensor | StoredTensor:
        if not isinstance(weight, StoredWeight):
            return backend.upload(weight)
        if weight.type not in STORED_TYPES:
            raise ValueError(
                f"the {self.name} engine reads weights stored as {', '.join(STORED_TYPES)} or float32, not {weight.type}"
            )
        return StoredTensor(backend.upload(StoredTensor.packed(weight.data)), weight.type, weight.shape)

    @hookimpl
    def pie_download(self, device: DeviceInfo, tensor: GpuTensor) -> np.ndarray | None:
        return self.backend(device).download(tensor)
