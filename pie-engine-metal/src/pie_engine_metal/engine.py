"""The Metal engine's hook implementations, over any `Driver`.

`pie_engine_metal.plugin` binds one `MetalEngine` to the system's Metal devices through
PyObjC; tests bind another to a CPU implementation of the driver protocol.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from pie.contract import (
    CONTRACT_VERSION,
    DeviceInfo,
    Diagnosis,
    EngineInfo,
    KernelRequest,
    Launcher,
    PageLayout,
    PassPlan,
    RegionRequest,
)
from pie.hookspecs import hookimpl

from pie_engine_metal import launchers, library
from pie_engine_metal.ane import AneOffload
from pie_engine_metal.context import F32, MetalTensor, OpenedDevice
from pie_engine_metal.driver import Driver
from pie_engine_metal.probe import ENGINE, has_simdgroup_matrices
from pie_engine_metal.weights import READS_STORED, STORED_TYPES


@dataclass(frozen=True)
class DeviceHandle:
    """A device found by discovery and how to open it."""

    info: DeviceInfo
    open: Callable[[], Driver]


class MetalEngine:
    def __init__(
        self,
        discover: Callable[[], Sequence[DeviceHandle]],
        diagnose: Callable[[], Sequence[Diagnosis]],
        ane: Callable[[], AneOffload | None] = lambda: None,
        *,
        dispatches_per_commit: int = 64,
    ):
        self._discover = discover
        self._diagnose = diagnose
        self._ane_factory = ane
        self._dispatches_per_commit = dispatches_per_commit
        self._handles: dict[str, DeviceHandle] | None = None
        self._contexts: dict[str, OpenedDevice] = {}
        self.ane: AneOffload | None = None

    # -- helpers ------------------------------------------------------------------

    def _handles_by_key(self) -> dict[str, DeviceHandle]:
        if self._handles is None:
            self._handles = {handle.info.key: handle for handle in self._discover()}
        return self._handles

    def context(self, device: DeviceInfo) -> OpenedDevice | None:
        """The opened device, or None when ``device`` is not one of this engine's."""
        if device.engine != ENGINE:
            return None
        context = self._contexts.get(device.key)
        if context is None:
            handle = self._handles_by_key().get(device.key)
            if handle is None:
                return None
            context = OpenedDevice(handle.open(), device, dispatches_per_commit=self._dispatches_per_commit)
            self._contexts[device.key] = context
            if self.ane is None:
                self.ane = self._ane_factory()
        return context

    # -- description and probing --------------------------------------------------

    @hookimpl
    def pie_engine_info(self) -> EngineInfo:
        return EngineInfo(
            name=ENGINE,
            contract_version=CONTRACT_VERSION,
            priority=100,
            kernel_languages=("msl",),
            description="Metal Shading Language kernels through PyObjC (Apple silicon, AMD/Intel Macs); "
            "eligible projections on the Neural Engine through Core ML",
        )

    @hookimpl
    def pie_probe_devices(self) -> Sequence[DeviceInfo]:
        return [handle.info for handle in self._handles_by_key().values()]

    @hookimpl
    def pie_diagnose(self) -> Sequence[Diagnosis]:
        return list(self._diagnose())

    # -- kernels ------------------------------------------------------------------

    @hookimpl
    def pie_device_profiles(self) -> Sequence[str]:
        from pie.profiles.shipped import shipped_profiles

        return shipped_profiles("pie_engine_metal")

    @hookimpl
    def pie_list_kernels(self, device: DeviceInfo) -> Mapping[str, Sequence[str]] | None:
        if device.engine != ENGINE:
            return None
        return launchers.variants(has_simdgroup_matrices(device))

    @hookimpl
    def pie_compile_kernel(self, device: DeviceInfo, request: KernelRequest) -> Launcher | None:
        context = self.context(device)
        if context is None:
            return None
        return launchers.build(context, request, has_simdgroup_matrices(device), self.ane)

    @hookimpl
    def pie_kernel_source(self, device: DeviceInfo, request: KernelRequest | RegionRequest) -> str | None:
        if device.engine != ENGINE or not isinstance(request, KernelRequest):
            return None
        if request.name not in launchers.variants(simdgroup_matrices=True):
            return None
        files = launchers.libraries_of(request.name)
        options = ", ".join(f"{key}={value!r}" for key, value in request.options) or "none"
        header = f"// {request.name}[{request.variant or 'default'}], compile-time options: {options}\n"
        return header + "\n".join(library.source(name) for name in files)

    @hookimpl
    def pie_synchronize(self, device: DeviceInfo) -> None:
        context = self.context(device)
        if context is not None:
            context.synchronize()

    # -- pages and buffers --------------------------------------------------------

    @hookimpl
    def pie_allocate_pages(self, device: DeviceInfo, layout: PageLayout) -> Any:
        context = self.context(device)
        if context is None:
            return None
        if layout.dtype != "float32":
            raise ValueError(f"the Metal engine keeps KV pages in float32, not {layout.dtype}")
        limit = int(dict(device.extra).get("max_buffer_bytes", "0"))
        nbytes = int(np.prod(layout.shape, dtype=np.int64)) * F32.itemsize
        if limit and nbytes > limit:
            raise ValueError(f"a page pool of {nbytes} bytes exceeds this GPU's largest buffer ({limit} bytes)")
        pool = context.empty(layout.shape)
        context.view(pool)[...] = 0.0
        return pool

    @hookimpl
    def pie_free_pages(self, device: DeviceInfo, pool: Any) -> None:
        if isinstance(pool, MetalTensor):
            pool.release()

    @hookimpl
    def pie_read_pages(self, device: DeviceInfo, pool: Any, page_ids: np.ndarray) -> np.ndarray | None:
        context = self.context(device)
        if context is None:
            return None
        context.synchronize()
        return context.view(pool)[:, np.asarray(page_ids, dtype=np.int64)]

    @hookimpl
    def pie_write_pages(self, device: DeviceInfo, pool: Any, page_ids: np.ndarray, data: np.ndarray) -> None:
        context = self.context(device)
        if context is None:
            return None
        context.synchronize()
        context.view(pool)[:, np.asarray(page_ids, dtype=np.int64)] = data
        return None

    @hookimpl
    def pie_copy_pages(
        self, device: DeviceInfo, pool: Any, source_ids: np.ndarray, destination_ids: np.ndarray
    ) -> None:
        context = self.context(device)
        if context is None:
            return None
        context.synchronize()  # the pool is shared memory: the copy is in place, nothing crosses a bus
        view = context.view(pool)
        view[:, np.asarray(destination_ids, dtype=np.int64)] = view[:, np.asarray(source_ids, dtype=np.int64)]
        return None

    @hookimpl
    def pie_begin_pass(self, device: DeviceInfo, plan: PassPlan) -> None:
        """Attention's ``auto`` reads the plan's ``decode_only`` instead of comparing shapes."""
        context = self.context(device)
        if context is not None:
            context.pass_plan = plan

    @hookimpl
    def pie_end_pass(self, device: DeviceInfo) -> None:
        context = self.context(device)
        if context is not None:
            context.pass_plan = None

    @hookimpl
    def pie_upload(self, device: DeviceInfo, array: np.ndarray) -> Any:
        context = self.context(device)
        return None if context is None else context.upload(array)

    @hookimpl
    def pie_weight_types(self, device: DeviceInfo) -> Mapping[str, Sequence[str]] | None:
        if device.engine != ENGINE:
            return None
        return dict.fromkeys(READS_STORED, STORED_TYPES)

    @hookimpl
    def pie_upload_weights(self, device: DeviceInfo, arrays: Sequence[Any]) -> list[Any] | None:
        context = self.context(device)
        return None if context is None else [context.upload_weight(array) for array in arrays]

    @hookimpl
    def pie_download(self, device: DeviceInfo, tensor: Any) -> np.ndarray | None:
        context = self.context(device)
        return None if context is None else context.download(tensor)
