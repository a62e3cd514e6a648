"""Host facts the engines need before importing their backend library: the GPU engines whether a GPU
can be there, the CPU engine what the host's CPU is and how many of its cores the process may use."""

from __future__ import annotations

import glob
import os
import platform
import sys
import tempfile

from pie.files import user_temporary_folder

RUNTIME_DIR_ENV = "XDG_RUNTIME_DIR"


def may_have_hardware_gpu() -> bool:
    """False only where no GPU driver can be present: a Linux host without DRM render nodes or NVIDIA devices.

    There the only Vulkan or WebGPU devices are software ones (lavapipe, SwiftShader),
    slower than the CPU engine, so the GPU engines lower their priority below it.
    Elsewhere (macOS, Windows) this cannot be told cheaply and answers True.
    """
    if not sys.platform.startswith("linux"):
        return True
    return bool(glob.glob("/dev/dri/renderD*") or glob.glob("/dev/nvidia[0-9]*") or glob.glob("/dev/kfd"))


def quiet_wayland_lookup() -> None:
    """Give this process a private ``XDG_RUNTIME_DIR`` if it has none, before Vulkan enumerates devices.

    Mesa's device-select layer asks Wayland for the default GPU while devices are enumerated; without
    ``XDG_RUNTIME_DIR`` libwayland prints "error: XDG_RUNTIME_DIR is invalid or not set in the
    environment" on stderr (four times for wgpu), which reads like a failure of pie. A private folder
    holds no Wayland socket, so the layer finds no compositor as before, quietly. A value the user set
    is left alone, and so is every other message.
    """
    if os.environ.get(RUNTIME_DIR_ENV):
        return
    if not hasattr(os, "getuid"):  # not POSIX: no Wayland
        return
    folder = user_temporary_folder("runtime")
    os.environ[RUNTIME_DIR_ENV] = str(folder) if folder is not None else tempfile.mkdtemp(prefix="pie-runtime-")

PCI_VENDORS = {
    0x1002: "AMD",
    0x1010: "Imagination",
    0x106B: "Apple",
    0x10DE: "NVIDIA",
    0x13B5: "ARM",
    0x1414: "Microsoft",
    0x1AE0: "Google",
    0x5143: "Qualcomm",
    0x8086: "Intel",
    0x10005: "Mesa",
}
"""PCI vendor ids (and Khronos ids for software vendors) as Vulkan and WebGPU report them."""


def vendor_name(vendor_id: int, fallback: str = "") -> str:
    return PCI_VENDORS.get(vendor_id, fallback or f"vendor 0x{vendor_id:x}")


def host_memory_bytes() -> int:
    """Physical memory of the host (what a CPU device such as lavapipe allocates from)."""
    import os

    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def cpuinfo_field(field: str) -> str:
    """The first value of ``field`` in /proc/cpuinfo; empty where the file or the field does not exist."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as handle:
            for line in handle:
                key, _, value = line.partition(":")
                if key.strip() == field:
                    return value.strip()
    except OSError:
        pass
    return ""


def cpu_flags() -> frozenset[str]:
    """The host CPU's instruction-set flags (empty where /proc/cpuinfo does not exist)."""
    return frozenset(cpuinfo_field("flags").split())


def cpu_name() -> str:
    """The host CPU's model name, else what ``platform`` knows of it."""
    return cpuinfo_field("model name") or platform.processor() or platform.machine()


def cpu_vendor() -> str:
    """The host CPU's vendor (``GenuineIntel``, ``AuthenticAMD``), else the operating system's name."""
    return cpuinfo_field("vendor_id") or platform.system()


def cpu_identity() -> str:
    """What the host's CPU is, for the key of a build with ``-march=native``: its machine and its
    instruction-set flags, so that a build for another CPU is never reused here."""
    return platform.machine() + " " + " ".join(sorted(cpu_flags()))


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity, where the system has one), as OpenBLAS counts its
    default threads."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
