"""Hook implementations of the Vulkan engine (entry point ``pie.engines: vulkan = pie_engine_vulkan.plugin:engine``).

Kernels, pages and transfers are the shared ones of :class:`pie.enginekit.engine.ShaderEngine`;
this module adds what is particular to Vulkan. The ``vulkan`` package (which
loads libvulkan) is imported only inside hooks that need it. eta epilogues (the
catalogue's ``epilogue`` kernel) are rendered as Slang and compiled to SPIR-V at run
time, so the engine lists them only where the Slang compiler is installed (the
``epilogue`` extra: ``pip install 'pie-engine-vulkan[epilogue]'``).
"""

from __future__ import annotations

from collections.abc import Sequence

from pie.contract import (
    DeviceInfo,
    Diagnosis,
    EngineInfo,
    KernelRequest,
    RegionRequest,
)
from pie.enginekit.engine import DeviceBackend, ShaderEngine
from pie.enginekit.shaders import slang
from pie.enginekit.shaders.hooks import shader_engine_info, shipped_entry_names
from pie.hookspecs import hookimpl

PRIORITY = 60
SOFTWARE_ONLY_PRIORITY = -10
"""Below the CPU engine (0): on a host with no GPU, Vulkan finds only lavapipe, slower than numpy."""
EPILOGUE_EXTRA = "pip install 'pie-engine-vulkan[epilogue]'"
"""What installs the Slang compiler that eta epilogues need."""


class VulkanEngine(ShaderEngine):
    name = "vulkan"

    def epilogue_target(self) -> str | None:
        return "slang" if slang.available() else None

    def open_backend(self, device: DeviceInfo) -> DeviceBackend:
        from pie_engine_vulkan.backend import VulkanBackend
        from pie_engine_vulkan.devices import physical_devices

        return VulkanBackend(physical_devices()[device.index])

    @hookimpl
    def pie_engine_info(self) -> EngineInfo:
        description = "the shared Slang kernels as SPIR-V through the vulkan package"
        return shader_engine_info(self.name, "spir-v", description, PRIORITY, SOFTWARE_ONLY_PRIORITY)

    @hookimpl
    def pie_probe_devices(self) -> Sequence[DeviceInfo]:
        from pie_engine_vulkan.devices import describe, physical_devices

        return [describe(index, device) for index, device in enumerate(physical_devices())]

    @hookimpl
    def pie_diagnose(self) -> Sequence[Diagnosis]:
        from pie_engine_vulkan.devices import (
            VulkanUnavailable,
            driver_fix,
            driver_override_note,
            import_vulkan,
            loader_fix,
        )

        try:
            vk = import_vulkan()
        except ImportError as exc:
            return [Diagnosis(False, "vulkan", f"cannot import the vulkan package: {exc}", "pip install vulkan")]
        except VulkanUnavailable as exc:
            return [Diagnosis(False, "Vulkan loader", str(exc), loader_fix())]
        found = [Diagnosis(True, "vulkan", f"vulkan package {vk.__version__}, loader found"), self._diagnose_slang()]
        from pie_engine_vulkan.devices import physical_devices

        try:
            devices = physical_devices()
        except VulkanUnavailable as exc:
            return [*found, Diagnosis(False, "Vulkan driver", str(exc), driver_fix())]
        if not devices:
            detail = f"the Vulkan loader found no device with a compute queue and Vulkan 1.1{driver_override_note()}"
            return [*found, Diagnosis(False, "Vulkan driver", detail, driver_fix())]
        names = ", ".join(f"{d.name} ({d.kind})" for d in devices)
        return [*found, Diagnosis(True, "Vulkan devices", names)]

    def _diagnose_slang(self) -> Diagnosis:
        if not slang.available():
            detail = "not installed: eta epilogues (soft-capped logits, GELU MLPs) run on the CPU engine"
            return Diagnosis(False, "Slang compiler", detail, EPILOGUE_EXTRA)
        try:
            with slang.SlangCompiler() as compiler:
                return Diagnosis(True, "Slang compiler", f"slang {compiler.version()}: eta epilogues compile to SPIR-V")
        except (OSError, slang.SlangError) as exc:
            return Diagnosis(False, "Slang compiler", f"cannot load it: {exc}", EPILOGUE_EXTRA)

    @hookimpl
    def pie_kernel_source(self, device: DeviceInfo, request: KernelRequest | RegionRequest) -> str | None:
        from pie.enginekit.shaders import manifest, slang_source

        if isinstance(request, KernelRequest) and request.name == "epilogue":
            from pie import eta

            rendered = eta.compile(str(request.option("source"))).render("slang")
            return f"// Slang source of an eta epilogue, compiled to SPIR-V at run time\n{rendered.source}"
        names = shipped_entry_names(request)
        if not names:
            return None
        header = f"// Slang source of {request.name}, compiled to SPIR-V entry points {', '.join(names)}\n"
        return header + slang_source(manifest()[names[0]].name)


engine = VulkanEngine()
