"""Describe the host CPU without importing anything heavy."""

from __future__ import annotations

import os
import platform

from pie.contract import DeviceInfo


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


AVX512_FLAGS = frozenset({"avx512f", "avx512bw", "avx512dq", "avx512vl"})
"""The AVX-512 extensions OpenBLAS's AVX-512 (SkylakeX family) kernels need."""
OPENBLAS_AVX512_CORES = frozenset({"skylakex", "cooperlake", "sapphirerapids"})
"""OpenBLAS core types whose single-precision kernels use AVX-512."""


def cpu_flags() -> frozenset[str]:
    """The host CPU's instruction-set flags (empty where /proc/cpuinfo does not exist)."""
    return frozenset(_cpuinfo_field("flags").split())


def blas_kernel_advice(architecture: str, flags: frozenset[str], coretype: str | None) -> tuple[str, str] | None:
    """(problem, fix) when OpenBLAS runs kernels narrower than the CPU's AVX-512, else None.

    ``coretype`` is ``OPENBLAS_CORETYPE`` when set: it overrides OpenBLAS's own choice
    (``docs/perf-notes.md`` has what the narrower kernels cost).
    """
    if not AVX512_FLAGS <= flags or architecture.lower() in OPENBLAS_AVX512_CORES:
        return None
    if coretype:
        return (
            f"OPENBLAS_CORETYPE={coretype} holds OpenBLAS to its {architecture} kernels on a CPU with AVX-512",
            "unset OPENBLAS_CORETYPE",
        )
    return (
        f"OpenBLAS does not recognise this CPU and runs its {architecture} kernels although it has AVX-512",
        "export OPENBLAS_CORETYPE=SkylakeX",
    )


def _memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


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
        memory_bytes=_memory_bytes(),
        driver=f"numpy {np.__version__}",
        extra=(("cores", str(os.cpu_count() or 1)),),
    )
