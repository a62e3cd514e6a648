"""Host facts the GPU engines need before importing their backend library."""

from __future__ import annotations

import glob
import os
import stat
import sys
import tempfile
from pathlib import Path

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
    folder = Path(tempfile.gettempdir()) / f"pie-runtime-{os.getuid()}"
    try:
        folder.mkdir(mode=0o700, exist_ok=True)
        found = os.lstat(folder)
        private = stat.S_ISDIR(found.st_mode) and found.st_uid == os.getuid() and not found.st_mode & 0o077
    except OSError:
        private = False
    os.environ[RUNTIME_DIR_ENV] = str(folder) if private else tempfile.mkdtemp(prefix="pie-runtime-")

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
