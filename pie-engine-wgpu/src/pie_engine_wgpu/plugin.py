"""Hook implementations of the WebGPU engine (entry point ``pie.engines: wgpu = pie_engine_wgpu.plugin:engine``).

Kernels, pages and transfers are the shared ones of :class:`pie.shaders.engine.ShaderEngine`;
this module adds what is particular to wgpu. wgpu is imported only inside hooks
that need it, so listing engines stays cheap.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from pie.contract import (
    CONTRACT_VERSION,
    DeviceInfo,
    Diagnosis,
    EngineInfo,
    KernelRequest,
    RegionRequest,
)
from pie.hookspecs import hookimpl
from pie.shaders.engine import DeviceBackend, ShaderEngine
from pie.shaders.host import may_have_hardware_gpu

PRIORITY = 50
SOFTWARE_ONLY_PRIORITY = -20
"""Below the CPU engine (0): on a host with no GPU, wgpu finds only lavapipe, slower than numpy."""


def driver_fix() -> str:
    """The command that installs a driver wgpu can compute with, for this platform."""
    if sys.platform.startswith("linux"):
        return "sudo apt-get install libvulkan1 mesa-vulkan-drivers  # lavapipe; or your GPU vendor's Vulkan driver"
    if sys.platform == "win32":
        return "install your GPU vendor's current driver (D3D12 and Vulkan come with it)"
    return "update macOS (Metal comes with it)"


class WgpuEngine(ShaderEngine):
    name = "wgpu"
    runtime_wgsl = True

    def open_backend(self, device: DeviceInfo) -> DeviceBackend:
        from pie_engine_wgpu.adapters import adapters
        from pie_engine_wgpu.backend import WgpuBackend

        return WgpuBackend(adapters()[device.index])

    @hookimpl
    def pie_engine_info(self) -> EngineInfo:
        return EngineInfo(
            name=self.name,
            contract_version=CONTRACT_VERSION,
            priority=PRIORITY if may_have_hardware_gpu() else SOFTWARE_ONLY_PRIORITY,
            kernel_languages=("wgsl",),
            description="the shared Slang kernels as WGSL through wgpu-py (Vulkan, Metal, D3D12)",
        )

    @hookimpl
    def pie_probe_devices(self) -> Sequence[DeviceInfo]:
        from pie_engine_wgpu.adapters import adapters, describe

        return [describe(index, adapter) for index, adapter in enumerate(adapters())]

    @hookimpl
    def pie_diagnose(self) -> Sequence[Diagnosis]:
        try:
            import wgpu
        except ImportError as exc:
            return [Diagnosis(False, "wgpu", f"cannot import wgpu: {exc}", "pip install wgpu")]
        found = [Diagnosis(True, "wgpu", f"wgpu-py {wgpu.__version__}")]
        try:
            from pie_engine_wgpu.adapters import (
                COMPUTE_BACKENDS,
                adapters,
                all_adapter_names,
            )

            usable, every = adapters(), all_adapter_names()
        except Exception as exc:
            return [
                *found,
                Diagnosis(False, "adapters", f"wgpu cannot list adapters: {type(exc).__name__}: {exc}", driver_fix()),
            ]
        if usable:
            names = ", ".join(
                f"{a.info.get('device')} ({a.info.get('backend_type')}, {a.info.get('adapter_type')})" for a in usable
            )
            return [*found, Diagnosis(True, "adapters", names)]
        seen = f"; wgpu found only {', '.join(every)}" if every else ""
        detail = f"no {'/'.join(COMPUTE_BACKENDS)} adapter{seen}: a Vulkan (Linux), Metal or D3D12 driver is needed"
        return [*found, Diagnosis(False, "adapters", detail, driver_fix())]

    @hookimpl
    def pie_kernel_source(self, device: DeviceInfo, request: KernelRequest | RegionRequest) -> str | None:
        if not self.mine(device) or not isinstance(request, KernelRequest):
            return None
        from pie.shaders import wgsl
        from pie.shaders.launch import VARIANTS, entry_names

        if request.name == "epilogue":
            from pie import eta

            return eta.compile(str(request.option("source"))).render("wgsl").source
        if request.name not in VARIANTS:
            return None
        return "\n".join(f"// ---- entry point {name}\n{wgsl(name)}" for name in entry_names(request.name))


engine = WgpuEngine()
