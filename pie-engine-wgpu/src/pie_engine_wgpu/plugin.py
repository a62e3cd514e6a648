"""Hook implementations of the WebGPU engine (entry point ``pie.engines: wgpu = pie_engine_wgpu.plugin:engine``).

Kernels, pages and transfers are the shared ones of :class:`pie.enginekit.engine.ShaderEngine`;
this module adds what is particular to wgpu. wgpu is imported only inside hooks
that need it, so listing engines stays cheap. Its devices are wgpu's native adapters and,
where a browser is present, the browser's WebGPU (:mod:`pie_engine_wgpu.browser`), which is
started only when that device is opened, or when it is selected and probed.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any

from pie.contract import (
    DeviceInfo,
    Diagnosis,
    EngineInfo,
    KernelRequest,
    RegionRequest,
)
from pie.enginekit.engine import DeviceBackend, ShaderEngine
from pie.enginekit.shaders.hooks import shader_engine_info, shipped_entry_names
from pie.hookspecs import hookimpl

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

    def __init__(self, device: str | None = None):
        """``device``: what ``PIE_WGPU_DEVICE`` would say (an index or a name, ``browser``), for an engine
        object of one's own (tests); None reads the variable."""
        super().__init__()
        self.wanted = device

    def _selection(self) -> tuple[str, str, str, str]:
        """This engine's ``PIE_WGPU_DEVICE``, ``PIE_WGPU_BROWSER``, ``PIE_WGPU_BROWSER_URL`` and
        ``PIE_WGPU_BROWSER_ADAPTER``."""
        from pie_engine_wgpu.adapters import DEVICE_ENV
        from pie_engine_wgpu.browser import ADAPTER_ENV, BROWSER_ENV, BROWSER_URL_ENV

        wanted = self.wanted if self.wanted is not None else os.environ.get(DEVICE_ENV, "")
        browser, url, adapter = (os.environ.get(n, "").strip() for n in (BROWSER_ENV, BROWSER_URL_ENV, ADAPTER_ENV))
        return wanted.strip(), browser, url, adapter

    def candidates(self) -> tuple[Any, ...]:
        """The native adapters and the browser target, in this engine's preference order."""
        from pie_engine_wgpu.adapters import devices

        return devices(*self._selection())

    def open_backend(self, device: DeviceInfo) -> DeviceBackend:
        from pie_engine_wgpu.browser import BrowserTarget, timeout

        candidate = self.candidates()[device.index]
        if isinstance(candidate, BrowserTarget):
            from pie_engine_wgpu.browser_backend import BrowserBackend

            return BrowserBackend(candidate, timeout())
        from pie_engine_wgpu.backend import WgpuBackend

        return WgpuBackend(candidate)

    @hookimpl
    def pie_engine_info(self) -> EngineInfo:
        description = "the shared Slang kernels as WGSL through wgpu-py (Vulkan, Metal, D3D12) or a browser's WebGPU"
        return shader_engine_info(self.name, "wgsl", description, PRIORITY, SOFTWARE_ONLY_PRIORITY)

    @hookimpl
    def pie_probe_devices(self) -> Sequence[DeviceInfo]:
        from pie_engine_wgpu import browser
        from pie_engine_wgpu.adapters import browser_asked, describe

        candidates = self.candidates()
        found = [
            browser.describe(index, c) if isinstance(c, browser.BrowserTarget) else describe(index, c)
            for index, c in enumerate(candidates)
        ]
        if candidates and isinstance(candidates[0], browser.BrowserTarget) and browser_asked(*self._selection()):
            # Asked for, the browser must start: what cannot is reported here, with the reason. The page it
            # opens is this device's from now on (a probe's process ends, and the browser with it).
            try:
                started = self.backend(found[0])
            except Exception as exc:
                raise RuntimeError(f"the browser device cannot start: {exc}") from None
            found[0] = browser.describe(0, candidates[0], getattr(started, "adapter_name", ""))
        return found

    @hookimpl
    def pie_diagnose(self) -> Sequence[Diagnosis]:
        try:
            import wgpu
        except ImportError as exc:
            return [Diagnosis(False, "wgpu", f"cannot import wgpu: {exc}", "pip install wgpu")]
        found = [Diagnosis(True, "wgpu", f"wgpu-py {wgpu.__version__}")]
        try:
            from pie_engine_wgpu.adapters import COMPUTE_BACKENDS, all_adapter_names, native_adapters

            usable, every = native_adapters(), all_adapter_names()
        except Exception as exc:
            return [
                *found,
                Diagnosis(False, "adapters", f"wgpu cannot list adapters: {type(exc).__name__}: {exc}", driver_fix()),
                browser_diagnosis(),
            ]
        if usable:
            names = ", ".join(
                f"{a.info.get('device')} ({a.info.get('backend_type')}, {a.info.get('adapter_type')})" for a in usable
            )
            return [*found, Diagnosis(True, "adapters", names), browser_diagnosis()]
        seen = f"; wgpu found only {', '.join(every)}" if every else ""
        detail = f"no {'/'.join(COMPUTE_BACKENDS)} adapter{seen}: a Vulkan (Linux), Metal or D3D12 driver is needed"
        return [*found, Diagnosis(False, "adapters", detail, driver_fix()), browser_diagnosis()]

    @hookimpl
    def pie_kernel_source(self, device: DeviceInfo, request: KernelRequest | RegionRequest) -> str | None:
        from pie.enginekit.shaders import wgsl

        if isinstance(request, KernelRequest) and request.name == "epilogue":
            from pie import eta

            return eta.compile(str(request.option("source"))).render("wgsl").source
        names = shipped_entry_names(request)
        return "\n".join(f"// ---- entry point {name}\n{wgsl(name)}" for name in names) if names else None


def browser_diagnosis() -> Diagnosis:
    """Whether the browser device can run here, found out by starting it (bounded), or what is missing."""
    from pie_engine_wgpu.browser import ADAPTER_ENV, ADAPTERS, BrowserUnavailable, find_browser, timeout

    try:
        target = find_browser()
    except BrowserUnavailable as exc:
        return Diagnosis(False, "browser", f"no browser device: {exc}", exc.fix)
    try:
        from pie_engine_wgpu.browser_backend import BrowserBackend

        backend = BrowserBackend(target, min(timeout(), 20.0))
    except Exception as exc:
        return Diagnosis(False, "browser", f"{target.label} cannot start a WebGPU device: {exc}")
    adapter = backend.adapter_name
    backend.close()
    others = ", ".join(name for name in ADAPTERS if name != target.adapter.name)
    return Diagnosis(
        True,
        "browser",
        f"{target.label} ({target.adapter.description}): WebGPU adapter {adapter}; PIE_WGPU_DEVICE=browser runs on"
        f" it, {ADAPTER_ENV}={others.replace(', ', ' or ')} asks for another",
    )


engine = WgpuEngine()
