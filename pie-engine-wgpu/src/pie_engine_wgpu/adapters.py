"""Finding wgpu adapters and describing them as Pie devices.

Only native compute backends are used (Vulkan, Metal, D3D12): wgpu's OpenGL
backend is a fallback for drawing, not for these kernels. Adapters are ordered
discrete GPU > integrated GPU > virtual GPU > CPU (lavapipe, WARP);
A browser's WebGPU (:mod:`pie_engine_wgpu.browser`) follows them as one more device, named
``browser``, where a browser and the ``browser`` extra are present. ``PIE_WGPU_DEVICE`` (an index
into that list or a name substring, ``browser`` for the browser) picks one first; naming a browser
with ``PIE_WGPU_BROWSER`` or ``PIE_WGPU_BROWSER_URL`` picks the browser device when it names none.
"""

from __future__ import annotations

import os
from functools import cache
from typing import Any

from pie.contract import DeviceInfo, DeviceKind
from pie.enginekit.devices import KIND_RANK, put_first
from pie.enginekit.host import host_memory_bytes, quiet_wayland_lookup, vendor_name
from pie.plugins import EngineSettingError

from pie_engine_wgpu.browser import (
    ADAPTER_ENV,
    BROWSER_ENV,
    BROWSER_URL_ENV,
    DEVICE_NAME,
    BrowserTarget,
    BrowserUnavailable,
    find_browser,
    requested,
)

DEVICE_ENV = "PIE_WGPU_DEVICE"
COMPUTE_BACKENDS = ("Vulkan", "Metal", "D3D12")
_KINDS: dict[str, DeviceKind] = {
    "DiscreteGPU": "gpu",
    "IntegratedGPU": "integrated-gpu",
    "VirtualGPU": "virtual-gpu",
    "CPU": "cpu",
}


def describe(index: int, adapter: Any) -> DeviceInfo:
    import wgpu

    info = adapter.info
    name = info.get("device") or "unknown adapter"
    kind = _KINDS.get(info.get("adapter_type", ""), "other")
    vendor = vendor_name(int(info.get("vendor_id", 0)), info.get("vendor", ""))
    limits = adapter.limits
    return DeviceInfo(
        engine="wgpu",
        index=index,
        name=name,
        vendor=vendor,
        architecture=info.get("architecture") or name.split(" (")[0],
        kind=kind,
        # WebGPU does not report memory; a CPU adapter's memory is the host's.
        memory_bytes=host_memory_bytes() if kind == "cpu" else 0,
        driver=info.get("description", ""),
        extra=(
            ("backend", info.get("backend_type", "")),
            ("wgpu", wgpu.__version__),
            ("max_storage_binding_bytes", str(limits.get("max-storage-buffer-binding-size", 0))),
        ),
    )


def _label(candidate: Any) -> str:
    return DEVICE_NAME if isinstance(candidate, BrowserTarget) else str(candidate.info.get("device", "?"))


def _enumerate() -> list[Any]:
    quiet_wayland_lookup()
    import wgpu

    return list(wgpu.gpu.enumerate_adapters_sync())


@cache
def native_adapters() -> tuple[Any, ...]:
    """wgpu's compute adapters, best first."""
    found = [a for a in _enumerate() if a.info.get("backend_type") in COMPUTE_BACKENDS]
    found.sort(key=lambda a: KIND_RANK[_KINDS.get(a.info.get("adapter_type", ""), "other")])
    return tuple(found)


@cache
def devices(wanted: str = "", browser: str = "", browser_url: str = "", browser_adapter: str = "") -> tuple[Any, ...]:
    """The native adapters and the browser (a :class:`BrowserTarget`) in preference order, for the values of
    ``PIE_WGPU_DEVICE``, ``PIE_WGPU_BROWSER``, ``PIE_WGPU_BROWSER_URL`` and ``PIE_WGPU_BROWSER_ADAPTER``. A
    browser asked for that cannot run is an error saying why; one not asked for is left out (``pie doctor``
    says why)."""
    found = list(native_adapters())
    env = {BROWSER_ENV: browser, BROWSER_URL_ENV: browser_url, ADAPTER_ENV: browser_adapter}
    asked = browser_asked(wanted, browser, browser_url)
    try:
        found.append(find_browser(env))
    except BrowserUnavailable as exc:
        if asked:  # a setting of the user's that names no browser is theirs to correct (EngineSettingError)
            error = EngineSettingError if exc.setting else RuntimeError
            raise error(f"the browser device cannot run: {exc}" + (f" (fix: {exc.fix})" if exc.fix else "")) from None
    if not wanted and requested(env):
        wanted = DEVICE_NAME
    return tuple(put_first(found, wanted, _label, DEVICE_ENV, "adapter") if wanted else found)


def browser_asked(wanted: str = "", browser: str = "", browser_url: str = "", browser_adapter: str = "") -> bool:
    """Whether those variables ask for the browser device (then it must start, or the probe says why); the
    adapter's alone does not."""
    return requested({BROWSER_ENV: browser, BROWSER_URL_ENV: browser_url}) or wanted.lower() == DEVICE_NAME


def adapters() -> tuple[Any, ...]:
    """The usable devices in preference order, as this process's environment selects them."""
    names = (DEVICE_ENV, BROWSER_ENV, BROWSER_URL_ENV, ADAPTER_ENV)
    return devices(*(os.environ.get(name, "").strip() for name in names))


def all_adapter_names() -> list[str]:
    """Every adapter wgpu finds, any backend, for diagnostics."""
    return [f"{a.info.get('device', '?')} ({a.info.get('backend_type', '?')})" for a in _enumerate()]
