"""The Metal engine's hook implementations, over any `Driver`.

Page hooks, transfers, weight uploads and pass plans are the kit's
(:class:`pie.enginekit.engine.PassPlanEngine`); this module adds Metal's kernels and description.
`pie_engine_metal.plugin` binds one `MetalEngine` to the system's Metal devices through PyObjC;
tests bind another to a CPU implementation of the driver protocol.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from pie.contract import (
    CONTRACT_VERSION,
    DeviceInfo,
    Diagnosis,
    EngineInfo,
    KernelRequest,
    Launcher,
    RegionRequest,
)
from pie.enginekit.engine import PassPlanEngine
from pie.hookspecs import hookimpl

from pie_engine_metal import launchers, library, plan
from pie_engine_metal.context import OpenedDevice
from pie_engine_metal.driver import Driver
from pie_engine_metal.probe import ENGINE, has_simdgroup_matrices
from pie_engine_metal.weights import STORED_TYPES


@dataclass(frozen=True)
class DeviceHandle:
    """A device found by discovery and how to open it."""

    info: DeviceInfo
    open: Callable[[], Driver]


class MetalEngine(PassPlanEngine):
    name = ENGINE
    kv_dtypes = ("float32",)
    stored_types = STORED_TYPES
    max_head_dim = plan.PREFILL_MAX_HEAD_DIM
    """Every pass but a decode runs ``attention_prefill``: a model whose head_dim is beyond it cannot run."""

    def __init__(
        self,
        discover: Callable[[], Sequence[DeviceHandle]],
        diagnose: Callable[[], Sequence[Diagnosis]],
        *,
        dispatches_per_commit: int = 64,
    ):
        super().__init__()
        self._discover = discover
        self._diagnose = diagnose
        self._dispatches_per_commit = dispatches_per_commit
        self._handles: dict[str, DeviceHandle] | None = None

    def _handles_by_key(self) -> dict[str, DeviceHandle]:
        if self._handles is None:
            self._handles = {handle.info.key: handle for handle in self._discover()}
        return self._handles

    def open_backend(self, device: DeviceInfo) -> OpenedDevice:
        driver = self._handles_by_key()[device.key].open()
        return OpenedDevice(driver, device, dispatches_per_commit=self._dispatches_per_commit)

    def backend(self, device: DeviceInfo) -> OpenedDevice:
        return super().backend(device)  # type: ignore[return-value]  # open_backend opens OpenedDevices

    # -- description and probing --------------------------------------------------

    @hookimpl
    def pie_engine_info(self) -> EngineInfo:
        return EngineInfo(
            name=ENGINE,
            contract_version=CONTRACT_VERSION,
            priority=100,
            kernel_languages=("msl",),
            description="Metal Shading Language kernels through PyObjC (Apple silicon, AMD/Intel Macs)",
        )

    @hookimpl
    def pie_probe_devices(self) -> Sequence[DeviceInfo]:
        return [handle.info for handle in self._handles_by_key().values()]

    @hookimpl
    def pie_diagnose(self) -> Sequence[Diagnosis]:
        return list(self._diagnose())

    # -- kernels ------------------------------------------------------------------

    @hookimpl
    def pie_list_kernels(self, device: DeviceInfo) -> Mapping[str, Sequence[str]] | None:
        return launchers.variants(has_simdgroup_matrices(device))

    @hookimpl
    def pie_compile_kernel(self, device: DeviceInfo, request: KernelRequest) -> Launcher | None:
        return launchers.build(self.backend(device), request, has_simdgroup_matrices(device))

    @hookimpl
    def pie_kernel_source(self, device: DeviceInfo, request: KernelRequest | RegionRequest) -> str | None:
        if not isinstance(request, KernelRequest) or request.name not in launchers.variants(simdgroup_matrices=True):
            return None
        options = ", ".join(f"{key}={value!r}" for key, value in request.options) or "none"
        header = f"// {request.name}[{request.variant or 'default'}], compile-time options: {options}\n"
        return header + "\n".join(library.source(name) for name in launchers.libraries_of(request.name))
