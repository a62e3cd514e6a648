"""``pie doctor`` for the CUDA engine: each library, driver and device it needs, with the fix.

The driver and the devices are checked by probing them as the engine does: a probe that fails
says what failed (:class:`~pie_engine_cuda.driver_api.DriverUnavailable`) and how to fix it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

from pie.contract import Diagnosis
from pie.enginekit.compile_cache import default_cache_dir
from pie.plugins import EngineSettingError

from pie_engine_cuda.backend import hip_python_installed, requested_backend
from pie_engine_cuda.driver_api import (
    FIX_AMD_GPU,
    FIX_CUDA_PYTHON,
    FIX_HIP_PYTHON,
    FIX_HIPRTC,
    FIX_NO_GPU,
    FIX_NVRTC,
    DriverUnavailable,
    hip_module,
    probe_cuda,
    probe_hip,
)


def diagnose(env: Mapping[str, str] | None = None) -> list[Diagnosis]:
    env = os.environ if env is None else env
    findings: list[Diagnosis] = []
    try:
        backend = requested_backend(env)
    except EngineSettingError as exc:
        return [Diagnosis(False, "PIE_CUDA_BACKEND", str(exc), "unset PIE_CUDA_BACKEND, or set it to cuda or hip")]
    if backend in (None, "cuda"):
        findings.extend(_cuda())
    if backend == "hip" or (backend is None and hip_python_installed()):
        findings.extend(_hip())
    elif backend is None:
        findings.append(Diagnosis(True, "hip-python (AMD GPUs)", f"not installed; only AMD GPUs need it: {FIX_HIP_PYTHON}"))
    findings.append(Diagnosis(True, "kernel cache", str(default_cache_dir("cuda", env))))
    return findings


def _cuda() -> list[Diagnosis]:
    try:
        import cuda.bindings
    except ImportError as exc:
        return [Diagnosis(False, "cuda-python", f"not importable: {exc}", FIX_CUDA_PYTHON)]
    findings = [Diagnosis(True, "cuda-python", f"cuda.bindings {cuda.bindings.__version__}")]
    try:
        from pie_engine_cuda.compiler import Nvrtc

        nvrtc = Nvrtc()
        archs = nvrtc.supported_archs
        findings.append(Diagnosis(True, "NVRTC", f"NVRTC {nvrtc.version}, targets sm_{min(archs)} to sm_{max(archs)}"))
    except Exception as exc:  # noqa: BLE001 - report, do not raise
        findings.append(Diagnosis(False, "NVRTC", f"cannot be loaded: {exc}", FIX_NVRTC))
    return _with_devices(findings, probe_cuda, "NVIDIA GPU", FIX_NO_GPU)


def _hip() -> list[Diagnosis]:
    try:
        hip_module()
    except DriverUnavailable as exc:
        return [Diagnosis(False, exc.what, str(exc), exc.fix)]
    findings = [Diagnosis(True, "hip-python (AMD GPUs)", "installed")]
    try:
        from pie_engine_cuda.hiprtc_lib import load_hiprtc

        rtc = load_hiprtc()
        findings.append(Diagnosis(True, "hiprtc", f"hiprtc {rtc.version()} from {rtc.origin}"))
    except Exception as exc:  # noqa: BLE001
        findings.append(Diagnosis(False, "hiprtc", str(exc), FIX_HIPRTC))
    return _with_devices(findings, probe_hip, "AMD GPU", FIX_AMD_GPU)


def _with_devices(findings: list[Diagnosis], probe: Callable[[], list[Any]], what: str, fix: str) -> list[Diagnosis]:
    """``findings`` and what the probe finds: its devices and driver, or what stops it (once)."""
    try:
        devices = probe()
    except DriverUnavailable as exc:
        if all(finding.what != exc.what for finding in findings):
            findings.append(Diagnosis(False, exc.what, str(exc), exc.fix))
        return findings
    names = ", ".join(f"{device.name} ({device.driver})" for device in devices)
    findings.append(Diagnosis(bool(devices), what, names or "the driver is installed but sees no GPU", "" if devices else fix))
    return findings
