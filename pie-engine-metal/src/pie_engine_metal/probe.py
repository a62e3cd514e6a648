"""Finding Metal devices through PyObjC, describing them, and what `pie doctor` reports.

:func:`describe` only calls methods of an ``MTLDevice`` (``name``, ``supportsFamily_``,
``recommendedMaxWorkingSetSize``...), so it is tested with a stand-in object.
"""

from __future__ import annotations

import platform
import sys
from typing import Any

from pie.contract import DeviceInfo, DeviceKind, Diagnosis

ENGINE = "metal"
OTHER_ENGINES_FIX = "pip install pie-engine-vulkan  # or pie-engine-wgpu / pie-engine-cpu, which run here"
PYOBJC_FIX = "pip install pyobjc-framework-Metal"

# MTLGPUFamily values, newest first within each line of GPUs.
FAMILIES: tuple[tuple[str, int], ...] = (
    *((f"apple{n}", 1000 + n) for n in range(10, 0, -1)),
    ("mac2", 2002),
    ("metal4", 5002),
    ("metal3", 5001),
)
SIMD_REDUCTIONS_APPLE = 7
"""simd_sum and friends: Apple7 (A14, M1) and later, or any Mac2-family GPU."""
SIMDGROUP_MATRIX_APPLE = 7
"""simdgroup_float8x8: Apple7 and later."""


class MetalUnavailable(RuntimeError):
    """Metal cannot be used on this system; the message says why and what to do."""


def not_macos_message(system: str | None = None) -> str:
    system = system or platform.system() or sys.platform
    return f"Metal needs macOS on Apple silicon or an AMD/Intel Mac; this is {system}"


def families(device: Any) -> tuple[str, ...]:
    return tuple(name for name, code in FAMILIES if device.supportsFamily_(code))


def apple_generation(family_names: tuple[str, ...] | list[str]) -> int:
    return max((int(name[5:]) for name in family_names if name.startswith("apple")), default=0)


def runs_kernels(family_names: tuple[str, ...] | list[str]) -> bool:
    """The kernel set needs SIMD-scoped reductions."""
    return apple_generation(family_names) >= SIMD_REDUCTIONS_APPLE or "mac2" in family_names


def has_simdgroup_matrices(info: DeviceInfo) -> bool:
    return apple_generation(dict(info.extra).get("families", "").split(",")) >= SIMDGROUP_MATRIX_APPLE


VENDOR_MARKERS = (("amd", "AMD"), ("radeon", "AMD"), ("intel", "Intel"), ("nvidia", "NVIDIA"), ("geforce", "NVIDIA"))
"""Words in the name of a GPU outside the Apple families, and its vendor."""


def _vendor(name: str) -> str:
    return next((vendor for marker, vendor in VENDOR_MARKERS if marker in name.lower()), "unknown")


def describe(index: int, device: Any, *, os_version: str = "") -> DeviceInfo:
    """A DeviceInfo for one ``MTLDevice``: architecture from its newest GPU family, memory from its working set."""
    names = families(device)
    generation = apple_generation(names)
    architecture = f"apple{generation}" if generation else ("mac2" if "mac2" in names else "metal")
    unified = bool(device.hasUnifiedMemory())
    kind: DeviceKind = "integrated-gpu" if unified else "gpu"
    extra = [
        ("families", ",".join(names)),
        ("unified_memory", "yes" if unified else "no"),
        ("max_buffer_bytes", str(int(device.maxBufferLength()))),
        ("max_threadgroup_memory", str(int(device.maxThreadgroupMemoryLength()))),
        ("registry_id", f"{int(device.registryID()):#x}"),
    ]
    name = str(device.name())
    return DeviceInfo(
        engine=ENGINE,
        index=index,
        name=name,
        vendor="Apple" if generation else _vendor(name),
        architecture=architecture,
        kind=kind,
        memory_bytes=int(device.recommendedMaxWorkingSetSize()),
        driver=f"Metal, macOS {os_version}" if os_version else "Metal",
        extra=tuple(extra),
    )


def system_devices() -> list[Any]:
    """Every ``MTLDevice`` of this Mac, the system default first; raises MetalUnavailable elsewhere."""
    if sys.platform != "darwin":
        raise MetalUnavailable(not_macos_message())
    try:
        import Metal
    except ImportError as exc:
        raise MetalUnavailable(f"pyobjc-framework-Metal is not installed ({PYOBJC_FIX})") from exc
    default = Metal.MTLCreateSystemDefaultDevice()
    devices = [] if default is None else [default]
    copy_all = getattr(Metal, "MTLCopyAllDevices", None)
    for device in (copy_all() or []) if copy_all else []:
        if default is None or device.registryID() != default.registryID():
            devices.append(device)
    return devices


def diagnose() -> list[Diagnosis]:
    if sys.platform != "darwin":
        return [Diagnosis(False, "macOS", not_macos_message(), OTHER_ENGINES_FIX)]
    try:
        import Metal  # noqa: F401
        import objc
    except ImportError:
        return [Diagnosis(False, "pyobjc-framework-Metal", "PyObjC's Metal bindings are not installed", PYOBJC_FIX)]
    findings = [Diagnosis(True, "pyobjc-framework-Metal", f"PyObjC {objc.__version__}")]
    devices = system_devices()
    if not devices:
        findings.append(
            Diagnosis(False, "Metal device", "MTLCreateSystemDefaultDevice found no GPU", OTHER_ENGINES_FIX)
        )
    for device in devices:
        names = families(device)
        label = f"{device.name()} ({','.join(names) or 'no known family'})"
        runs = runs_kernels(names)
        gib = int(device.recommendedMaxWorkingSetSize()) / 2**30
        detail = f"{label}, {gib:.1f} GiB working set" if runs else f"{label}: the kernels need an Apple7+ or Mac2 GPU"
        findings.append(Diagnosis(runs, "Metal device", detail, "" if runs else OTHER_ENGINES_FIX))
    return findings
