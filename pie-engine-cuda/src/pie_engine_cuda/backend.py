"""Which GPU API serves the engine: CUDA, HIP (AMD) or the host emulator.

``PIE_CUDA_BACKEND`` forces one (``cuda``, ``hip``, ``emulator``). Unset, HIP is
used when hip-python (the ``rocm`` extra) is installed and finds an AMD GPU, CUDA
otherwise; the emulator is never chosen on its own.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping

from pie_engine_cuda.api import DeviceFacts, GpuApi
from pie_engine_cuda.compiler import Compiler

BACKEND_ENV = "PIE_CUDA_BACKEND"
BACKENDS = ("cuda", "hip", "emulator")


def requested_backend(env: Mapping[str, str] | None = None) -> str | None:
    value = (os.environ if env is None else env).get(BACKEND_ENV, "").strip().lower()
    if not value:
        return None
    if value not in BACKENDS:
        raise ValueError(f"{BACKEND_ENV}={value!r} is not one of {', '.join(BACKENDS)}")
    return value


def hip_python_installed() -> bool:
    return importlib.util.find_spec("hip") is not None


def probe_backend(backend: str) -> list[DeviceFacts]:
    if backend == "cuda":
        from pie_engine_cuda.cuda_api import probe_cuda

        return probe_cuda()
    if backend == "hip":
        from pie_engine_cuda.hip_api import probe_hip

        return probe_hip()
    from pie_engine_cuda.emulator_api import probe_emulator

    return probe_emulator()


def probe(env: Mapping[str, str] | None = None) -> tuple[str, list[DeviceFacts]]:
    """(backend, devices); raises with a message naming what is missing when no backend can work."""
    forced = requested_backend(env)
    if forced is not None:
        return forced, probe_backend(forced)
    hip_problem = ""
    if hip_python_installed():
        try:
            devices = probe_backend("hip")
        except Exception as exc:  # noqa: BLE001 - fall back to CUDA, but keep the reason
            hip_problem = f"{type(exc).__name__}: {exc}"
        else:
            if devices:
                return "hip", devices
            hip_problem = "HIP found no AMD GPU"
    from pie_engine_cuda.cuda_api import CudaUnavailable

    try:
        return "cuda", probe_backend("cuda")
    except CudaUnavailable as exc:
        if hip_problem:
            raise CudaUnavailable(f"{exc}; and for AMD GPUs: {hip_problem}") from exc
        raise


def make_api(backend: str, facts: DeviceFacts) -> GpuApi:
    if backend == "cuda":
        from pie_engine_cuda.cuda_api import CudaApi

        return CudaApi(facts)
    if backend == "hip":
        from pie_engine_cuda.hip_api import HipApi

        return HipApi(facts)
    from pie_engine_cuda.emulator_api import EmulatorApi

    return EmulatorApi(facts)


def make_compiler(backend: str) -> Compiler:
    from pie_engine_cuda.compiler import Hiprtc, HostCompiler, Nvrtc

    if backend == "cuda":
        return Nvrtc()
    if backend == "hip":
        return Hiprtc()
    return HostCompiler()
