"""``pie doctor`` for the CUDA engine: each library, driver and device it needs, with the fix."""

from __future__ import annotations

import os
from collections.abc import Mapping

from pie.contract import Diagnosis

from pie_engine_cuda.backend import hip_python_installed, requested_backend
from pie.enginekit.compile_cache import default_cache_dir

FIX_CUDA_PYTHON = "pip install cuda-python"
FIX_NVRTC = "pip install nvidia-cuda-nvrtc   # CUDA 12 drivers: pip install 'pie-engine-cuda[cu12]'"
FIX_DRIVER = (
    "sudo ubuntu-drivers install   # or: sudo apt-get install nvidia-driver-570, then reboot; "
    "in a container: docker run --gpus all ..."
)
FIX_NO_GPU = "nvidia-smi must list the GPU: sudo modprobe nvidia, check dmesg; in a container pass --gpus all"
FIX_HIP_PYTHON = "pip install 'pie-engine-cuda[rocm]'   # hip-python matching your ROCm version"
FIX_HIPRTC = "install ROCm (https://rocm.docs.amd.com), e.g. sudo apt-get install libamdhip64-dev"
FIX_AMD_GPU = "rocminfo must list the GPU: load the amdgpu driver and add your user to the render and video groups"


def diagnose(env: Mapping[str, str] | None = None) -> list[Diagnosis]:
    env = os.environ if env is None else env
    findings: list[Diagnosis] = []
    try:
        backend = requested_backend(env)
    except ValueError as exc:
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
    findings = []
    try:
        import cuda.bindings
        from cuda.bindings import driver
    except ImportError as exc:
        return [Diagnosis(False, "cuda-python", f"not importable: {exc}", FIX_CUDA_PYTHON)]
    findings.append(Diagnosis(True, "cuda-python", f"cuda.bindings {cuda.bindings.__version__}"))

    nvrtc_major = None
    try:
        from pie_engine_cuda.compiler import Nvrtc

        nvrtc = Nvrtc()
        archs = nvrtc.supported_archs
        nvrtc_major = int(nvrtc.version.split(".")[0])
        findings.append(Diagnosis(True, "NVRTC", f"NVRTC {nvrtc.version}, targets sm_{min(archs)} to sm_{max(archs)}"))
    except Exception as exc:  # noqa: BLE001 - report, do not raise
        findings.append(Diagnosis(False, "NVRTC", f"cannot be loaded: {exc}", FIX_NVRTC))

    from pie_engine_cuda.driver_api import DriverUnavailable, check, error_text, init_driver

    try:
        err = init_driver(driver)
    except DriverUnavailable:
        findings.append(
            Diagnosis(False, "NVIDIA driver (libcuda.so.1)", "not found: no NVIDIA driver is installed or visible", FIX_DRIVER)
        )
        return findings
    version = check(driver, driver.cuDriverGetVersion(), "cuDriverGetVersion")
    driver_major = version // 1000
    findings.append(Diagnosis(True, "NVIDIA driver (libcuda.so.1)", f"CUDA {driver_major}.{version % 1000 // 10}"))
    if nvrtc_major is not None and driver_major < nvrtc_major:
        findings.append(
            Diagnosis(
                False,
                "driver and NVRTC versions",
                f"the driver speaks CUDA {driver_major}, NVRTC {nvrtc_major} emits code it cannot load",
                f"update the NVIDIA driver, or: pip install 'pie-engine-cuda[cu{driver_major}]'",
            )
        )
    if err == driver.CUresult.CUDA_ERROR_NO_DEVICE:
        findings.append(Diagnosis(False, "NVIDIA GPU", "the driver is installed but sees no GPU", FIX_NO_GPU))
    elif err != driver.CUresult.CUDA_SUCCESS:
        findings.append(Diagnosis(False, "NVIDIA GPU", f"cuInit failed: {error_text(driver, err)}", FIX_NO_GPU))
    else:
        count = check(driver, driver.cuDeviceGetCount(), "cuDeviceGetCount")
        names = []
        for ordinal in range(count):
            device = check(driver, driver.cuDeviceGet(ordinal), "cuDeviceGet")
            names.append(bytes(check(driver, driver.cuDeviceGetName(256, device), "cuDeviceGetName")).split(b"\0")[0].decode())
        findings.append(Diagnosis(bool(count), "NVIDIA GPU", ", ".join(names) or "none", "" if count else FIX_NO_GPU))
    return findings


def _hip() -> list[Diagnosis]:
    findings = []
    try:
        from pie_engine_cuda.driver_api import hip_module

        hip = hip_module()
    except Exception as exc:  # noqa: BLE001
        return [Diagnosis(False, "hip-python (AMD GPUs)", str(exc), FIX_HIP_PYTHON)]
    findings.append(Diagnosis(True, "hip-python (AMD GPUs)", "installed"))
    try:
        from pie_engine_cuda.hiprtc_lib import load_hiprtc

        rtc = load_hiprtc()
        findings.append(Diagnosis(True, "hiprtc", f"hiprtc {rtc.version()} from {rtc.origin}"))
    except Exception as exc:  # noqa: BLE001
        findings.append(Diagnosis(False, "hiprtc", str(exc), FIX_HIPRTC))
    from pie_engine_cuda.driver_api import DriverUnavailable, init_hip

    try:
        err = init_hip(hip)
    except DriverUnavailable as exc:
        findings.append(Diagnosis(False, "HIP runtime (libamdhip64)", str(exc), FIX_HIPRTC))
        return findings
    if err != hip.hipError_t.hipSuccess:
        findings.append(Diagnosis(False, "AMD GPU", f"hipInit: {err.name if hasattr(err, 'name') else err}", FIX_AMD_GPU))
        return findings
    count = hip.hipGetDeviceCount()[1]
    findings.append(Diagnosis(bool(count), "AMD GPU", f"{count} device(s)", "" if count else FIX_AMD_GPU))
    return findings
