"""The Vulkan instance, the physical devices it finds, and how they are described and ordered.

Devices are ordered discrete GPU > integrated GPU > virtual GPU > CPU (lavapipe,
SwiftShader); ``PIE_VULKAN_DEVICE`` (an index into that list, or a substring of a
device name) moves one device to the front, where the runtime picks it.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from functools import cache
from typing import Any

from pie.contract import DeviceInfo, DeviceKind
from pie.enginekit.devices import KIND_RANK, put_first
from pie.enginekit.host import quiet_wayland_lookup, vendor_name

DEVICE_ENV = "PIE_VULKAN_DEVICE"
API_VERSION = (1, 1, 0)
"""The SPIR-V is 1.3, which Vulkan 1.1 consumes."""

_KINDS: dict[int, DeviceKind] = {0: "other", 1: "integrated-gpu", 2: "gpu", 3: "virtual-gpu", 4: "cpu"}
_PORTABILITY = "VK_KHR_portability_enumeration"
DRIVER_ENVS = ("VK_DRIVER_FILES", "VK_ICD_FILENAMES")


class VulkanUnavailable(RuntimeError):
    """The Vulkan loader or driver cannot be used; the message says what to install."""


def loader_fix() -> str:
    if sys.platform.startswith("linux"):
        return "sudo apt-get install libvulkan1"
    if sys.platform == "darwin":
        return "brew install vulkan-loader molten-vk"
    return "install your GPU vendor's current driver (it ships vulkan-1.dll)"


def driver_fix() -> str:
    if sys.platform.startswith("linux"):
        return "sudo apt-get install mesa-vulkan-drivers  # lavapipe (CPU) and Mesa's GPU drivers; or your vendor's"
    if sys.platform == "darwin":
        return "brew install molten-vk"
    return "install your GPU vendor's current driver"


def driver_override_note() -> str:
    """Says when environment variables restrict which driver manifests the loader reads."""
    overridden = [f"{name}={os.environ[name]}" for name in DRIVER_ENVS if os.environ.get(name)]
    return f" (the loader only reads {', '.join(overridden)})" if overridden else ""


def import_vulkan() -> Any:
    """The vulkan package, or VulkanUnavailable when libvulkan cannot be loaded."""
    quiet_wayland_lookup()
    try:
        import vulkan
    except OSError as exc:  # the package dlopens libvulkan on import
        raise VulkanUnavailable(f"libvulkan cannot be loaded ({exc}); install it: {loader_fix()}") from exc
    return vulkan


@dataclass(frozen=True)
class PhysicalDevice:
    handle: Any
    name: str
    kind: DeviceKind
    vendor_id: int
    api_version: int
    driver: str
    """The driver's own name and version (VkPhysicalDeviceDriverProperties), or its packed version."""
    memory_bytes: int
    storage_alignment: int
    """minStorageBufferOffsetAlignment"""
    max_binding_bytes: int
    """maxStorageBufferRange"""
    uniform_alignment: int
    """minUniformBufferOffsetAlignment"""
    max_allocation_bytes: int
    """maxMemoryAllocationSize (Vulkan 1.1): the most one buffer's memory may take"""


def _version(value: int) -> str:
    return f"{value >> 22}.{(value >> 12) & 0x3FF}.{value & 0xFFF}"


def _driver_version(vendor_id: int, value: int) -> str:
    if vendor_id == 0x10DE:  # NVIDIA packs 10.8.8.6 bits
        return f"{value >> 22}.{(value >> 14) & 0xFF}.{(value >> 6) & 0xFF}.{value & 0x3F}"
    return _version(value)


@cache
def instance() -> Any:
    """The process's Vulkan instance; VulkanUnavailable when no driver is usable."""
    vk = import_vulkan()

    available = {e.extensionName for e in vk.vkEnumerateInstanceExtensionProperties(None)}
    extensions = [_PORTABILITY] if _PORTABILITY in available else []
    app = vk.VkApplicationInfo(
        pApplicationName="pie",
        applicationVersion=1,
        pEngineName="pie",
        engineVersion=1,
        apiVersion=vk.VK_MAKE_VERSION(*API_VERSION),
    )
    info = vk.VkInstanceCreateInfo(
        flags=vk.VK_INSTANCE_CREATE_ENUMERATE_PORTABILITY_BIT_KHR if extensions else 0,
        pApplicationInfo=app,
        enabledExtensionCount=len(extensions),
        ppEnabledExtensionNames=extensions or None,
    )
    try:
        return vk.vkCreateInstance(info, None)
    except vk.VkError as exc:
        raise VulkanUnavailable(
            f"no usable Vulkan driver: vkCreateInstance failed with {type(exc).__name__}{driver_override_note()}; "
            f"install one: {driver_fix()}"
        ) from exc


def _driver(handle: Any, vendor_id: int, api_version: int, driver_version: int) -> str:
    import vulkan as vk

    if (api_version >> 22, (api_version >> 12) & 0x3FF) >= (1, 2):
        driver = vk.VkPhysicalDeviceDriverProperties()
        vk.vkGetPhysicalDeviceProperties2(handle, vk.VkPhysicalDeviceProperties2(pNext=driver))
        name, info = vk.ffi.string(driver.driverName).decode(), vk.ffi.string(driver.driverInfo).decode()
        if name:
            return f"{name} {info}".strip()
    return f"driver {_driver_version(vendor_id, driver_version)}"


def _describe_physical(handle: Any) -> PhysicalDevice:
    import vulkan as vk

    properties = vk.vkGetPhysicalDeviceProperties(handle)
    limits = properties.limits  # read now: the struct belongs to the call's temporary memory
    maintenance3 = vk.VkPhysicalDeviceMaintenance3Properties()
    vk.vkGetPhysicalDeviceProperties2(handle, vk.VkPhysicalDeviceProperties2(pNext=maintenance3))
    memory = vk.vkGetPhysicalDeviceMemoryProperties(handle)
    local = sum(
        memory.memoryHeaps[i].size
        for i in range(memory.memoryHeapCount)
        if memory.memoryHeaps[i].flags & vk.VK_MEMORY_HEAP_DEVICE_LOCAL_BIT
    )
    return PhysicalDevice(
        handle=handle,
        name=vk.ffi.string(properties.deviceName).decode(errors="replace")
        if not isinstance(properties.deviceName, str)
        else properties.deviceName,
        kind=_KINDS.get(int(properties.deviceType), "other"),
        vendor_id=int(properties.vendorID),
        api_version=int(properties.apiVersion),
        driver=_driver(handle, int(properties.vendorID), int(properties.apiVersion), int(properties.driverVersion)),
        memory_bytes=int(local),
        storage_alignment=int(limits.minStorageBufferOffsetAlignment),
        max_binding_bytes=int(limits.maxStorageBufferRange),
        uniform_alignment=int(limits.minUniformBufferOffsetAlignment),
        max_allocation_bytes=int(maintenance3.maxMemoryAllocationSize),
    )


def _supports_compute(handle: Any) -> bool:
    import vulkan as vk

    families = vk.vkGetPhysicalDeviceQueueFamilyProperties(handle)
    return any(family.queueFlags & vk.VK_QUEUE_COMPUTE_BIT for family in families)


@cache
def physical_devices() -> tuple[PhysicalDevice, ...]:
    """Vulkan devices with a compute queue and Vulkan >= 1.1, in preference order."""
    vk = import_vulkan()

    found = [
        _describe_physical(handle) for handle in vk.vkEnumeratePhysicalDevices(instance()) if _supports_compute(handle)
    ]
    found = [d for d in found if (d.api_version >> 22, (d.api_version >> 12) & 0x3FF) >= API_VERSION[:2]]
    found.sort(key=lambda d: KIND_RANK[d.kind])
    wanted = os.environ.get(DEVICE_ENV, "").strip()
    return tuple(put_first(found, wanted, lambda d: d.name, DEVICE_ENV, "Vulkan device") if wanted else found)


def describe(index: int, device: PhysicalDevice) -> DeviceInfo:
    import vulkan as vk

    return DeviceInfo(
        engine="vulkan",
        index=index,
        name=device.name,
        vendor=vendor_name(device.vendor_id),
        architecture=device.name.split(" (")[0],
        kind=device.kind,
        memory_bytes=device.memory_bytes,
        driver=device.driver,
        extra=(
            ("vulkan_api", _version(device.api_version)),
            ("vulkan_package", vk.__version__),
            ("max_storage_binding_bytes", str(device.max_binding_bytes)),
        ),
    )
