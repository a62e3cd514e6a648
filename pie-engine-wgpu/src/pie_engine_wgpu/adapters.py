"""Finding wgpu adapters and describing them as Pie devices.

Only native compute backends are used (Vulkan, Metal, D3D12): wgpu's OpenGL
backend is a fallback for drawing, not for these kernels. Adapters are ordered
discrete GPU > integrated GPU > virtual GPU > CPU (lavapipe, WARP);
``PIE_WGPU_DEVICE`` (an index into that list or a name substring) picks one first.
"""

from __future__ import annotations

import os
from functools import cache
from typing import Any

from pie.contract import DeviceInfo, DeviceKind
from pie.shaders.host import host_memory_bytes, quiet_wayland_lookup, vendor_name

DEVICE_ENV = "PIE_WGPU_DEVICE"
COMPUTE_BACKENDS = ("Vulkan", "Metal", "D3D12")
_KINDS: dict[str, DeviceKind] = {
    "DiscreteGPU": "gpu",
    "IntegratedGPU": "integrated-gpu",
    "VirtualGPU": "virtual-gpu",
    "CPU": "cpu",
}
_RANK = {"gpu": 0, "integrated-gpu": 1, "virtual-gpu": 2, "cpu": 3, "other": 4}


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


def _choose_first(adapters: list[Any], wanted: str) -> list[Any]:
    """Move the adapter ``PIE_WGPU_DEVICE`` names to the front."""
    if wanted.isdigit():
        index = int(wanted)
        if index >= len(adapters):
            raise RuntimeError(f"{DEVICE_ENV}={wanted}: only {len(adapters)} compute adapter(s) found")
    else:
        matches = [i for i, a in enumerate(adapters) if wanted.lower() in a.info.get("device", "").lower()]
        if not matches:
            names = ", ".join(a.info.get("device", "?") for a in adapters) or "none"
            raise RuntimeError(f"{DEVICE_ENV}={wanted!r} matches no adapter (found: {names})")
        index = matches[0]
    return [adapters[index]] + adapters[:index] + adapters[index + 1 :]


def _enumerate() -> list[Any]:
    quiet_wayland_lookup()
    import wgpu

    return list(wgpu.gpu.enumerate_adapters_sync())


@cache
def adapters() -> tuple[Any, ...]:
    """The usable adapters in preference order."""
    found = [a for a in _enumerate() if a.info.get("backend_type") in COMPUTE_BACKENDS]
    found.sort(key=lambda a: _RANK[_KINDS.get(a.info.get("adapter_type", ""), "other")])
    wanted = os.environ.get(DEVICE_ENV, "").strip()
    return tuple(_choose_first(found, wanted) if wanted else found)


def all_adapter_names() -> list[str]:
    """Every adapter wgpu finds, any backend, for diagnostics."""
    return [f"{a.info.get('device', '?')} ({a.info.get('backend_type', '?')})" for a in _enumerate()]
