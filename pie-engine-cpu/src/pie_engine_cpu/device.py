"""Describe the host CPU without importing anything heavy."""

from __future__ import annotations

import os
import platform

from pie.contract import DeviceInfo
from pie.enginekit.host import host_memory_bytes


def _cpuinfo_field(field: str) -> str:
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
    return frozenset(_cpuinfo_field("flags").split())


def probe_host() -> DeviceInfo:
    import numpy as np

    name = _cpuinfo_field("model name") or platform.processor() or platform.machine()
    vendor = _cpuinfo_field("vendor_id") or platform.system()
    return DeviceInfo(
        engine="cpu",
        index=0,
        name=name,
        vendor=vendor,
        architecture=platform.machine(),
        kind="cpu",
        memory_bytes=host_memory_bytes(),
        driver=f"numpy {np.__version__}",
        extra=(("cores", str(os.cpu_count() or 1)),),
    )
